package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/engine/transporttest"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// requireRDMA skips without a usable RDMA device (fails instead when
// $KVXFER_REQUIRE_RDMA is set, as inside `make test-rdma`).
func requireRDMA(t testing.TB) {
	t.Helper()
	testenv.Require(t, "KVXFER_REQUIRE_RDMA", Probe(), transport.ErrUnavailable, "run `make test-rdma` for the Soft-RoCE VM")
}

func newT(t testing.TB, streams int, extra transport.RDMAOptions) *Transport {
	t.Helper()
	o := transport.DefaultOptions()
	o.Streams = streams
	o.RDMA = extra
	tr, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

func TestProbeWrapsUnavailable(t *testing.T) {
	err := Probe()
	if err != nil && !errors.Is(err, transport.ErrUnavailable) {
		t.Fatalf("Probe = %v; want nil or an error wrapping transport.ErrUnavailable", err)
	}
	t.Logf("Probe: %v", err)
	if err != nil {
		if _, err := New(transport.DefaultOptions()); !errors.Is(err, transport.ErrUnavailable) {
			t.Fatalf("New without device = %v", err)
		}
	}
}

func TestParseConfig(t *testing.T) {
	for _, tc := range []struct {
		extra transport.RDMAOptions
		ok    bool
	}{
		{transport.RDMAOptions{SliceSize: 65536, QPTimeout: u8(18)}, true},
		{transport.RDMAOptions{QPTimeout: u8(0), RetryCount: u8(0)}, true},
		{transport.RDMAOptions{QPTimeout: u8(32)}, false},
		{transport.RDMAOptions{SliceSize: 12}, false},
		{transport.RDMAOptions{RetryCount: u8(8)}, false},
		{transport.RDMAOptions{MaxMRSize: 100}, false},
		{transport.RDMAOptions{SQDepth: -1}, false},
		{transport.RDMAOptions{SQDepth: 2}, false},
		{transport.RDMAOptions{StallTimeout: 2 * time.Second}, true},
		{transport.RDMAOptions{StallTimeout: time.Millisecond}, false},
		{transport.RDMAOptions{CQPoll: true}, true},
	} {
		c, err := parseConfig(transport.Options{RDMA: tc.extra})
		if (err == nil) != tc.ok {
			t.Errorf("parseConfig(%+v) = %v", tc.extra, err)
		}
		if err == nil && c.cqEvents == tc.extra.CQPoll {
			t.Errorf("parseConfig(%+v): cqEvents %v", tc.extra, c.cqEvents)
		}
	}
	c, err := parseConfig(transport.Options{RDMA: transport.RDMAOptions{QPTimeout: u8(0), RetryCount: u8(0)}})
	if err != nil || c.timeout != 0 || c.retry != 0 {
		t.Errorf("QPTimeout 0, RetryCount 0: timeout %d retry %d err %v; want 0, 0", c.timeout, c.retry, err)
	}
	if c, _ = parseConfig(transport.Options{}); c.timeout != defaultTimeout || c.retry != defaultRetry || c.sliceSize != defaultSliceSize || c.sqDepth != defaultSQDepth || !c.cqEvents {
		t.Errorf("zero RDMAOptions: %+v; want the defaults", c)
	}
}

func u8(v uint8) *uint8 { return &v }

// envOptions parses the experiments' KVXFER_RDMA_BW_EXTRA value, k=v,k=v
// with the keys slice_size, sq_depth, qp_timeout, retry_cnt, max_mr_size,
// stall_timeout and cq_wait (event|poll).
func envOptions(t testing.TB, v string) transport.RDMAOptions {
	var o transport.RDMAOptions
	for kv := range strings.SplitSeq(v, ",") {
		if kv == "" {
			continue
		}
		k, val, _ := strings.Cut(kv, "=")
		n, nerr := strconv.ParseUint(val, 0, 64)
		var err error
		switch k {
		case "slice_size":
			o.SliceSize, err = n, nerr
		case "sq_depth":
			o.SQDepth, err = int(n), nerr
		case "qp_timeout":
			o.QPTimeout, err = u8(uint8(n)), nerr
		case "retry_cnt":
			o.RetryCount, err = u8(uint8(n)), nerr
		case "max_mr_size":
			o.MaxMRSize, err = n, nerr
		case "stall_timeout":
			o.StallTimeout, err = time.ParseDuration(val)
		case "cq_wait":
			o.CQPoll = val == "poll"
		default:
			err = fmt.Errorf("unknown key")
		}
		if err != nil {
			t.Fatalf("KVXFER_RDMA_BW_EXTRA %q: %v", kv, err)
		}
	}
	return o
}

// A GID index is forced only when set; the zero-value Options chooses.
func TestParseConfigGIDIndex(t *testing.T) {
	c, err := parseConfig(transport.Options{})
	if err != nil || c.gidIndex != -1 {
		t.Fatalf("zero Options: gidIndex %d, err %v; want -1 (auto)", c.gidIndex, err)
	}
	three := 3
	if c, err = parseConfig(transport.Options{GIDIndex: &three}); err != nil || c.gidIndex != 3 {
		t.Fatalf("GIDIndex 3: gidIndex %d, err %v", c.gidIndex, err)
	}
	bad := 300
	if _, err = parseConfig(transport.Options{GIDIndex: &bad}); err == nil {
		t.Fatal("GIDIndex 300 accepted")
	}
}

func TestConformance(t *testing.T) {
	requireRDMA(t)
	// Short ACK timeout so a vanished receiver surfaces as ErrPeerLost in
	// about a second; small max_mr_size so every region is split into MRs.
	extra := transport.RDMAOptions{QPTimeout: u8(14), RetryCount: u8(7), MaxMRSize: 8 << 20, SliceSize: 256 << 10, StallTimeout: 5 * time.Second}
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newT(t, 2, extra), newT(t, 2, extra)
	}, transporttest.WithLargeBytes(32<<20), transporttest.WithPeerLostWithin(30*time.Second), transporttest.WithCaseTimeout(caseTimeout()))
}

