package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/shm"
	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/rdma"
)

// Config is the benchmark matrix and its knobs.
type Config struct {
	// Transports to measure (engine registry names).
	Transports []string `json:"transports"`
	// BlockSizes are WriteRequest sizes in bytes.
	BlockSizes []uint64 `json:"block_sizes"`
	// Depths are WriteRequests per transfer batch.
	Depths []int `json:"depths"`
	// Streams are transport.Options.Streams values (0 = transport default).
	Streams []int `json:"streams"`
	// Ops are the directions measured at every point: "write" and/or
	// "read" (one-sided READ of the receiver's region; its rows carry the
	// ratio to the WRITE row of the same point). Empty: write only.
	Ops []string `json:"ops,omitempty"`
	// Inflight is the number of batches kept submitted at once (>= 1).
	Inflight int `json:"inflight"`
	// Reps is the number of timed repetitions per case (>= 1).
	Reps int `json:"reps"`
	// Warmup is the number of untimed batches before the first repetition.
	Warmup int `json:"warmup"`
	// RepTime ends a repetition once at least MinBatches batches completed
	// and this much time passed or RepBytes bytes moved.
	RepTime    time.Duration `json:"rep_time_ns"`
	RepBytes   uint64        `json:"rep_bytes"`
	MinBatches int           `json:"min_batches"`
	// MaxRegionBytes caps the receiver region (and source buffer) per case;
	// deeper batches wrap around it.
	MaxRegionBytes uint64 `json:"max_region_bytes"`
	// Verify checks every byte of the region after each repetition.
	Verify bool `json:"verify"`
	// Memcpy measures the single-goroutine memcpy baseline per case.
	Memcpy bool `json:"memcpy"`
	// Peers runs the installed peer tools.
	Peers bool `json:"peers"`
	// CaseTimeout bounds one case (setup, reps, verification); 0 = the
	// case's own budget (CaseBudget: it scales with the bytes the case
	// moves, so a 1 GiB batch finishes where a fixed 60 s cut it off).
	CaseTimeout time.Duration `json:"case_timeout_ns"`
	// KVModel (a workload model name or config.json; "" = none) adds one
	// KV-room case per transport (RunKV): requests of KVTokens tokens.
	KVModel  string `json:"kv_model,omitempty"`
	KVTokens int    `json:"kv_tokens,omitempty"`
	// SHMStreamMinBytes is transport.SHMOptions.StreamMinBytes of every
	// transport the cases open (0: the default, 1 MiB;
	// transport.SHMStreamOff: no non-temporal stores); `kvxfer bench` sets
	// it from KVXFER_SHM_STREAM_MIN.
	SHMStreamMinBytes uint64 `json:"shm_stream_min_bytes,omitempty"`
}

// transportOptions is transport.DefaultOptions with c's transport
// settings (SHMStreamMinBytes).
func (c Config) transportOptions() transport.Options {
	opts := transport.DefaultOptions()
	opts.SHM.StreamMinBytes = c.SHMStreamMinBytes
	return opts
}

// DefaultConfig is the matrix `kvxfer bench` runs without flags: block sizes
// 4 KiB … 64 MiB, depth 1 and 8, the transports' default streams, 5 reps.
func DefaultConfig() Config {
	return Config{
		Transports:     []string{"tcp", "shm"},
		BlockSizes:     []uint64{4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20},
		Depths:         []int{1, 8},
		Streams:        []int{0},
		Ops:            []string{"write", "read"},
		Inflight:       2,
		Reps:           5,
		Warmup:         4,
		RepTime:        150 * time.Millisecond,
		RepBytes:       512 << 20,
		MinBatches:     3,
		MaxRegionBytes: 128 << 20,
		Verify:         true,
		Memcpy:         true,
		CaseTimeout:    0, // CaseBudget
		KVModel:        DefaultKVModel,
		KVTokens:       DefaultKVTokens,
	}
}

