package segengine_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/segengine"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// newTE starts a TransferEngine on the named transport (loopback).
func newTE(t testing.TB, transportName string, mod ...func(*segengine.TransferEngineConfig)) *segengine.TransferEngine {
	t.Helper()
	tr, err := transport.OpenTransport(transportName, transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	cfg := segengine.TransferEngineConfig{Transport: tr, RPCTimeout: 5 * time.Second}
	for _, m := range mod {
		m(&cfg)
	}
	te, err := segengine.NewTransferEngine(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.Close() })
	return te
}

// regBuf allocates and registers n bytes with te.
func regBuf(t testing.TB, te *segengine.TransferEngine, name string, n int64) (*transport.HostBuffer, transport.RegionDesc) {
	t.Helper()
	b, err := transport.AllocHost(name, n)
	if err != nil {
		t.Fatal(err)
	}
	d, err := te.RegisterMemory(b.Memory())
	if err != nil {
		b.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = te.DeregisterMemory(d.ID); b.Close() })
	return b, d
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

// writeSync submits peer-addressed writes and waits for completion.
func writeSync(t *testing.T, seg *segengine.RemoteSegment, ws ...segengine.PeerWrite) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := seg.SubmitPeerWrites(ctx, ws)
	if err != nil {
		return err
	}
	defer seg.Release(id)
	st, err := seg.Wait(ctx, id)
	if err != nil {
		return err
	}
	if st.State != transport.BatchCompleted {
		return fmt.Errorf("batch %v: %w", st.State, st.Err)
	}
	return nil
}

func TestTransferEngineNamedSegment(t *testing.T) {
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			recv := newTE(t, tn)
			send := newTE(t, tn)
			if want := "127.0.0.1:" + strconv.Itoa(recv.RPCPort()); recv.Name() != want {
				t.Fatalf("Name() = %q, want %q (host:rpc_port)", recv.Name(), want)
			}
			if recv.Epoch() == 0 || recv.Epoch() == send.Epoch() {
				t.Fatalf("epochs %#x and %#x: want distinct non-zero values", recv.Epoch(), send.Epoch())
			}
			dst, dd := regBuf(t, recv, "dst", 1<<20)
			src, _ := regBuf(t, send, "src", 1<<20)
			fill(src.Bytes(), 3)
			seg, err := send.OpenSegment(context.Background(), recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if d := seg.Descriptor(); d.Epoch != recv.Epoch() || len(d.Regions) != 1 || d.Regions[0].Addr != uint64(dst.Addr()) {
				t.Fatalf("descriptor %+v: want epoch %#x and region %d at %#x", d, recv.Epoch(), dd.ID, dst.Addr())
			}
			// Two writes by peer virtual address, one strided.
			err = writeSync(t, seg,
				segengine.PeerWrite{Local: src.Addr() + 100, PeerAddr: uint64(dst.Addr()) + 4096, Length: 10000},
				segengine.PeerWrite{Local: src.Addr() + 20000, PeerAddr: uint64(dst.Addr()) + 65536, Length: 512, Count: 4, LocalStride: 1024, PeerStride: 2048})
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.Bytes()[4096:4096+10000], src.Bytes()[100:10100]) {
				t.Fatal("contiguous write: bytes differ")
			}
			for i := 0; i < 4; i++ {
				if !bytes.Equal(dst.Bytes()[65536+i*2048:65536+i*2048+512], src.Bytes()[20000+i*1024:20000+i*1024+512]) {
					t.Fatalf("strided write block %d: bytes differ", i)
				}
			}
			// Region-addressed writes still work through the RemoteSegment.
			ctx := context.Background()
			id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: dd.ID, RemoteOffset: 0, Length: 64}}})
			if err != nil {
				t.Fatal(err)
			}
			if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
				t.Fatalf("region write: %v %v", st.State, st.Err)
			}
		})
	}
}

