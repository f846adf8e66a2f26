package shm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// childEnv makes the test binary act as a receiver process (see TestMain).
const childEnv = "KVXFER_SHM_TEST_RECEIVER"

func TestMain(m *testing.M) {
	if size := os.Getenv(childEnv); size != "" {
		os.Exit(runReceiverChild(size))
	}
	os.Exit(m.Run())
}

// childInfo is what the receiver child prints on stdout.
type childInfo struct {
	Endpoint []byte
	Regions  []transport.RegionDesc
}

// runReceiverChild registers one region and prints its segment info, then
// waits for stdin to close (the parent kills it before that in the tests).
func runReceiverChild(size string) int {
	var n int64
	fmt.Sscan(size, &n)
	newT, mem := New, func() (transport.Memory, error) {
		buf, err := transport.AllocHost("child", n)
		if err != nil {
			return transport.Memory{}, err
		}
		return buf.Memory(), nil
	}
	if os.Getenv(childCMAEnv) != "" {
		// cma: the receiver's memory is its own (anonymous, no memfd).
		newT, mem = NewCMA, func() (transport.Memory, error) { return anonMemory(int(n)) }
	}
	tr, err := newT(transport.DefaultOptions())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m, err := mem()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	d, err := tr.RegisterMemory(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ep, _ := tr.Endpoint(context.Background(), "parent")
	json.NewEncoder(os.Stdout).Encode(childInfo{Endpoint: ep, Regions: []transport.RegionDesc{d}})
	bufio.NewReader(os.Stdin).ReadByte() // blocks until the parent goes away
	return 0
}

type pair struct {
	snd, rcv       transport.Transport
	src, dst       *transport.HostBuffer
	srcDesc, dDesc transport.RegionDesc
	seg            transport.Segment
}

func newPair(t *testing.T, size int64, opts transport.Options) *pair {
	t.Helper()
	p := &pair{}
	var err error
	if p.snd, err = New(opts); err != nil {
		t.Fatal(err)
	}
	if p.rcv, err = New(opts); err != nil {
		t.Fatal(err)
	}
	if p.src, err = transport.AllocHost("src", size); err != nil {
		t.Fatal(err)
	}
	if p.dst, err = transport.AllocHost("dst", size); err != nil {
		t.Fatal(err)
	}
	if p.srcDesc, err = p.snd.RegisterMemory(p.src.Memory()); err != nil {
		t.Fatal(err)
	}
	if p.dDesc, err = p.rcv.RegisterMemory(p.dst.Memory()); err != nil {
		t.Fatal(err)
	}
	ep, err := p.rcv.Endpoint(context.Background(), "snd")
	if err != nil {
		t.Fatal(err)
	}
	if p.seg, err = p.snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{p.dDesc}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.seg.Close()
		p.snd.Close()
		p.rcv.Close()
		p.src.Close()
		p.dst.Close()
	})
	for i := range p.src.Bytes() {
		p.src.Bytes()[i] = byte(i*7 + i>>9)
	}
	return p
}

func waitOK(t *testing.T, seg transport.Segment, id transport.BatchID) transport.BatchStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := seg.Wait(ctx, id)
	if err != nil {
		t.Fatalf("wait: %v", err)
	}
	return st
}

// submitErr submits reqs and returns the batch's failure: Submit's own error
// when it refuses the batch, else the error the batch ends with (nil when it
// completes). Submit only checks the peer's liveness cheaply, so a peer
// death is reported either way, by design; the batch's Wait is bounded.
func submitErr(t *testing.T, seg transport.Segment, reqs []transport.WriteRequest) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: reqs})
	if err != nil {
		return err
	}
	st, err := seg.Wait(ctx, id)
	if err != nil {
		t.Fatalf("wait on a batch to a lost peer: %v (hang?)", err)
	}
	if st.State == transport.BatchCompleted {
		return nil
	}
	return st.Err
}