// Validate checks the knobs and names the first bad one.
func (c *Config) Validate() error {
	switch {
	case len(c.Transports) == 0:
		return errors.New("bench: no transports to measure (use --transports tcp,shm)")
	case len(c.BlockSizes) == 0 || len(c.Depths) == 0 || len(c.Streams) == 0:
		return errors.New("bench: block sizes, depths and streams must each list at least one value")
	case c.Inflight < 1 || c.Inflight > 1024:
		return fmt.Errorf("bench: inflight %d: want 1..1024 batches", c.Inflight)
	case c.Reps < 1:
		return fmt.Errorf("bench: reps %d: want >= 1", c.Reps)
	case c.Warmup < 0 || c.MinBatches < 1:
		return fmt.Errorf("bench: warmup %d / min batches %d: want >= 0 / >= 1", c.Warmup, c.MinBatches)
	case c.RepTime <= 0:
		return fmt.Errorf("bench: rep time %v: want > 0", c.RepTime)
	case c.MaxRegionBytes < 4096:
		return fmt.Errorf("bench: max region %d bytes: want >= 4096", c.MaxRegionBytes)
	case c.KVModel != "" && (c.KVTokens < 1 || c.KVTokens > 1<<20):
		return fmt.Errorf("bench: kv tokens %d: want 1..2^20 (or no --kv-model)", c.KVTokens)
	}
	for _, op := range c.Ops {
		if op != "write" && op != "read" {
			return fmt.Errorf("bench: op %q: want write or read (--ops write,read)", op)
		}
	}
	seen := map[uint64]bool{}
	for _, b := range c.BlockSizes {
		if seen[b] {
			return fmt.Errorf("bench: block size %s listed twice", FormatSize(b))
		}
		seen[b] = true
		if b > c.MaxRegionBytes {
			return fmt.Errorf("bench: block size %s exceeds the max region %s (raise --max-region)", FormatSize(b), FormatSize(c.MaxRegionBytes))
		}
	}
	return nil
}

// Cases expands the matrix in transport, block, depth, streams, op order:
// the READ case of a point right after its WRITE case, so their ratio
// compares figures taken seconds apart.
func (c *Config) Cases() []Case {
	ops := []string{OpWrite}
	if len(c.Ops) > 0 {
		ops = ops[:0]
		for _, op := range c.Ops {
			if op == "read" {
				ops = append(ops, OpRead)
			} else {
				ops = append(ops, OpWrite)
			}
		}
	}
	var out []Case
	for _, t := range c.Transports {
		for _, b := range c.BlockSizes {
			for _, d := range c.Depths {
				for _, s := range c.Streams {
					for _, op := range ops {
						out = append(out, Case{Transport: t, BlockBytes: b, Depth: d, Streams: s, Inflight: c.Inflight, Op: op})
					}
				}
			}
		}
	}
	return out
}

// HostBytes is the most host memory the run holds at once, bytes: the
// sender's and the receiver's region of its largest case (2 ×
// RegionBytes; the memcpy baseline copies between the two), or, with a KV
// model, the prefill's and the decode's KV pools (2 × the layout's pool),
// whichever is larger. The peer tools (Peers) allocate their own and are
// not counted.
func (c *Config) HostBytes() uint64 {
	var most uint64
	for _, k := range c.Cases() {
		most = max(most, 2*RegionBytes(k, c.MaxRegionBytes))
	}
	if c.KVModel != "" {
		if l, err := kvLayout(*c); err == nil {
			most = max(most, 2*l.PoolBytes())
		}
	}
	return most
}

// RegionBytes is the working set of a case: Depth blocks, capped at max
// (rounded down to whole blocks, at least one block).
func RegionBytes(c Case, max uint64) uint64 {
	n := c.BlockBytes * uint64(c.Depth)
	if n > max || n/uint64(c.Depth) != c.BlockBytes {
		n = max / c.BlockBytes * c.BlockBytes
	}
	if n < c.BlockBytes {
		n = c.BlockBytes
	}
	return n
}

// Case budget (CaseBudget): a fixed part for setup and peers' start-up,
// plus the bytes a case must move and the memory passes it makes at a floor
// rate far below any transport's on a loaded machine (the demo saw 0.08 GB/s
// at worst on a 2-core VM), so only a case that is stuck hits it.
const (
	caseBudgetBase  = 60 * time.Second
	caseBudgetFloor = 0.05e9 // bytes/s
)

