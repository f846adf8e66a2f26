package faulty_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/engine/transporttest"
)

func newTCP(t *testing.T) *tcp.Transport {
	t.Helper()
	tr, err := tcp.New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// With no knobs the decorator is transparent: it passes the whole suite.
func TestPassThroughConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return faulty.Wrap(newTCP(t)), faulty.Wrap(newTCP(t))
	}, transporttest.WithLargeBytes(0))
}

// rig is a faulty sender over tcp to a plain tcp receiver with 1 MiB each side.
type rig struct {
	t        *testing.T
	ctx      context.Context
	send     *faulty.Transport
	recv     *tcp.Transport
	src, dst *transport.HostBuffer
	dstDesc  transport.RegionDesc
	seg      transport.Segment
}

func newRig(t *testing.T, opts ...faulty.Option) *rig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	r := &rig{t: t, ctx: ctx}
	var err error
	if r.src, err = transport.AllocHost("src", 1<<20); err != nil {
		t.Fatal(err)
	}
	if r.dst, err = transport.AllocHost("dst", 1<<20); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.src.Close(); r.dst.Close() })
	for i := range r.src.Bytes() {
		r.src.Bytes()[i] = byte(i*7 + 1)
	}
	r.send = faulty.Wrap(newTCP(t), opts...)
	r.recv = newTCP(t)
	t.Cleanup(func() {
		if r.seg != nil {
			r.seg.Close()
		}
		r.send.Close()
		r.recv.Close()
	})
	return r
}

func (r *rig) register() {
	r.t.Helper()
	if _, err := r.send.RegisterMemory(r.src.Memory()); err != nil {
		r.t.Fatal(err)
	}
	var err error
	if r.dstDesc, err = r.recv.RegisterMemory(r.dst.Memory()); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rig) open(regions ...transport.RegionDesc) (transport.Segment, error) {
	if len(regions) == 0 {
		regions = []transport.RegionDesc{r.dstDesc}
	}
	return r.send.OpenSegment(r.ctx, transport.SegmentInfo{Endpoint: []byte(r.recv.Addr()), Regions: regions})
}

func (r *rig) setup() {
	r.t.Helper()
	r.register()
	var err error
	if r.seg, err = r.open(); err != nil {
		r.t.Fatal(err)
	}
}

// batch writes n bytes at off (same offset both sides).
func (r *rig) batch(off, n int) *transport.TransferBatch {
	return &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: r.src.Addr() + uintptr(off), Remote: r.dstDesc.ID, RemoteOffset: uint64(off), Length: uint64(n)}}}
}

func (r *rig) run(b *transport.TransferBatch) transport.BatchStatus {
	r.t.Helper()
	id, err := r.seg.Submit(r.ctx, b)
	if err != nil {
		r.t.Fatalf("Submit: %v", err)
	}
	st, err := r.seg.Wait(r.ctx, id)
	if err != nil {
		r.t.Fatalf("Wait: %v", err)
	}
	r.seg.Release(id)
	return st
}

func (r *rig) landed(off, n int) bool {
	for i := off; i < off+n; i++ {
		if r.dst.Bytes()[i] != r.src.Bytes()[i] {
			return false
		}
	}
	return true
}

func injected(err error, also error) bool {
	return errors.Is(err, faulty.ErrInjected) && errors.Is(err, also)
}

func TestFailAfter(t *testing.T) {
	r := newRig(t, faulty.FailAfter(2))
	r.setup()
	for i := 0; i < 2; i++ {
		if st := r.run(r.batch(i*4096, 4096)); st.State != transport.BatchCompleted {
			t.Fatalf("batch %d: %v %v, want completed", i+1, st.State, st.Err)
		}
	}
	st := r.run(r.batch(8192, 4096))
	if st.State != transport.BatchFailed || !injected(st.Err, transport.ErrPeerLost) {
		t.Fatalf("batch 3: %v %v, want failed with ErrInjected+ErrPeerLost", st.State, st.Err)
	}
	if r.landed(8192, 4096) || !r.landed(0, 8192) {
		t.Fatalf("FailAfter batch must send nothing and earlier batches must land")
	}
}