func TestTransferEngineAddressOutsideRegions(t *testing.T) {
	recv := newTE(t, "tcp")
	send := newTE(t, "tcp")
	dst, _ := regBuf(t, recv, "dst", 1<<16)
	src, _ := regBuf(t, send, "src", 1<<16)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	for _, c := range []struct {
		name string
		addr uint64
		n    uint64
	}{
		{"past the end", uint64(dst.Addr()) + 1<<16 - 8, 16},
		{"before the start", uint64(dst.Addr()) - 4096, 16},
		{"unmapped", 0x1000, 4096},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := writeSync(t, seg, segengine.PeerWrite{Local: src.Addr(), PeerAddr: c.addr, Length: c.n})
			if !errors.Is(err, transport.ErrOutOfBounds) {
				t.Fatalf("err = %v, want ErrOutOfBounds", err)
			}
			for _, want := range []string{recv.Name(), fmt.Sprintf("%#x", c.addr), fmt.Sprintf("+%d bytes", c.n), "not inside any region"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
		})
	}
	// Unknown region ID (after one refresh) and an out-of-bounds offset.
	_, err = seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: 999, Length: 8}}})
	if !errors.Is(err, transport.ErrUnknownRegion) || !strings.Contains(err.Error(), "region 999") {
		t.Fatalf("unknown region: err = %v", err)
	}
}

func TestTransferEngineRegionRegisteredAfterOpen(t *testing.T) {
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			recv := newTE(t, tn)
			send := newTE(t, tn)
			regBuf(t, recv, "first", 1<<16)
			src, _ := regBuf(t, send, "src", 1<<16)
			fill(src.Bytes(), 9)
			seg, err := send.OpenSegment(context.Background(), recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			late, ld := regBuf(t, recv, "late", 1<<16)
			if err := writeSync(t, seg, segengine.PeerWrite{Local: src.Addr(), PeerAddr: uint64(late.Addr()) + 128, Length: 4096}); err != nil {
				t.Fatalf("write to a region registered after the open: %v", err)
			}
			if !bytes.Equal(late.Bytes()[128:128+4096], src.Bytes()[:4096]) {
				t.Fatal("late region: bytes differ")
			}
			if d := seg.Descriptor(); len(d.Regions) != 2 {
				t.Fatalf("after refresh the descriptor has %d regions, want 2", len(d.Regions))
			}
			// A region ID learnt the same way.
			late2, ld2 := regBuf(t, recv, "late2", 1<<16)
			ctx := context.Background()
			id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: ld2.ID, Length: 64}}})
			if err != nil {
				t.Fatalf("write to region %d registered after the open: %v", ld2.ID, err)
			}
			if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
				t.Fatalf("%v %v", st.State, st.Err)
			}
			if !bytes.Equal(late2.Bytes()[:64], src.Bytes()[:64]) {
				t.Fatal("late2: bytes differ")
			}
			_ = ld
		})
	}
}