// CaseBudget is how long case c may take when Config.CaseTimeout is 0: the
// base (60 s) plus, at 0.05 GB/s, the bytes of its warm-up and of every
// repetition's minimum batches (each repetition writes at least
// max(MinBatches, one pass over the region) batches), its fill, verify and
// memcpy passes over the region (4 per repetition), and its repetitions'
// RepTime.
func (c *Config) CaseBudget(k Case) time.Duration {
	if c.CaseTimeout > 0 {
		return c.CaseTimeout
	}
	region := RegionBytes(k, c.MaxRegionBytes)
	batch := k.BlockBytes * uint64(k.Depth)
	slots := region / k.BlockBytes
	nb := max(1, (slots+uint64(k.Depth)-1)/uint64(k.Depth))
	perRep := max(uint64(c.MinBatches), nb)
	bytes := float64(batch)*float64(uint64(max(c.Warmup, 0))+uint64(c.Reps)*perRep) + float64(4*region)*float64(c.Reps)
	return caseBudgetBase + time.Duration(c.Reps)*c.RepTime + time.Duration(bytes/caseBudgetFloor*float64(time.Second))
}

// RunCase measures one case end to end: two transport instances (receiver and
// sender) from the engine registry, memfd buffers, a segment, warm-up,
// cfg.Reps timed repetitions each followed by verification, and the memcpy
// baseline. A READ case (Case.Op) submits read batches of the same requests:
// the bytes flow from the receiver's region into the sender's buffer, which
// is what is verified. A failure is returned in Result.Err, never as a panic.
func RunCase(ctx context.Context, cfg Config, c Case) (res Result) {
	res = Result{Case: c, RegionBytes: RegionBytes(c, cfg.MaxRegionBytes)}
	budget := cfg.CaseBudget(c)
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	fail := func(format string, args ...any) Result {
		res.Err = fmt.Sprintf(format, args...)
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			res.Err += fmt.Sprintf(" (the case ran past its time budget of %s; --case-timeout sets another)", budget.Round(time.Second))
		}
		return res
	}
	opts := cfg.transportOptions()
	opts.Streams = c.Streams
	rcv, err := transport.OpenTransport(c.Transport, opts)
	if err != nil {
		return fail("open receiver: %v", err)
	}
	defer rcv.Close()
	snd, err := transport.OpenTransport(c.Transport, opts)
	if err != nil {
		return fail("open sender: %v", err)
	}
	defer snd.Close()
	// A case has no pool: it allocates a source and a destination region
	// of RegionBytes each (block size × depth, capped by --max-region).
	regionHint := fmt.Sprintf("; this case needs a source and a destination region of %s each (block size × depth, at most --max-region): lower --max-region, or leave this case's size out of --sizes or its depth out of --depths",
		FormatSize(res.RegionBytes))
	src, err := transport.AllocHost("bench-src", int64(res.RegionBytes))
	if err != nil {
		return fail("%v%s", err, regionHint)
	}
	defer src.Close()
	dst, err := transport.AllocHost("bench-dst", int64(res.RegionBytes))
	if err != nil {
		return fail("%v%s", err, regionHint)
	}
	defer dst.Close()
	if _, err := snd.RegisterMemory(src.Memory()); err != nil {
		return fail("register source: %v", err)
	}
	dd, err := rcv.RegisterMemory(dst.Memory())
	if err != nil {
		return fail("register destination: %v", err)
	}
	ep, err := rcv.Endpoint(ctx, "bench-sender")
	if err != nil {
		return fail("receiver endpoint: %v", err)
	}
	seg, err := snd.OpenSegment(ctx, transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{dd}})
	if err != nil {
		return fail("open segment: %v", err)
	}
	defer seg.Close()
	if reply := seg.HandshakeReply(); reply != nil {
		acc, ok := rcv.(transport.Acceptor)
		if !ok {
			return fail("transport %s returned a handshake reply but its receiver is not an transport.Acceptor", c.Transport)
		}
		if err := acc.Accept(ctx, "bench-sender", reply); err != nil {
			return fail("accept handshake: %v", err)
		}
	}

	slots := res.RegionBytes / c.BlockBytes
	op := transport.OpWrite
	if c.Read() {
		op = transport.OpRead
	}
	mkBatch := func(k int) *transport.TransferBatch {
		b := &transport.TransferBatch{Op: op, Requests: make([]transport.WriteRequest, c.Depth)}
		for j := range b.Requests {
			off := (uint64(k*c.Depth+j) % slots) * c.BlockBytes
			b.Requests[j] = transport.WriteRequest{Local: src.Addr() + uintptr(off), Remote: dd.ID, RemoteOffset: off, Length: c.BlockBytes}
		}
		return b
	}
	// Batches cycle over a fixed set, prebuilt so the timed region measures
	// the transport rather than request construction.
	nb := int(max(1, (slots+uint64(c.Depth)-1)/uint64(c.Depth)))
	batches := make([]*transport.TransferBatch, nb)
	for k := range batches {
		batches[k] = mkBatch(k)
	}
	batchBytes := batches[0].Bytes()
	// AllocHost rounds up to whole pages: fill and verify only the case's
	// working set (a block size that is not a page multiple leaves a tail
	// no write covers).
	srcB, dstB := src.Bytes()[:res.RegionBytes], dst.Bytes()[:res.RegionBytes]
	// from is the memory the bytes come from (the sender's for a write, the
	// receiver's for a read), to where they land.
	from, to, landed := srcB, dstB, "receiver"
	if c.Read() {
		from, to, landed = dstB, srcB, "sender (read destination)"
	}

	fill(from, 0x9e3779b97f4a7c15)
	if _, _, err := pump(ctx, seg, batches, max(cfg.Warmup, 0), 0, 0, c.Inflight, nil); err != nil {
		return fail("warm-up: %v", err)
	}
	var lats, mc []float64
	res.Verified = cfg.Verify
	for r := 0; r < cfg.Reps; r++ {
		fill(from, uint64(r+1)*0xbf58476d1ce4e5b9) // untimed: new content per rep
		minB := max(cfg.MinBatches, nb)            // every slot written every rep
		var repLats []float64
		start := time.Now()
		n, msgs, err := pump(ctx, seg, batches, minB, cfg.RepTime, cfg.RepBytes/max(batchBytes, 1), c.Inflight, &repLats)
		secs := time.Since(start).Seconds()
		if err != nil {
			return fail("repetition %d: %v", r+1, err)
		}
		res.Reps = append(res.Reps, Rep{Bytes: uint64(n) * batchBytes, Batches: n, Messages: msgs, Seconds: secs})
		lats = append(lats, repLats...)
		if cfg.Verify {
			if i := firstDiff(from, to); i >= 0 {
				res.Verified = false
				res.VerifyErr = fmt.Sprintf("repetition %d: %s byte %d is %#02x, source has %#02x", r+1, landed, i, to[i], from[i])
				break
			}
		}
		if cfg.Memcpy {
			// Interleaved with the transport's repetitions so both see the
			// same machine load; same buffers, same block size.
			mc = append(mc, memcpyRep(to, from, c.BlockBytes, cfg.RepTime))
		}
	}
	gb := make([]float64, len(res.Reps))
	mr := make([]float64, len(res.Reps))
	for i, r := range res.Reps {
		gb[i], mr[i] = r.GBps(), r.MsgsPerSec()
	}
	res.GBps, res.MsgsPerSec = Summarize(gb), Summarize(mr)
	sort.Float64s(lats)
	res.LatencyP50us, res.LatencyP99us = Percentile(lats, 50), Percentile(lats, 99)
	res.MemcpyGBps = Summarize(mc)
	if len(mc) == len(res.Reps) && len(mc) > 0 {
		ratios := make([]float64, len(mc))
		for i := range mc {
			ratios[i] = Ratio(gb[i], mc[i])
		}
		res.MemcpyRatio = Summarize(ratios)
	}
	return res
}