func TestWriteVariants(t *testing.T) {
	const size = 8 << 20
	cases := []struct {
		name string
		req  func(p *pair) transport.WriteRequest
		opts transport.Options
	}{
		{"small", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr() + 100, Remote: p.dDesc.ID, RemoteOffset: 5000, Length: 3000}
		}, transport.DefaultOptions()},
		{"whole-parallel", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: size}
		}, transport.Options{Streams: 3, SHM: transport.SHMOptions{ParallelMinBytes: 1}}},
		{"strided", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr() + 64, Remote: p.dDesc.ID, RemoteOffset: 128, Length: 512, Count: 100, LocalStride: 1024, RemoteStride: 4096}
		}, transport.DefaultOptions()},
		// Token rows of a head-sliced room: blocks grouped into pieces of
		// up to 1 MiB, over several units, copied in parallel.
		{"strided-many-units", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr() + 8, Remote: p.dDesc.ID, RemoteOffset: 1000, Length: 1000, Count: 3500, LocalStride: 1000, RemoteStride: 2048}
		}, transport.Options{Streams: 3, SHM: transport.SHMOptions{ParallelMinBytes: 1}}},
		// SGLang's per-token head slices (1 KiB of each 2 KiB source
		// token into back-to-back 1 KiB rows): from 1 MiB a batch is
		// copied with non-temporal stores (streamMin).
		{"head-slices", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr() + 1024, Remote: p.dDesc.ID, RemoteOffset: 4096, Length: 1024, Count: 3000, LocalStride: 2048, RemoteStride: 1024}
		}, transport.DefaultOptions()},
		{"contiguous-odd", func(p *pair) transport.WriteRequest {
			return transport.WriteRequest{Local: p.src.Addr() + 3, Remote: p.dDesc.ID, RemoteOffset: 5, Length: 3<<20 + 77}
		}, transport.Options{Streams: 2, SHM: transport.SHMOptions{ParallelMinBytes: 1}}},
	}
	for _, c := range cases {
		// Each case with the default, without non-temporal stores, and
		// with them for every batch however small
		// (SHMOptions.StreamMinBytes).
		for _, sm := range []struct {
			name string
			min  uint64
		}{{"default", 0}, {"off", transport.SHMStreamOff}, {"1", 1}} {
			t.Run(c.name+"/stream="+sm.name, func(t *testing.T) {
				opts := c.opts
				opts.SHM.StreamMinBytes = sm.min
				testWriteVariant(t, size, opts, c.req)
			})
		}
	}
}

// testWriteVariant submits req's one request on a fresh pair and checks
// the receiver's whole region and counters against copy()'s image.
func testWriteVariant(t *testing.T, size int, opts transport.Options, req func(p *pair) transport.WriteRequest) {
	p := newPair(t, int64(size), opts)
	r := req(p)
	id, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{r}})
	if err != nil {
		t.Fatal(err)
	}
	st := waitOK(t, p.seg, id)
	if st.State != transport.BatchCompleted || st.BytesDone != r.Bytes() {
		t.Fatalf("status %+v, want completed with %d bytes", st, r.Bytes())
	}
	src, dst := p.src.Bytes(), p.dst.Bytes()
	want := make([]byte, size)
	lo := uint64(r.Local - p.src.Addr())
	for i := uint64(0); i < r.Blocks(); i++ {
		copy(want[r.RemoteOffset+i*r.RemoteStride:][:r.Length], src[lo+i*r.LocalStride:][:r.Length])
	}
	if !bytes.Equal(dst, want) {
		t.Fatal("receiver memory differs from the expected image")
	}
	if n, ok := CommittedBytes(p.rcv); !ok || n != r.Bytes() {
		t.Fatalf("CommittedBytes = %d, %v; want %d", n, ok, r.Bytes())
	}
	p.seg.Release(id)
	if _, err := p.seg.Poll(id); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Fatalf("poll after release: %v, want ErrUnknownBatch", err)
	}
}

// TestStreamMinOption: SHMOptions.StreamMinBytes reaches the transport
// (0 the default, SHMStreamOff never, any other value as given), and the
// environment no longer does: KVXFER_SHM_STREAM_MIN is read by the edges
// (kvxfer, the C ABI), never by the engine.
func TestStreamMinOption(t *testing.T) {
	for _, c := range []struct {
		opt, want uint64
	}{{0, defaultStreamMin}, {transport.SHMStreamOff, transport.SHMStreamOff}, {1, 1}, {4 << 20, 4 << 20}} {
		opts := transport.DefaultOptions()
		opts.SHM.StreamMinBytes = c.opt
		tr, err := New(opts)
		if err != nil {
			t.Fatal(err)
		}
		if got := tr.(*shmTransport).streamMin; got != c.want {
			t.Errorf("StreamMinBytes %d: streamMin %d, want %d", c.opt, got, c.want)
		}
		tr.Close()
	}
	t.Setenv("KVXFER_SHM_STREAM_MIN", "lots")
	tr, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatalf("New with KVXFER_SHM_STREAM_MIN=lots: %v; the engine must not read the environment", err)
	}
	if got := tr.(*shmTransport).streamMin; got != defaultStreamMin {
		t.Errorf("KVXFER_SHM_STREAM_MIN=lots changed streamMin to %d", got)
	}
	tr.Close()
}