func caseTimeout() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("KVXFER_CASE_TIMEOUT")); err == nil {
		return d
	}
	return 3 * time.Minute
}

// pairUp registers src on s and dst on r, hands shakes and opens a segment.
func pairUp(t *testing.T, s, r *Transport, src, dst *transport.HostBuffer) (transport.Segment, transport.RegionDesc, transport.RegionDesc) {
	t.Helper()
	ctx := context.Background()
	sd, err := s.RegisterMemory(src.Memory())
	if err != nil {
		t.Fatal(err)
	}
	dd, err := r.RegisterMemory(dst.Memory())
	if err != nil {
		t.Fatal(err)
	}
	ep, err := r.Endpoint(ctx, "prefill-0")
	if err != nil {
		t.Fatal(err)
	}
	seg, err := s.OpenSegment(ctx, transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{dd}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Close() })
	if err := r.Accept(ctx, "prefill-0", seg.HandshakeReply()); err != nil {
		t.Fatal(err)
	}
	return seg, sd, dd
}

func alloc(t testing.TB, n int) *transport.HostBuffer {
	t.Helper()
	b, err := transport.AllocHost("rdma-test", int64(n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func TestMRSplitAndStriping(t *testing.T) {
	requireRDMA(t)
	extra := transport.RDMAOptions{MaxMRSize: 65536, SliceSize: 16384}
	s, r := newT(t, 3, extra), newT(t, 3, extra)
	const size = 1 << 20
	src, dst := alloc(t, size), alloc(t, size)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*13 + i>>16)
	}
	seg, _, dd := pairUp(t, s, r, src, dst)
	k, err := decodeRegionKey(dd.Key)
	if err != nil || len(k.Devs[0].Chunks) != size/65536 {
		t.Fatalf("region key: %d MRs, %v; want %d", len(k.Devs[0].Chunks), err, size/65536)
	}
	// Unaligned offsets: every write crosses MR boundaries on both sides.
	b := &transport.TransferBatch{Requests: []transport.WriteRequest{
		{Local: src.Addr() + 1000, Remote: dd.ID, RemoteOffset: 7000, Length: 500_000},
		{Local: src.Addr() + 600_000, Remote: dd.ID, RemoteOffset: 600_001, Length: 300_000},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id, err := seg.Submit(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil || st.State != transport.BatchCompleted || st.BytesDone != b.Bytes() {
		t.Fatalf("batch: %+v, %v", st, err)
	}
	d, sb := dst.Bytes(), src.Bytes()
	if !bytes.Equal(d[7000:507_000], sb[1000:501_000]) || !bytes.Equal(d[600_001:900_001], sb[600_000:900_000]) {
		t.Fatal("striped, split writes landed wrong")
	}
	if d[6999] != 0 || d[507_000] != 0 || d[600_000] != 0 || d[900_001] != 0 {
		t.Fatal("bytes outside the writes changed")
	}
}

// TestDeviceMemoryWithoutDmaBuf registers "device memory" on a real device
// with the dma-buf export failing: the plain-MR fallback runs for real
// (ibv_reg_mr on an unmapped address fails without nvidia-peermem) and the
// error must carry both causes and the fix.
func TestDeviceMemoryWithoutDmaBuf(t *testing.T) {
	requireRDMA(t)
	exportErr := errors.New("no CUDA driver")
	old := dmaBufRange
	dmaBufRange = func(ptr uintptr, size uint64) (int, uint64, error) { return -1, 0, exportErr }
	defer func() { dmaBufRange = old }()
	tr := newT(t, 1, transport.RDMAOptions{})
	_, err := tr.RegisterMemory(transport.Memory{Addr: 0x7f0000000000, Length: 1 << 20, Kind: transport.MemoryCUDA, FD: -1})
	if !errors.Is(err, transport.ErrUnsupportedMemory) || !errors.Is(err, exportErr) {
		t.Fatalf("RegisterMemory(cuda) = %v; want ErrUnsupportedMemory wrapping the export error", err)
	}
	for _, want := range []string{"dma-buf MR failed", "plain MR (peer memory) failed", "ibv_reg_mr", "nvidia-peermem", tr.Devices()[0]} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	t.Log(err)
}

// TestBandwidth reports the transport's RDMA WRITE bandwidth for the
// side-by-side with ib_write_bw inside the VM: one QP, batches of 16 MiB of
// KVXFER_RDMA_BW_BLOCK-byte writes (default 1 MiB; 4096 for the small-write
// comparison) to a random permutation of the block slots of a 16 MiB
// region, one batch at a time. With KVXFER_RDMA_BW_OP=read the batches are
// RDMA READs of those slots into local memory (the side-by-side with
// ib_read_bw). It asserts nothing about speed; enable with
// KVXFER_RDMA_BW=<MiB>.
func TestBandwidth(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("KVXFER_RDMA_BW"))
	if mib <= 0 {
		t.Skip("set KVXFER_RDMA_BW=<MiB to move> to measure")
	}
	block := 1 << 20
	if v := os.Getenv("KVXFER_RDMA_BW_BLOCK"); v != "" {
		var err error
		if block, err = strconv.Atoi(v); err != nil || block < 1 || block > 16<<20 || (16<<20)%block != 0 {
			t.Fatalf("KVXFER_RDMA_BW_BLOCK=%q: want a divisor of 16 MiB in bytes", v)
		}
	}
	requireRDMA(t)
	// KVXFER_RDMA_BW_EXTRA: transport options as k=v,k=v (experiments).
	extra := envOptions(t, os.Getenv("KVXFER_RDMA_BW_EXTRA"))
	s, r := newT(t, 1, extra), newT(t, 1, extra)
	const size = 16 << 20
	src, dst := alloc(t, size), alloc(t, size)
	seg, _, dd := pairUp(t, s, r, src, dst)
	ctx := context.Background()
	b := &transport.TransferBatch{}
	verb := "writes"
	switch op := os.Getenv("KVXFER_RDMA_BW_OP"); op {
	case "", "write":
	case "read":
		b.Op, verb = transport.OpRead, "reads"
	default:
		t.Fatalf("KVXFER_RDMA_BW_OP=%q: want write or read", op)
	}
	for i, slot := range rand.New(rand.NewPCG(1, 2)).Perm(size / block) {
		b.Requests = append(b.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i*block), Remote: dd.ID, RemoteOffset: uint64(slot * block), Length: uint64(block)})
	}
	start, cpu0 := time.Now(), cpuTime()
	for moved := 0; moved < mib; moved += 16 {
		id, err := seg.Submit(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
			t.Fatalf("%+v %v", st, err)
		}
		seg.Release(id)
	}
	el := time.Since(start)
	gbps := float64(mib) * (1 << 20) * 8 / el.Seconds() / 1e9
	ps := seg.(*segment).stats()
	fmt.Printf("KVXFER_BW_GBPS=%.4f (%d MiB in %v, %d-byte %s, %d WRs in %d chains, process CPU %v)\n", gbps, mib, el, block, verb, ps.wrs, ps.chains, cpuTime()-cpu0)
}

// TestSmallBatchLatency reports the latency of KVXFER_RDMA_LAT sequential
// batches of one 4 KiB write (Submit to Wait returning: the shape of a
// metadata record after a room's KV) and the process CPU time per batch,
// for comparing cq_wait=event with cq_wait=poll (KVXFER_RDMA_BW_EXTRA). It
// asserts nothing about speed.
func TestSmallBatchLatency(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("KVXFER_RDMA_LAT"))
	if n <= 0 {
		t.Skip("set KVXFER_RDMA_LAT=<batches> to measure")
	}
	requireRDMA(t)
	extra := envOptions(t, os.Getenv("KVXFER_RDMA_BW_EXTRA"))
	s, r := newT(t, 1, extra), newT(t, 1, extra)
	src, dst := alloc(t, 1<<20), alloc(t, 1<<20)
	seg, _, dd := pairUp(t, s, r, src, dst)
	ctx := context.Background()
	lat := make([]time.Duration, 0, n)
	cpu0 := cpuTime()
	for i := 0; i < n; i++ {
		b := &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: dd.ID, RemoteOffset: uint64(i%256) * 4096, Length: 4096}}}
		start := time.Now()
		id, err := seg.Submit(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
			t.Fatalf("%+v %v", st, err)
		}
		lat = append(lat, time.Since(start))
		seg.Release(id)
	}
	cpu := cpuTime() - cpu0
	slices.Sort(lat)
	fmt.Printf("KVXFER_LAT p50=%v p99=%v cpu/batch=%v (%d batches, options %+v)\n", lat[n/2], lat[n*99/100], cpu/time.Duration(n), n, extra)
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestChainLen(t *testing.T) {
	for _, tc := range []struct{ depth, want int }{{256, 64}, {4, 1}, {1, 1}, {16384, 4096}, {1 << 20, 1 << chainIDShift}} {
		if got := chainLen(tc.depth); got != tc.want {
			t.Errorf("chainLen(%d) = %d, want %d", tc.depth, got, tc.want)
		}
	}
}