func TestTransferEngineOpenErrors(t *testing.T) {
	send := newTE(t, "tcp", func(c *segengine.TransferEngineConfig) { c.RPCTimeout = 2 * time.Second })
	ctx := context.Background()

	t.Run("not host:port", func(t *testing.T) {
		_, err := send.OpenSegment(ctx, "prefill-0")
		if !errors.Is(err, segengine.ErrBadSegmentName) || !strings.Contains(err.Error(), "host:rpc_port") {
			t.Fatalf("err = %v, want ErrBadSegmentName with the P2P naming hint", err)
		}
		if _, err := send.OpenSegment(ctx, ""); !errors.Is(err, segengine.ErrBadSegmentName) {
			t.Fatalf("empty name: err = %v, want ErrBadSegmentName", err)
		}
	})
	t.Run("refused", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		start := time.Now()
		_, err = send.OpenSegment(ctx, addr)
		if !errors.Is(err, segengine.ErrSegmentUnreachable) || !strings.Contains(err.Error(), "refused") || !strings.Contains(err.Error(), addr) {
			t.Fatalf("err = %v, want ErrSegmentUnreachable naming %s and the refusal", err, addr)
		}
		t.Logf("refused after %v: %v", time.Since(start), err)
	})
	t.Run("silent", func(t *testing.T) {
		// Accepts TCP connections and never answers (a hung peer).
		l := testenv.SilentListener(t)
		_, err := send.OpenSegment(ctx, l.Addr().String())
		if !errors.Is(err, segengine.ErrSegmentUnreachable) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no answer") {
			t.Fatalf("err = %v, want ErrSegmentUnreachable + DeadlineExceeded saying no answer", err)
		}
	})
	t.Run("transport mismatch", func(t *testing.T) {
		other := newTE(t, "shm")
		_, err := send.OpenSegment(ctx, other.Name())
		if !errors.Is(err, segengine.ErrSegmentRefused) || !errors.Is(err, segengine.ErrTransportMismatch) || !strings.Contains(err.Error(), "shm") || !strings.Contains(err.Error(), "tcp") {
			t.Fatalf("err = %v, want a refusal (ErrSegmentRefused, ErrTransportMismatch) naming shm and tcp", err)
		}
		// The same mismatch found in a descriptor handed over out of band.
		d, err := other.Describe(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := send.OpenSegmentDescriptor(ctx, d); !errors.Is(err, segengine.ErrTransportMismatch) {
			t.Fatalf("descriptor of an shm engine opened by a tcp one: err = %v, want ErrTransportMismatch", err)
		}
	})
	t.Run("closed engine", func(t *testing.T) {
		e := newTE(t, "tcp")
		e.Close()
		if _, err := e.OpenSegment(ctx, send.Name()); !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("err = %v, want ErrClosed", err)
		}
		if _, err := e.RegisterMemory(transport.Memory{Addr: 4096, Length: 4096}); !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("register on a closed engine: err = %v", err)
		}
		if err := e.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	})
}

func TestTransferEngineOverlapRefused(t *testing.T) {
	te := newTE(t, "tcp")
	b, _ := regBuf(t, te, "a", 1<<16)
	m := b.Memory()
	m.Addr += 4096
	m.Length = 4096
	if _, err := te.RegisterMemory(m); err == nil || !strings.Contains(err.Error(), "overlaps") {
		t.Fatalf("overlapping registration: err = %v", err)
	}
}

func TestTransferEngineConfiguredNameAndPort(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	te := newTE(t, "tcp", func(c *segengine.TransferEngineConfig) { c.LocalHostname = "127.0.0.1:" + strconv.Itoa(port) })
	if te.RPCPort() != port || te.Name() != "127.0.0.1:"+strconv.Itoa(port) {
		t.Fatalf("RPCPort %d Name %q, want port %d", te.RPCPort(), te.Name(), port)
	}
	tr, _ := transport.OpenTransport("tcp", transport.DefaultOptions())
	_, err = segengine.NewTransferEngine(context.Background(), segengine.TransferEngineConfig{Transport: tr, LocalHostname: "127.0.0.1:" + strconv.Itoa(port)})
	if err == nil || !strings.Contains(err.Error(), "port") {
		t.Fatalf("second engine on the same RPC port: err = %v", err)
	}
	tr, _ = transport.OpenTransport("tcp", transport.DefaultOptions())
	if _, err = segengine.NewTransferEngine(context.Background(), segengine.TransferEngineConfig{Transport: tr, LocalHostname: "127.0.0.1:99999"}); err == nil {
		t.Fatal("port 99999 accepted")
	}
}

