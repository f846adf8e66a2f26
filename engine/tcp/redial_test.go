package tcp_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestRedialAfterIdleReset: the receiver's data connections are reset
// between batches (ss -K). The next batch dials them again (same epoch) and
// lands, without failing. Once the receiver fences the epoch, the next batch
// fails with ErrFenced: a redial never revives a fenced data path.
func TestRedialAfterIdleReset(t *testing.T) {
	o := transport.DefaultOptions()
	o.Streams = 2
	snd, err := tcp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	rcv, err := tcp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer rcv.Close()
	src, err := transport.AllocHost("src", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := transport.AllocHost("dst", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i * 7)
	}
	if _, err := snd.RegisterMemory(src.Memory()); err != nil {
		t.Fatal(err)
	}
	dd, err := rcv.RegisterMemory(dst.Memory())
	if err != nil {
		t.Fatal(err)
	}
	const epoch = 7
	if err := rcv.AdmitEpoch("snd", epoch); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ep, err := rcv.Endpoint(ctx, "snd")
	if err != nil {
		t.Fatal(err)
	}
	seg, err := snd.OpenSegment(ctx, transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{dd}, Epoch: epoch})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	write := func(off uint64) transport.BatchStatus {
		t.Helper()
		id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr() + uintptr(off), Remote: dd.ID, RemoteOffset: off, Length: 256 << 10}}})
		if err != nil {
			return transport.BatchStatus{State: transport.BatchFailed, Err: err}
		}
		defer seg.Release(id)
		st, err := seg.Wait(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := write(0); st.State != transport.BatchCompleted {
		t.Fatalf("first batch: %+v", st)
	}
	if n := tcp.ResetInbound(rcv); n != 2 {
		t.Fatalf("reset %d inbound connections, want 2", n)
	}
	for deadline := time.Now().Add(30 * time.Second); tcp.DeadStreams(seg) < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 2 streams noticed the reset", tcp.DeadStreams(seg))
		}
	}
	if st := write(256 << 10); st.State != transport.BatchCompleted {
		t.Fatalf("batch after an idle reset: %+v, want it to land over redialled connections", st)
	}
	if got := snd.Redials(); got != 2 {
		t.Fatalf("%d redials, want 2", got)
	}
	if !bytes.Equal(dst.Bytes()[:512<<10], src.Bytes()[:512<<10]) {
		t.Fatal("bytes differ after the redial")
	}
	if err := rcv.FenceEpoch(ctx, "snd", epoch); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); tcp.DeadStreams(seg) < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("streams did not notice the fence")
		}
	}
	clear(dst.Bytes())
	if st := write(0); st.State == transport.BatchCompleted || !errors.Is(st.Err, transport.ErrFenced) {
		t.Fatalf("batch on a fenced epoch: %+v, want failed with ErrFenced", st)
	}
	if bytes.ContainsFunc(dst.Bytes()[:256<<10], func(r rune) bool { return r != 0 }) {
		t.Fatal("a write on a fenced epoch landed")
	}
}
