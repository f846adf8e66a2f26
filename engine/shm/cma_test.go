package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/engine/transporttest"
)

// childCMAEnv makes the receiver child (TestMain) a cma transport whose
// region is anonymous memory.
const childCMAEnv = "KVXFER_SHM_TEST_CMA"

// anonMemory maps n bytes of anonymous private memory: memory the caller
// owns, with no file behind it (what shm cannot share and cma can).
func anonMemory(n int) (transport.Memory, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return transport.Memory{}, fmt.Errorf("mmap %d anonymous bytes: %w", n, err)
	}
	return transport.Memory{Addr: bytesAddr(b), Length: uint64(n), Kind: transport.MemoryHost, FD: -1}, nil
}

func bytesAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

func skipWithoutCMA(t *testing.T) {
	t.Helper()
	if err := ProbeCMA(); err != nil {
		t.Skipf("cma unavailable here: %v", err)
	}
}

// TestCMAConformance runs the conformance suite (WRITE and READ, fencing,
// a receiver process killed mid-batch) against cma.
func TestCMAConformance(t *testing.T) {
	skipWithoutCMA(t)
	newPair := func(t *testing.T) (transport.Transport, transport.Transport) {
		snd, err := NewCMA(transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		rcv, err := NewCMA(transport.DefaultOptions())
		if err != nil {
			snd.Close()
			t.Fatal(err)
		}
		return snd, rcv
	}
	transporttest.Run(t, newPair,
		transporttest.WithLargeBytes(256<<20),
		transporttest.WithRemotePeer(func(t *testing.T, n int) (transport.SegmentInfo, func()) {
			return remoteReceiverEnv(t, n, childCMAEnv+"=1")
		}))
}

// TestCMACallerMemory: a receiver process registers anonymous memory (no
// memfd): shm refuses it, cma accepts it, and a sender writes and reads it
// back across the two processes.
func TestCMACallerMemory(t *testing.T) {
	skipWithoutCMA(t)
	shmT, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer shmT.Close()
	anon, err := anonMemory(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := shmT.RegisterMemory(anon); !errors.Is(err, transport.ErrUnsupportedMemory) {
		t.Fatalf("shm registered anonymous memory: err %v, want ErrUnsupportedMemory", err)
	}
	info, kill := remoteReceiverEnv(t, 1<<20, childCMAEnv+"=1")
	defer kill()
	snd, err := NewCMA(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	if _, err := snd.RegisterMemory(anon); err != nil {
		t.Fatalf("cma refused anonymous memory: %v", err)
	}
	seg, err := snd.OpenSegment(context.Background(), info)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	local := anon.Bytes()
	for i := range local {
		local[i] = byte(i*7 + 3)
	}
	want := bytes.Clone(local[:256<<10])
	run := func(op transport.Op) {
		t.Helper()
		b := &transport.TransferBatch{Op: op, Requests: []transport.WriteRequest{{Local: anon.Addr, Remote: info.Regions[0].ID, RemoteOffset: 4096, Length: 256 << 10}}}
		id, err := seg.Submit(context.Background(), b)
		if err != nil {
			t.Fatalf("%s: %v", op, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		st, err := seg.Wait(ctx, id)
		if err != nil || st.State != transport.BatchCompleted {
			t.Fatalf("%s: %+v %v", op, st, err)
		}
	}
	// Errors of the shared shm code name the transport the caller chose.
	bad := &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: anon.Addr, Remote: 999, Length: 8}}}
	if _, err := seg.Submit(context.Background(), bad); !errors.Is(err, transport.ErrUnknownRegion) || !strings.HasPrefix(err.Error(), "cma: ") {
		t.Fatalf("write to an unknown region: %v; want ErrUnknownRegion, prefixed cma:", err)
	}
	run(transport.OpWrite)
	clear(local[:256<<10])
	run(transport.OpRead)
	if !bytes.Equal(local[:256<<10], want) {
		t.Fatal("bytes read back from the receiver process differ from the bytes written")
	}
}

// TestCMARegisterUnmapped: a range that is not mapped is refused at
// registration, not at the first transfer.
func TestCMARegisterUnmapped(t *testing.T) {
	skipWithoutCMA(t)
	tr, err := NewCMA(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	m, err := anonMemory(3 * os.Getpagesize())
	if err != nil {
		t.Fatal(err)
	}
	pg := uintptr(os.Getpagesize())
	if _, _, e := unix.Syscall(unix.SYS_MUNMAP, m.Addr+pg, pg, 0); e != 0 { // punch a hole
		t.Fatal(e)
	}
	tests := []struct {
		name string
		mem  transport.Memory
		ok   bool
	}{
		{"mapped first page", transport.Memory{Addr: m.Addr, Length: uint64(pg), FD: -1}, true},
		{"hole in the middle", transport.Memory{Addr: m.Addr, Length: m.Length, FD: -1}, false},
		{"only the hole", transport.Memory{Addr: m.Addr + pg + 8, Length: 16, FD: -1}, false},
		{"device memory", transport.Memory{Addr: m.Addr, Length: 16, Kind: transport.MemoryCUDA, FD: -1}, false},
		{"zero length", transport.Memory{Addr: m.Addr, FD: -1}, false},
	}
	for _, tc := range tests {
		_, err := tr.RegisterMemory(tc.mem)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// TestCMAKernelRefuses: when the kernel refuses cross-memory attach
// (EPERM), OpenSegment fails with ErrUnavailable (the KV manager then uses
// tcp) and the transport says so in one log line, however many opens fail.
func TestCMAKernelRefuses(t *testing.T) {
	skipWithoutCMA(t)
	var logMu sync.Mutex
	var logBuf bytes.Buffer
	opts := transport.DefaultOptions()
	opts.Logger = slog.New(slog.NewTextHandler(lockedWriter{&logMu, &logBuf}, nil))
	snd, err := NewCMA(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	rcv, err := NewCMA(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer rcv.Close()
	ep, err := rcv.Endpoint(context.Background(), "snd")
	if err != nil {
		t.Fatal(err)
	}
	old := processVMReadv
	processVMReadv = func(int, []unix.Iovec, []unix.RemoteIovec, uint) (int, error) { return 0, unix.EPERM }
	defer func() { processVMReadv = old }()
	for i := 0; i < 3; i++ {
		_, err := snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep})
		if !errors.Is(err, transport.ErrUnavailable) || !strings.Contains(err.Error(), "refuses cross-memory attach") {
			t.Fatalf("open %d with EPERM: %v; want ErrUnavailable naming the refusal", i, err)
		}
	}
	logMu.Lock()
	defer logMu.Unlock()
	if n := strings.Count(logBuf.String(), "refuses cross-memory attach"); n != 1 {
		t.Fatalf("the refusal was logged %d times, want once:\n%s", n, logBuf.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// TestCMAEndpointNotShm: a shm sender given a cma endpoint (or the other
// way round) refuses it by name instead of misreading it.
func TestCMAEndpointNotShm(t *testing.T) {
	skipWithoutCMA(t)
	c, err := NewCMA(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	cep, _ := c.Endpoint(context.Background(), "x")
	sep, _ := s.Endpoint(context.Background(), "x")
	if _, err := s.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: cep}); err == nil {
		t.Fatal("shm opened a cma endpoint")
	}
	if _, err := c.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: sep}); err == nil {
		t.Fatal("cma opened an shm endpoint")
	}
}

func FuzzDecodeCMAEndpoint(f *testing.F) {
	f.Add(endpoint{PID: 42, StartTime: 7, CtlFD: 3, CtlAddr: 1 << 20}.encode(true))
	f.Add([]byte("KVXC"))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEndpoint(b, true)
		if err != nil {
			return
		}
		if !bytes.Equal(e.encode(true), b) {
			t.Fatalf("round trip changed %x", b)
		}
	})
}

func FuzzDecodeCMAKey(f *testing.F) {
	f.Add(encodeCMAKey(1 << 30))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := decodeCMAKey(b)
		if err != nil {
			return
		}
		if !bytes.Equal(encodeCMAKey(a), b) {
			t.Fatalf("round trip changed %x", b)
		}
	})
}

// TestCMAPtraceScope: the probe refuses the Yama levels at which no
// process may attach (3, or 2 without root) and accepts the others; at
// level 1 the transport declares PR_SET_PTRACER_ANY once per process and
// logs a refused prctl (on a kernel without Yama it is refused: EINVAL).
func TestCMAPtraceScope(t *testing.T) {
	old := yamaPath
	defer func() { yamaPath = old; grantOnce = new(sync.Once) }()
	dir := t.TempDir()
	root := os.Geteuid() == 0
	tests := []struct {
		scope string
		ok    bool
	}{
		{"0", true}, {"1", true}, {"2", root}, {"3", false}, {"", true} /* no Yama */, {"junk", true},
	}
	for _, tc := range tests {
		yamaPath = dir + "/absent"
		if tc.scope != "" {
			yamaPath = dir + "/scope-" + tc.scope
			if err := os.WriteFile(yamaPath, []byte(tc.scope+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		err := ProbeCMA()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, transport.ErrUnavailable)) {
			t.Errorf("ptrace_scope %q: probe %v, want ok=%v (refusals wrap ErrUnavailable)", tc.scope, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "ptrace_scope") {
			t.Errorf("ptrace_scope %q: the refusal does not name the setting: %v", tc.scope, err)
		}
	}

	yamaPath = dir + "/scope-1"
	grantOnce = new(sync.Once)
	var mu sync.Mutex
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	grantPtrace(log)
	grantPtrace(log) // once per process
	mu.Lock()
	out := buf.String()
	mu.Unlock()
	if n := strings.Count(out, "PR_SET_PTRACER"); n != 1 {
		t.Fatalf("grantPtrace logged %d lines naming PR_SET_PTRACER, want 1 (granted or refused):\n%s", n, out)
	}
	if ptraceScope() != 1 {
		t.Fatalf("ptraceScope = %d from %s", ptraceScope(), yamaPath)
	}
}