// TestSegmentRPCBadInput sends malformed requests to a listener: it answers
// what it can, drops the rest, and keeps serving.
func TestSegmentRPCBadInput(t *testing.T) {
	te := newTE(t, "tcp")
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Term()
	s, err := zctx.NewSocket(zmq.DEALER)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.SetLinger(0)
	s.SetRcvtimeo(5 * time.Second)
	if err := s.Connect("tcp://" + te.RPCAddr()); err != nil {
		t.Fatal(err)
	}
	for _, msg := range [][]string{
		{"garbage"},
		{"KVXSEG", "9", "DESCRIBE", "1", "", ""},
		{"KVXSEG", "1", "NOPE", "2"},
		{"KVXSEG", "1", "DESCRIBE", "x", "", ""},
		{"KVXSEG", "1", "ACCEPT", "3", "", "tcp", "blob"},
		{"KVXSEG", "1", "ACCEPT", "4", "peer", "tcp", "blob"}, // tcp has no handshake
	} {
		if _, err := s.SendMessage(msg); err != nil {
			t.Fatal(err)
		}
	}
	// Answers come for the requests whose id was readable (1..4), each a
	// refusal with the reason.
	got := map[uint64]string{}
	for len(got) < 4 {
		parts, err := s.RecvMessageBytes(0)
		if err != nil {
			t.Fatalf("waiting for answers (have %v): %v", got, err)
		}
		rep, err := segengine.DecodeSegmentReply(parts)
		if err != nil {
			t.Fatal(err)
		}
		if rep.OK {
			t.Fatalf("request %d accepted", rep.ID)
		}
		got[rep.ID] = string(rep.Payload)
	}
	for id, want := range map[uint64]string{1: "version", 2: "unknown type", 3: "peer is empty", 4: "takes no handshake"} {
		if !strings.Contains(got[id], want) {
			t.Errorf("request %d refused with %q, want it to say %q", id, got[id], want)
		}
	}
	// Still serving.
	send := newTE(t, "tcp")
	regBuf(t, te, "x", 4096)
	seg, err := send.OpenSegment(context.Background(), te.Name())
	if err != nil {
		t.Fatalf("listener stopped serving after bad input: %v", err)
	}
	seg.Close()
}