// pump submits batches (cycling) keeping inflight outstanding until at least
// minBatches completed and (dur elapsed or maxBatches completed, when those
// are > 0), then drains. It returns completed batches and messages, and
// appends per-batch latencies (µs) to lats when non-nil.
func pump(ctx context.Context, seg transport.Segment, batches []*transport.TransferBatch, minBatches int, dur time.Duration, maxBatches uint64, inflight int, lats *[]float64) (done, msgs int, err error) {
	type pending struct {
		id transport.BatchID
		t  time.Time
		n  int
	}
	q := make([]pending, 0, inflight)
	start := time.Now()
	next := 0
	enough := func() bool {
		if done+len(q) < minBatches {
			return false
		}
		if dur <= 0 && maxBatches == 0 {
			return true
		}
		return (dur > 0 && time.Since(start) >= dur) || (maxBatches > 0 && uint64(done+len(q)) >= maxBatches)
	}
	waitOldest := func() error {
		p := q[0]
		q = q[1:]
		st, err := seg.Wait(ctx, p.id)
		if err != nil {
			return fmt.Errorf("wait for batch: %w", err)
		}
		if lats != nil {
			*lats = append(*lats, durationMicros(time.Since(p.t)))
		}
		seg.Release(p.id)
		if st.State != transport.BatchCompleted {
			return fmt.Errorf("batch ended %v: %v", st.State, st.Err)
		}
		done++
		msgs += p.n
		return nil
	}
	for !enough() {
		if len(q) == inflight {
			if err := waitOldest(); err != nil {
				return done, msgs, err
			}
			continue
		}
		b := batches[next%len(batches)]
		next++
		t := time.Now()
		id, err := seg.Submit(ctx, b)
		if err != nil {
			return done, msgs, fmt.Errorf("submit: %w", err)
		}
		q = append(q, pending{id: id, t: t, n: len(b.Requests)})
	}
	for len(q) > 0 {
		if err := waitOldest(); err != nil {
			return done, msgs, err
		}
	}
	return done, msgs, nil
}