// TestChainedSmallWrites sends 4096 scattered 4 KiB pages in one batch
// over two QPs with a 16-deep send queue: the pump must post them as
// chains of 4 WRs (one completion each), recycle credits hundreds of times,
// and land every byte.
func TestChainedSmallWrites(t *testing.T) {
	requireRDMA(t)
	extra := transport.RDMAOptions{SQDepth: 16}
	s, r := newT(t, 2, extra), newT(t, 2, extra)
	const size, page = 16 << 20, 4096
	src, dst := alloc(t, size), alloc(t, size)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*7 + i>>12)
	}
	seg, _, dd := pairUp(t, s, r, src, dst)
	b := &transport.TransferBatch{}
	for i, slot := range rand.New(rand.NewPCG(3, 4)).Perm(size / page) {
		b.Requests = append(b.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i*page), Remote: dd.ID, RemoteOffset: uint64(slot * page), Length: page})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	id, err := seg.Submit(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil || st.State != transport.BatchCompleted || st.BytesDone != size {
		t.Fatalf("batch: %+v, %v", st, err)
	}
	for i, slot := range rand.New(rand.NewPCG(3, 4)).Perm(size / page) {
		if !bytes.Equal(dst.Bytes()[slot*page:][:page], src.Bytes()[i*page:][:page]) {
			t.Fatalf("page %d (slot %d) landed wrong", i, slot)
		}
	}
	ps := seg.(*segment).stats()
	if ps.wrs != size/page || ps.chains > ps.wrs/4+2 {
		t.Fatalf("posted %d WRs in %d chains; want %d WRs in chains of 4 (sq_depth 16)", ps.wrs, ps.chains, size/page)
	}
	t.Logf("%d WRs in %d chains", ps.wrs, ps.chains)
}