func TestRejectAfter(t *testing.T) {
	r := newRig(t, faulty.RejectAfter(1), faulty.FailWith(transport.ErrClosed))
	r.setup()
	if st := r.run(r.batch(0, 100)); st.State != transport.BatchCompleted {
		t.Fatalf("first batch: %v %v", st.State, st.Err)
	}
	if _, err := r.seg.Submit(r.ctx, r.batch(100, 100)); !injected(err, transport.ErrClosed) {
		t.Fatalf("second Submit: %v, want ErrInjected+ErrClosed", err)
	}
	if r.send.Submits() != 2 {
		t.Errorf("Submits() = %d, want 2", r.send.Submits())
	}
}

func TestDelay(t *testing.T) {
	const d = 300 * time.Millisecond
	r := newRig(t, faulty.Delay(d))
	r.setup()
	start := time.Now()
	id, err := r.seg.Submit(r.ctx, r.batch(0, 4096))
	if err != nil {
		t.Fatal(err)
	}
	st, err := r.seg.Poll(id)
	if err != nil {
		t.Fatal(err)
	}
	if time.Since(start) < d && st.State.Terminal() {
		t.Fatalf("Poll before the delay elapsed = %v, want pending", st.State)
	}
	st, err = r.seg.Wait(r.ctx, id)
	if err != nil || st.State != transport.BatchCompleted {
		t.Fatalf("Wait: %v %v %v", st.State, st.Err, err)
	}
	if el := time.Since(start); el < d {
		t.Fatalf("batch completed after %v, before the %v delay", el, d)
	}
	r.seg.Release(id)
}

func TestFlipStatus(t *testing.T) {
	r := newRig(t, faulty.FlipStatus(1, 2))
	r.register()
	fake := transport.RegionDesc{ID: r.dstDesc.ID + 50, Length: 1 << 20}
	seg, err := r.open(r.dstDesc, fake)
	if err != nil {
		t.Fatal(err)
	}
	r.seg = seg
	// 1: a good batch reported failed.
	st := r.run(r.batch(0, 4096))
	if st.State != transport.BatchFailed || !injected(st.Err, transport.ErrPeerLost) {
		t.Fatalf("flipped good batch: %v %v, want failed", st.State, st.Err)
	}
	if !r.landed(0, 4096) {
		t.Fatalf("flipped good batch must still land its bytes")
	}
	// 2: a batch the receiver refuses (unknown region) reported completed.
	b := r.batch(4096, 4096)
	b.Requests[0].Remote = fake.ID
	if st := r.run(b); st.State != transport.BatchCompleted || st.Err != nil {
		t.Fatalf("flipped refused batch: %v %v, want completed (a lying transport)", st.State, st.Err)
	}
	// 3: not flipped.
	if st := r.run(r.batch(8192, 16)); st.State != transport.BatchCompleted {
		t.Fatalf("batch 3: %v %v", st.State, st.Err)
	}
}

func TestCorruptData(t *testing.T) {
	r := newRig(t, faulty.CorruptData(2))
	r.setup()
	if st := r.run(r.batch(0, 4096)); st.State != transport.BatchCompleted || !r.landed(0, 4096) {
		t.Fatalf("batch 1: %v %v", st.State, st.Err)
	}
	if st := r.run(r.batch(4096, 8192)); st.State != transport.BatchCompleted {
		t.Fatalf("corrupted batch: %v %v, want completed", st.State, st.Err)
	}
	if got, want := r.dst.Bytes()[4096], ^r.src.Bytes()[4096]; got != want {
		t.Fatalf("corrupted byte = %#x, want %#x (complement of the source)", got, want)
	}
	if !r.landed(4097, 8191) {
		t.Fatalf("bytes after the corrupted one must land intact")
	}
}

func TestFailRegisterAfter(t *testing.T) {
	r := newRig(t, faulty.FailRegisterAfter(1))
	if _, err := r.send.RegisterMemory(r.src.Memory()); err != nil {
		t.Fatal(err)
	}
	if _, err := r.send.RegisterMemory(r.dst.Memory()); !injected(err, transport.ErrPeerLost) {
		t.Fatalf("second RegisterMemory: %v, want ErrInjected", err)
	}
}

func TestFailInstall(t *testing.T) {
	r := newRig(t, faulty.FailInstall(), faulty.FailWith(transport.ErrUnavailable))
	r.register()
	if _, err := r.open(); !injected(err, transport.ErrUnavailable) {
		t.Fatalf("OpenSegment: %v, want ErrInjected+ErrUnavailable", err)
	}
}