// TestTransferEnginePeerRestartP2P: a peer that restarts on the same RPC
// port has a new epoch; a write that misses refreshes, sees the new epoch
// and fails with ErrSegmentStale instead of writing into the new process.
func TestTransferEnginePeerRestartP2P(t *testing.T) {
	recv := newTE(t, "tcp")
	send := newTE(t, "tcp")
	regBuf(t, recv, "dst", 1<<16)
	src, _ := regBuf(t, send, "src", 1<<16)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	name, old := recv.Name(), recv.Epoch()
	recv.Close()
	var again *segengine.TransferEngine
	deadline := time.Now().Add(20 * time.Second)
	for again == nil {
		tr, _ := transport.OpenTransport("tcp", transport.DefaultOptions())
		e, err := segengine.NewTransferEngine(context.Background(), segengine.TransferEngineConfig{Transport: tr, LocalHostname: name})
		if err == nil {
			again = e
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("restart on %s: %v", name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer again.Close()
	b, _ := regBuf(t, again, "new", 1<<16)
	err = writeSync(t, seg, segengine.PeerWrite{Local: src.Addr(), PeerAddr: uint64(b.Addr()), Length: 64})
	if !errors.Is(err, segengine.ErrSegmentStale) || !errors.Is(err, transport.ErrPeerLost) || !strings.Contains(err.Error(), fmt.Sprintf("%#x", old)) {
		t.Fatalf("write after the peer restarted: err = %v, want ErrSegmentStale naming the old epoch %#x", err, old)
	}
	if seg.Err() == nil {
		t.Fatal("segment not marked stale")
	}
	// Reopening by the same name reaches the new incarnation.
	seg2, err := send.OpenSegment(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	defer seg2.Close()
	if seg2.Epoch() != again.Epoch() {
		t.Fatalf("reopened epoch %#x, want %#x", seg2.Epoch(), again.Epoch())
	}
	if err := writeSync(t, seg2, segengine.PeerWrite{Local: src.Addr(), PeerAddr: uint64(b.Addr()), Length: 64}); err != nil {
		t.Fatal(err)
	}
}

// TestMain lets the test binary act as a segment receiver in its own
// process (KVX_TEST_HELPER=segment) so that tests can kill a real peer.
func TestMain(m *testing.M) {
	if h := os.Getenv("KVX_TEST_HELPER"); h != "" {
		if h != "segment" {
			fmt.Fprintln(os.Stderr, "helper: unknown KVX_TEST_HELPER", h)
			os.Exit(2)
		}
		if err := helperSegment(); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperSegment runs a receiver TransferEngine in its own process: it prints
// "READY name addr len", then on each stdin line "sum" prints the CRC32 of
// its buffer.
func helperSegment() error {
	tr, err := transport.OpenTransport(os.Getenv("KVX_TRANSPORT"), transport.DefaultOptions())
	if err != nil {
		return err
	}
	te, err := segengine.NewTransferEngine(context.Background(), segengine.TransferEngineConfig{Transport: tr})
	if err != nil {
		return err
	}
	defer te.Close()
	b, err := transport.AllocHost("helper", 1<<20)
	if err != nil {
		return err
	}
	if _, err := te.RegisterMemory(b.Memory()); err != nil {
		return err
	}
	fmt.Printf("READY %s %d %d\n", te.Name(), b.Addr(), b.Len())
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "sum" {
			fmt.Printf("SUM %d\n", crc32.ChecksumIEEE(b.Bytes()))
		}
	}
	return nil
}

// TestTransferEngineCrossProcess opens a segment in another process by
// name, writes by its virtual address, checks the bytes there, kills it
// and checks the next write fails with ErrPeerLost.
func TestTransferEngineCrossProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "KVX_TEST_HELPER=segment", "KVX_TRANSPORT="+tn)
			stdin, _ := cmd.StdinPipe()
			out, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { cmd.Process.Kill(); cmd.Wait() }()
			sc := bufio.NewScanner(out)
			if !sc.Scan() {
				t.Fatal("helper printed nothing")
			}
			var name string
			var addr uint64
			var n int
			if _, err := fmt.Sscanf(sc.Text(), "READY %s %d %d", &name, &addr, &n); err != nil {
				t.Fatalf("helper line %q: %v", sc.Text(), err)
			}
			send := newTE(t, tn)
			src, _ := regBuf(t, send, "src", int64(n))
			fill(src.Bytes(), 42)
			seg, err := send.OpenSegment(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if err := writeSync(t, seg, segengine.PeerWrite{Local: src.Addr(), PeerAddr: addr, Length: uint64(n)}); err != nil {
				t.Fatal(err)
			}
			fmt.Fprintln(stdin, "sum")
			if !sc.Scan() {
				t.Fatal("helper died before answering")
			}
			if want := fmt.Sprintf("SUM %d", crc32.ChecksumIEEE(src.Bytes())); sc.Text() != want {
				t.Fatalf("helper says %q, want %q", sc.Text(), want)
			}
			cmd.Process.Kill()
			cmd.Wait()
			deadline := time.Now().Add(20 * time.Second)
			for {
				err := writeSync(t, seg, segengine.PeerWrite{Local: src.Addr(), PeerAddr: addr, Length: 4096})
				if errors.Is(err, transport.ErrPeerLost) {
					t.Logf("after the kill: %v", err)
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("writes to a killed peer: last err = %v, want ErrPeerLost", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}

// TestTransferEngineRead: tcp and shm read peer memory by virtual address:
// Read (sync), SubmitPeerReads + Wait (async, scattered pages and a strided
// read), refusals naming the peer with nothing read, memory the peer
// registers after the open (found by one refresh), and a peer that closes
// (the read fails with ErrPeerLost).
func TestTransferEngineRead(t *testing.T) {
	for _, name := range []string{"tcp", "shm"} {
		t.Run(name, func(t *testing.T) {
			recv := newTE(t, name)
			send := newTE(t, name)
			peer, _ := regBuf(t, recv, "peer", 1<<20)
			fill(peer.Bytes(), 77)
			local, _ := regBuf(t, send, "local", 1<<20)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			seg, err := send.OpenSegment(ctx, recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			pa := uint64(peer.Addr())
			if err := seg.Read(ctx, []segengine.PeerRead{{Local: local.Addr() + 8, PeerAddr: pa + 1000, Length: 3 << 18}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(local.Bytes()[8:8+3<<18], peer.Bytes()[1000:1000+3<<18]) {
				t.Fatal("read: bytes differ")
			}
			// Async: 64 scattered pages and a strided read in one batch.
			clear(local.Bytes())
			var rs []segengine.PeerRead
			for i := 0; i < 64; i++ {
				rs = append(rs, segengine.PeerRead{Local: local.Addr() + uintptr(i*4096), PeerAddr: pa + uint64((63-i)*8192), Length: 4096})
			}
			rs = append(rs, segengine.PeerRead{Local: local.Addr() + 512<<10, PeerAddr: pa + 3, Length: 100, Count: 20, LocalStride: 128, PeerStride: 1000})
			id, err := seg.SubmitPeerReads(ctx, rs)
			if err != nil {
				t.Fatal(err)
			}
			st, err := seg.Wait(ctx, id)
			if err != nil || st.State != transport.BatchCompleted || st.BytesDone != 64*4096+2000 {
				t.Fatalf("async read: %+v, %v", st, err)
			}
			seg.Release(id)
			for i := 0; i < 64; i++ {
				if !bytes.Equal(local.Bytes()[i*4096:][:4096], peer.Bytes()[(63-i)*8192:][:4096]) {
					t.Fatalf("async read: page %d differs", i)
				}
			}
			for k := 0; k < 20; k++ {
				if !bytes.Equal(local.Bytes()[512<<10+k*128:][:100], peer.Bytes()[3+k*1000:][:100]) {
					t.Fatalf("strided read: block %d differs", k)
				}
			}
			// Refusals: nothing is read.
			before := bytes.Clone(local.Bytes())
			err = seg.Read(ctx, []segengine.PeerRead{{Local: local.Addr(), PeerAddr: pa + 1<<20 - 4, Length: 8}})
			if !errors.Is(err, transport.ErrOutOfBounds) || !strings.Contains(err.Error(), recv.Name()) {
				t.Fatalf("read past the peer region: %v", err)
			}
			err = seg.Read(ctx, []segengine.PeerRead{{Local: 0x1000, PeerAddr: pa, Length: 8}})
			if !errors.Is(err, transport.ErrOutOfBounds) {
				t.Fatalf("read into unregistered local memory: %v", err)
			}
			if !bytes.Equal(local.Bytes(), before) {
				t.Fatal("a refused read changed local memory")
			}
			// Memory the peer registers after the open.
			late, _ := regBuf(t, recv, "late", 64<<10)
			fill(late.Bytes(), 5)
			if err := seg.Read(ctx, []segengine.PeerRead{{Local: local.Addr(), PeerAddr: uint64(late.Addr()) + 100, Length: 5000}}); err != nil {
				t.Fatalf("read of memory registered after the open: %v", err)
			}
			if !bytes.Equal(local.Bytes()[:5000], late.Bytes()[100:5100]) {
				t.Fatal("late read: bytes differ")
			}
			// The peer goes away: the read fails as a lost peer.
			if err := recv.Close(); err != nil {
				t.Fatal(err)
			}
			err = seg.Read(ctx, []segengine.PeerRead{{Local: local.Addr(), PeerAddr: pa, Length: 1 << 20}})
			if !errors.Is(err, transport.ErrPeerLost) {
				t.Fatalf("read after the peer closed: %v, want ErrPeerLost", err)
			}
		})
	}
}

// TestTransferEngineWildcardAdvertise: the segment RPC listener follows the
// KV manager's advertise rule: a wildcard bind names the address
// hostaddr picks (not loopback while another address exists), and an
// explicit AdvertiseHost wins.
func TestTransferEngineWildcardAdvertise(t *testing.T) {
	choice := hostaddr.Pick("0.0.0.0")
	if choice.Loopback {
		t.Skip("this host has no non-loopback IPv4 address")
	}
	te := newTE(t, "tcp", func(c *segengine.TransferEngineConfig) { c.LocalHostname = "0.0.0.0" })
	if host, _, err := net.SplitHostPort(te.RPCAddr()); err != nil || host != choice.Host {
		t.Fatalf("RPC address %s (%v), want host %s (%s)", te.RPCAddr(), err, choice.Host, choice.How)
	}
	if !strings.HasPrefix(te.Name(), choice.Host+":") {
		t.Fatalf("segment name %s, want host %s", te.Name(), choice.Host)
	}
	te2 := newTE(t, "tcp", func(c *segengine.TransferEngineConfig) {
		c.LocalHostname = "0.0.0.0"
		c.AdvertiseHost = "127.0.0.1"
	})
	if !strings.HasPrefix(te2.RPCAddr(), "127.0.0.1:") {
		t.Fatalf("RPC address with advertise host 127.0.0.1: %s", te2.RPCAddr())
	}
}