// TestChainFailsMidChain deregisters the receiver's region and sends a
// batch of 64 pages: the first WR of the chain (unsignaled) fails with a
// remote access error and the rest is flushed. The batch must fail naming
// the refusal well before the stall timeout, and the segment must refuse
// new work as unusable.
func TestChainFailsMidChain(t *testing.T) {
	requireRDMA(t)
	extra := transport.RDMAOptions{StallTimeout: 60 * time.Second, QPTimeout: u8(14), RetryCount: u8(7)}
	s, r := newT(t, 1, extra), newT(t, 1, extra)
	src, dst := alloc(t, 1<<20), alloc(t, 1<<20)
	seg, _, dd := pairUp(t, s, r, src, dst)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := r.DeregisterMemory(dd.ID); err != nil {
		t.Fatal(err)
	}
	b := &transport.TransferBatch{}
	for i := 0; i < 64; i++ {
		b.Requests = append(b.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i*4096), Remote: dd.ID, RemoteOffset: uint64(i * 4096), Length: 4096})
	}
	start := time.Now()
	id, err := seg.Submit(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil || st.State != transport.BatchFailed || !(errors.Is(st.Err, transport.ErrUnknownRegion) || errors.Is(st.Err, transport.ErrOutOfBounds)) {
		t.Fatalf("batch to a deregistered region: %+v, %v; want failed with ErrUnknownRegion/ErrOutOfBounds", st, err)
	}
	if el := time.Since(start); el > 30*time.Second {
		t.Fatalf("the refused chain took %v to fail (stall timeout 60s): the tail's flush completion was not used", el)
	}
	if st.BytesDone != 0 {
		t.Errorf("BytesDone = %d after a refused chain, want 0", st.BytesDone)
	}
	if _, err := seg.Submit(ctx, b); err == nil || !strings.Contains(err.Error(), "unusable") {
		t.Fatalf("Submit after a failed chain = %v, want the segment reported unusable", err)
	}
	t.Log(st.Err)
}

// TestRdDepth: a device's RDMA READ limits are clamped to 1..maxRdAtomic
// (a device reporting 0 still serves one READ at a time).
func TestRdDepth(t *testing.T) {
	for _, tc := range []struct {
		dev  int
		want uint8
	}{{0, 1}, {1, 1}, {8, 8}, {16, 16}, {128, maxRdAtomic}, {-3, 1}} {
		if got := rdDepth(tc.dev); got != tc.want {
			t.Errorf("rdDepth(%d) = %d, want %d", tc.dev, got, tc.want)
		}
	}
}