func TestDelayWrites(t *testing.T) {
	const d = 300 * time.Millisecond
	r := newRig(t, faulty.DelayWrites(d))
	r.setup()
	start := time.Now()
	id, err := r.seg.Submit(r.ctx, r.batch(0, 4096))
	if err != nil {
		t.Fatal(err)
	}
	if r.landed(0, 4096) && time.Since(start) < d {
		t.Fatal("bytes landed before the write delay")
	}
	st, err := r.seg.Wait(r.ctx, id)
	if err != nil || st.State != transport.BatchCompleted || !r.landed(0, 4096) {
		t.Fatalf("Wait: %v %v %v, landed %v", st.State, st.Err, err, r.landed(0, 4096))
	}
	if el := time.Since(start); el < d {
		t.Fatalf("landed after %v, before the %v delay", el, d)
	}
	r.seg.Release(id)
	// A delayed batch canceled in time never lands (a live writer stops).
	id, err = r.seg.Submit(r.ctx, r.batch(8192, 4096))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.seg.Cancel(id); err != nil {
		t.Fatal(err)
	}
	st, err = r.seg.Wait(r.ctx, id)
	if err != nil || st.State != transport.BatchCanceled || !errors.Is(st.Err, transport.ErrCanceled) {
		t.Fatalf("canceled delayed batch: %v %v %v", st.State, st.Err, err)
	}
	time.Sleep(d)
	if r.landed(8192, 1) {
		t.Fatal("a canceled delayed batch landed")
	}
}

func TestStallResume(t *testing.T) {
	r := newRig(t, faulty.StallAfter(1))
	r.setup()
	if st := r.run(r.batch(0, 4096)); st.State != transport.BatchCompleted {
		t.Fatalf("batch 1: %v %v", st.State, st.Err)
	}
	id, err := r.seg.Submit(r.ctx, r.batch(4096, 4096))
	if err != nil {
		t.Fatal(err)
	}
	// A stopped producer ignores Cancel: the batch stays held...
	if err := r.seg.Cancel(id); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(r.ctx, 300*time.Millisecond)
	st, err := r.seg.Wait(ctx, id)
	cancel()
	if err == nil || st.State.Terminal() || r.landed(4096, 1) {
		t.Fatalf("stalled batch: %v %v, landed %v; want still held", st.State, err, r.landed(4096, 1))
	}
	// ...and lands, stale, when the producer resumes.
	r.send.Resume()
	st, err = r.seg.Wait(r.ctx, id)
	if err != nil || !st.State.Terminal() {
		t.Fatalf("after Resume: %v %v", st.State, err)
	}
	if !r.landed(4096, 4096) {
		t.Fatal("the held batch did not land after Resume")
	}
	r.seg.Release(id)
	if st := r.run(r.batch(8192, 4096)); st.State != transport.BatchCompleted {
		t.Fatalf("batch after Resume: %v %v", st.State, st.Err)
	}
}

func TestKillMidBatch(t *testing.T) {
	r := newRig(t, faulty.KillMidBatch(2))
	r.setup()
	if st := r.run(r.batch(0, 4096)); st.State != transport.BatchCompleted {
		t.Fatalf("batch 1: %v %v", st.State, st.Err)
	}
	b := &transport.TransferBatch{Requests: append(r.batch(4096, 4096).Requests, r.batch(8192, 4096).Requests...)}
	if st := r.run(b); st.State != transport.BatchFailed || !injected(st.Err, transport.ErrPeerLost) {
		t.Fatalf("killed batch: %v %v, want failed with ErrInjected+ErrPeerLost", st.State, st.Err)
	}
	if _, err := r.seg.Submit(r.ctx, r.batch(12288, 4096)); err == nil || !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("submit after the kill: %v, want the segment closed", err)
	}
}