func TestSubmitRefused(t *testing.T) {
	const size = 1 << 20
	p := newPair(t, size, transport.DefaultOptions())
	other, err := transport.AllocHost("unregistered", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	cases := []struct {
		name string
		r    transport.WriteRequest
		want error
	}{
		{"remote past end", transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, RemoteOffset: size - 10, Length: 11}, transport.ErrOutOfBounds},
		{"remote offset overflow", transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, RemoteOffset: ^uint64(0) - 2, Length: 8}, transport.ErrOutOfBounds},
		{"stride overflow", transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 8, Count: 3, RemoteStride: 1 << 63}, transport.ErrOutOfBounds},
		{"strided last block past end", transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 8, Count: 2, LocalStride: 8, RemoteStride: size - 7}, transport.ErrOutOfBounds},
		{"local past end", transport.WriteRequest{Local: p.src.Addr() + size - 4, Remote: p.dDesc.ID, Length: 8}, transport.ErrOutOfBounds},
		{"local unregistered", transport.WriteRequest{Local: other.Addr(), Remote: p.dDesc.ID, Length: 8}, transport.ErrOutOfBounds},
		{"unknown region", transport.WriteRequest{Local: p.src.Addr(), Remote: 999, Length: 8}, transport.ErrUnknownRegion},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ok := transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 16}
			_, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{ok, c.r}})
			if !errors.Is(err, c.want) {
				t.Fatalf("submit: %v, want %v", err, c.want)
			}
			if !bytes.Equal(p.dst.Bytes()[:16], make([]byte, 16)) {
				t.Fatal("a refused batch wrote bytes")
			}
		})
	}
	// Deregistered by the receiver: refused even though the sender still maps it.
	if err := p.rcv.DeregisterMemory(p.dDesc.ID); err != nil {
		t.Fatal(err)
	}
	_, err = p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 8}}})
	if !errors.Is(err, transport.ErrUnknownRegion) {
		t.Fatalf("submit to deregistered region: %v, want ErrUnknownRegion", err)
	}
}

func TestRegisterRefused(t *testing.T) {
	tr, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	buf, err := transport.AllocHost("r", 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Close()
	noFD := buf.Memory()
	noFD.FD = -1
	_, err = tr.RegisterMemory(noFD)
	if !errors.Is(err, transport.ErrUnsupportedMemory) || !bytes.Contains([]byte(err.Error()), []byte("transport.AllocHost")) {
		t.Fatalf("register without fd: %v; want ErrUnsupportedMemory naming transport.AllocHost", err)
	}
	cuda := buf.Memory()
	cuda.Kind = transport.MemoryCUDA
	if _, err := tr.RegisterMemory(cuda); !errors.Is(err, transport.ErrUnsupportedMemory) {
		t.Fatalf("register cuda memory: %v", err)
	}
	big := buf.Memory()
	big.Length = 1 << 20
	if _, err := tr.RegisterMemory(big); !errors.Is(err, transport.ErrOutOfBounds) {
		t.Fatalf("register past the memfd's end: %v", err)
	}
}

func TestOtherHostUnavailable(t *testing.T) {
	snd, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	ep := snd.(*shmTransport).self
	ep.BootID[0] ^= 0xff
	_, err = snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep.encode(false)})
	if !errors.Is(err, transport.ErrUnavailable) {
		t.Fatalf("open segment to another boot id: %v, want ErrUnavailable", err)
	}
	// Right host, wrong process identity (start time): also unavailable.
	ep = snd.(*shmTransport).self
	ep.StartTime++
	if _, err = snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep.encode(false)}); !errors.Is(err, transport.ErrUnavailable) {
		t.Fatalf("open segment to a recycled pid: %v, want ErrUnavailable", err)
	}
	if _, err = snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: []byte("tcp://127.0.0.1:1")}); err == nil {
		t.Fatal("open segment with a foreign endpoint blob succeeded")
	}
}

func TestReceiverClosed(t *testing.T) {
	p := newPair(t, 1<<20, transport.DefaultOptions())
	p.rcv.Close()
	err := submitErr(t, p.seg, []transport.WriteRequest{{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 8}})
	if !errors.Is(err, transport.ErrPeerLost) && !errors.Is(err, transport.ErrUnknownRegion) {
		t.Fatalf("batch after receiver close: %v, want ErrPeerLost or ErrUnknownRegion", err)
	}
}