// fill writes a cheap 64-bit pattern (a Weyl sequence) seeded by seed.
func fill(b []byte, seed uint64) {
	words := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/8)
	x := seed
	for i := range words {
		x += 0x9e3779b97f4a7c15
		words[i] = x ^ (x >> 29)
	}
	for i := len(words) * 8; i < len(b); i++ {
		b[i] = byte(seed >> (i % 8))
	}
}

// firstDiff returns the first index where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	const step = 1 << 16
	for off := 0; off < len(a); off += step {
		e := min(off+step, len(a))
		if !bytes.Equal(a[off:e], b[off:e]) {
			for i := off; i < e; i++ {
				if a[i] != b[i] {
					return i
				}
			}
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// memcpyRep measures one goroutine copying block-byte chunks from src to dst,
// cycling over the whole buffers (the same working set as the case), for at
// least one pass and about dur. Returns GB/s (1e9 bytes/s).
func memcpyRep(dst, src []byte, block uint64, dur time.Duration) float64 {
	n := uint64(min(len(dst), len(src))) / block * block
	if n == 0 {
		return 0
	}
	var moved, off uint64
	check := max(1, (1<<20)/block) // read the clock about once per MiB
	start := time.Now()
	for i := uint64(1); ; i++ {
		copy(dst[off:off+block], src[off:off+block])
		moved += block
		off += block
		if off >= n {
			off = 0
		}
		if i%check == 0 && moved >= n && time.Since(start) >= dur {
			break
		}
	}
	return float64(moved) / time.Since(start).Seconds() / 1e9
}

// MemcpyBaseline runs reps memcpy repetitions of about dur each (see
// memcpyRep) and summarises their GB/s.
func MemcpyBaseline(dst, src []byte, block uint64, reps int, dur time.Duration) Stat {
	xs := make([]float64, 0, reps)
	for r := 0; r < reps; r++ {
		xs = append(xs, memcpyRep(dst, src, block, dur))
	}
	return Summarize(xs)
}

// EffectiveStreams is the stream count a transport uses when
// transport.Options.Streams is 0, taken from the transports' own defaults: tcp
// connections per segment, shm and cma copy goroutines, RDMA QPs per device per peer;
// 0 for a transport it does not know.
func EffectiveStreams(transport string) int {
	switch transport {
	case "tcp":
		return tcp.DefaultStreams
	case "shm", "cma":
		return shm.DefaultCopyThreads()
	case "rdma":
		return rdma.DefaultStreams
	}
	return 0
}