func TestDropControl(t *testing.T) {
	d := faulty.DropControl()
	if d.Filter("p", control.MsgStatus) {
		t.Fatal("dropped with no knob set")
	}
	d.DropNext(control.MsgStatus, 2)
	if n := d.Pending(control.MsgStatus); n != 2 {
		t.Fatalf("Pending(STATUS) = %d after DropNext(STATUS, 2)", n)
	}
	got := []bool{d.Filter("p", control.MsgPing), d.Filter("p", control.MsgStatus), d.Filter("p", control.MsgStatus), d.Filter("p", control.MsgStatus)}
	if want := []bool{false, true, true, false}; !reflect.DeepEqual(got, want) {
		t.Fatalf("DropNext(STATUS, 2): dropped %v, want %v", got, want)
	}
	if n := d.Pending(control.MsgStatus); n != 0 {
		t.Fatalf("Pending(STATUS) = %d after both were dropped", n)
	}
	d.DropFor(time.Hour)
	if !d.Filter("p", control.MsgPing) || d.Dropped("") != 3 || d.Dropped(control.MsgStatus) != 2 {
		t.Fatalf("DropFor: counts %d/%d", d.Dropped(""), d.Dropped(control.MsgStatus))
	}
}

// readBatch reads n bytes at off of the receiver into the sender's memory
// (same offset both sides).
func (r *rig) readBatch(off, n int) *transport.TransferBatch {
	b := r.batch(off, n)
	b.Op = transport.OpRead
	return b
}

// Reads are forwarded and take the knobs like writes: CorruptData
// complements the first byte read, KillMidBatch reads half the requests and
// closes the segment, a stalled read copies only after Resume.
func TestReadFaults(t *testing.T) {
	readBack := func(r *rig, off, n int) bool {
		for i := off; i < off+n; i++ {
			if r.src.Bytes()[i] != r.dst.Bytes()[i] {
				return false
			}
		}
		return true
	}
	t.Run("CorruptData", func(t *testing.T) {
		r := newRig(t, faulty.CorruptData(2))
		r.setup()
		fill := func() {
			for i := range r.dst.Bytes() {
				r.dst.Bytes()[i] = byte(i*13 + 5)
			}
		}
		fill()
		if st := r.run(r.readBatch(0, 4096)); st.State != transport.BatchCompleted || !readBack(r, 0, 4096) {
			t.Fatalf("read 1: %v %v", st.State, st.Err)
		}
		if st := r.run(r.readBatch(4096, 8192)); st.State != transport.BatchCompleted {
			t.Fatalf("corrupted read: %v %v, want completed", st.State, st.Err)
		}
		if got, want := r.src.Bytes()[4096], ^r.dst.Bytes()[4096]; got != want {
			t.Fatalf("corrupted byte read = %#x, want %#x (complement of the remote byte)", got, want)
		}
		if !readBack(r, 4097, 8191) {
			t.Fatalf("bytes after the corrupted one must be read intact")
		}
	})
	t.Run("KillMidBatch", func(t *testing.T) {
		r := newRig(t, faulty.KillMidBatch(1))
		r.setup()
		b := &transport.TransferBatch{Op: transport.OpRead, Requests: append(r.batch(0, 4096).Requests, r.batch(8192, 4096).Requests...)}
		if st := r.run(b); st.State != transport.BatchFailed || !injected(st.Err, transport.ErrPeerLost) {
			t.Fatalf("killed read: %v %v, want failed with ErrInjected+ErrPeerLost", st.State, st.Err)
		}
		if _, err := r.seg.Submit(r.ctx, r.readBatch(0, 4096)); !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("read after the kill: %v, want the segment closed", err)
		}
	})
	t.Run("StallResume", func(t *testing.T) {
		r := newRig(t, faulty.StallAfter(0))
		r.setup()
		for i := range r.dst.Bytes()[:4096] {
			r.dst.Bytes()[i] = 0xA5
		}
		id, err := r.seg.Submit(r.ctx, r.readBatch(0, 4096))
		if err != nil {
			t.Fatal(err)
		}
		if st, _ := r.seg.Poll(id); st.State != transport.BatchPending {
			t.Fatalf("stalled read: %v, want pending", st.State)
		}
		if readBack(r, 0, 4096) {
			t.Fatalf("a stalled read copied before Resume")
		}
		r.send.Resume()
		st, err := r.seg.Wait(r.ctx, id)
		if err != nil || st.State != transport.BatchCompleted || !readBack(r, 0, 4096) {
			t.Fatalf("read after Resume: %+v %v", st, err)
		}
		r.seg.Release(id)
	})
}