func TestCancelAndClosePending(t *testing.T) {
	const size = 64 << 20
	p := newPair(t, size, transport.Options{Streams: 2, SHM: transport.SHMOptions{ParallelMinBytes: 1}})
	reqs := make([]transport.WriteRequest, 8)
	for i := range reqs {
		reqs[i] = transport.WriteRequest{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: size}
	}
	id, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.seg.Cancel(id); err != nil {
		t.Fatal(err)
	}
	st := waitOK(t, p.seg, id)
	if st.State != transport.BatchCanceled && st.State != transport.BatchCompleted {
		t.Fatalf("after cancel: %+v", st)
	}
	if st.State == transport.BatchCanceled && !errors.Is(st.Err, transport.ErrCanceled) {
		t.Fatalf("canceled batch error %v", st.Err)
	}
	id2, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	p.seg.Close()
	st, err = p.seg.Poll(id2)
	if err != nil {
		t.Fatal(err)
	}
	if !st.State.Terminal() || (st.State == transport.BatchFailed && !errors.Is(st.Err, transport.ErrClosed)) {
		t.Fatalf("after segment close: %+v", st)
	}
	if _, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: reqs[:1]}); !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("submit after close: %v", err)
	}
}

// TestReceiverKilled runs the receiver in a child process, SIGKILLs it while
// batches are in flight, and checks the sender reports ErrPeerLost (no hang).
func TestReceiverKilled(t *testing.T) {
	const size = 32 << 20
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", childEnv, size))
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() }()
	var info childInfo
	if err := json.NewDecoder(out).Decode(&info); err != nil {
		t.Fatalf("read child segment info: %v", err)
	}
	snd, err := New(transport.Options{Streams: 2, SHM: transport.SHMOptions{ParallelMinBytes: 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	src, err := transport.AllocHost("src", size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := snd.RegisterMemory(src.Memory()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	seg, err := snd.OpenSegment(ctx, transport.SegmentInfo{Endpoint: info.Endpoint, Regions: info.Regions})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	reqs := make([]transport.WriteRequest, 16)
	for i := range reqs {
		reqs[i] = transport.WriteRequest{Local: src.Addr(), Remote: info.Regions[0].ID, Length: size}
	}
	// One healthy batch first.
	id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: reqs[:1]})
	if err != nil {
		t.Fatal(err)
	}
	if st := waitOK(t, seg, id); st.State != transport.BatchCompleted {
		t.Fatalf("healthy batch: %+v", st)
	}
	id, err = seg.Submit(ctx, &transport.TransferBatch{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	st, err := seg.Wait(ctx, id)
	if err != nil {
		t.Fatalf("wait after the receiver was killed: %v (hang?)", err)
	}
	// The big batch may have finished before the kill landed; then the next
	// batch must report the loss (from Submit, or when it ends).
	if st.State == transport.BatchCompleted {
		err = submitErr(t, seg, reqs[:1])
	} else {
		err = st.Err
	}
	if !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("after the receiver was killed: status %+v, err %v; want ErrPeerLost", st, err)
	}
}

func FuzzDecodeEndpoint(f *testing.F) {
	f.Add(endpoint{PID: 42, StartTime: 7, CtlFD: 3}.encode(false))
	f.Add([]byte("KVXS"))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEndpoint(b, false)
		if err != nil {
			return
		}
		if !bytes.Equal(e.encode(false), b) {
			t.Fatalf("round trip changed %x", b)
		}
	})
}

func FuzzDecodeKey(f *testing.F) {
	f.Add(regionKey{FD: 9, Offset: 4096, Dev: 1, Ino: 2}.encode())
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		k, err := decodeKey(b)
		if err != nil {
			return
		}
		if !bytes.Equal(k.encode(), b) {
			t.Fatalf("round trip changed %x", b)
		}
	})
}

func TestParseBootID(t *testing.T) {
	id, err := parseBootID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n")
	if err != nil || fmtBootID(id) != "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0" {
		t.Fatalf("parse: %v %s", err, fmtBootID(id))
	}
	for _, bad := range []string{"", "xyz", "0f1e2d3c-4b5a-6978-8796"} {
		if _, err := parseBootID(bad); err == nil {
			t.Fatalf("parseBootID(%q) succeeded", bad)
		}
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			snd, _ := New(transport.DefaultOptions())
			rcv, _ := New(transport.DefaultOptions())
			defer snd.Close()
			defer rcv.Close()
			src, _ := transport.AllocHost("src", size)
			dst, _ := transport.AllocHost("dst", size)
			defer src.Close()
			defer dst.Close()
			snd.RegisterMemory(src.Memory())
			d, _ := rcv.RegisterMemory(dst.Memory())
			ep, _ := rcv.Endpoint(context.Background(), "")
			seg, err := snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{d}})
			if err != nil {
				b.Fatal(err)
			}
			defer seg.Close()
			tb := &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: d.ID, Length: uint64(size)}}}
			b.SetBytes(size)
			b.ResetTimer()
			for range b.N {
				id, err := seg.Submit(context.Background(), tb)
				if err != nil {
					b.Fatal(err)
				}
				if st, _ := seg.Wait(context.Background(), id); st.State != transport.BatchCompleted {
					b.Fatal(st)
				}
				seg.Release(id)
			}
		})
	}
}
