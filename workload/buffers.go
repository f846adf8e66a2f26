package workload

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// ErrPoolExhausted is returned by PageAllocator.Alloc when fewer pages are free
// than asked for; the wrapping error gives both counts.
var ErrPoolExhausted = errors.New("workload: KV pool exhausted")

// ErrPoolTooSmall is returned by PageAllocator.AllocWait when a request needs
// more pages than the pool holds, so no amount of waiting helps; the
// wrapping error gives both counts.
var ErrPoolTooSmall = errors.New("workload: KV pool too small for the request")

// PageAllocator hands out page indices in [0, n), as a serving engine's KV
// pool allocator does (kvxfer itself never allocates pages: the caller gives
// page indices to Sender.Send and Receiver.SendMetadata). Free pages are kept
// sorted and handed out lowest first, so a fresh pool gives contiguous runs
// (which the sender coalesces) and a fragmented one still works; Fragment
// switches to the random order of a long-running server's free list. Safe
// for concurrent use.
type PageAllocator struct {
	mu   sync.Mutex
	n    int
	free []int32 // ascending, or in random order once fragmented
	used []bool
	rng  *rand.Rand // non-nil once Fragment was called
	// freed is closed (and replaced) by every Free and every change of
	// the wait queue: AllocWait's wake-up.
	freed chan struct{}
	// waiters is AllocWait's queue, oldest first: only its head may take
	// pages, so a large request is not overtaken by every later small one.
	waiters []*pageWaiter
}

// pageWaiter is one AllocWait call waiting for pages.
type pageWaiter struct{ n int }

// Fragment makes the allocator hand out pages in the random order a warm
// serving engine's free list has (pages of finished requests go back
// wherever they were, so a new request's pages are scattered over the
// pool): the free list is shuffled now, with a generator seeded by seed,
// and every page freed later goes to a random place in it. Consecutive
// pages of one Alloc are then rarely adjacent, so a transfer writes about
// one request per page and buffer instead of a few long runs.
func (a *PageAllocator) Fragment(seed uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.rng = rand.New(rand.NewPCG(seed, 0x66726167))
	a.rng.Shuffle(len(a.free), func(i, j int) { a.free[i], a.free[j] = a.free[j], a.free[i] })
}

// NewPageAllocator returns an allocator of n pages, all free.
func NewPageAllocator(n int) *PageAllocator {
	a := &PageAllocator{n: n, free: make([]int32, n), used: make([]bool, n), freed: make(chan struct{})}
	for i := range a.free {
		a.free[i] = int32(i)
	}
	return a
}

// Capacity is the number of pages the allocator manages.
func (a *PageAllocator) Capacity() int { return a.n }

// FreePages is the number of free pages now.
func (a *PageAllocator) FreePages() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.free)
}

// Alloc takes n pages (n ≥ 0), lowest indices first (in free-list order
// once fragmented). It returns an error
// wrapping ErrPoolExhausted when fewer than n are free (nothing is taken).
func (a *PageAllocator) Alloc(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("workload: allocate %d pages: count must be >= 0", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if n > len(a.free) {
		return nil, fmt.Errorf("%w: %d pages asked, %d of %d free (free finished requests or raise the pool size)", ErrPoolExhausted, n, len(a.free), a.n)
	}
	return a.takeLocked(n), nil
}

// AllocWait takes n pages like Alloc, waiting for Free to return enough
// when fewer are free (finished requests give theirs back). Waiting calls
// are served first come, first served: a call takes pages only when every
// call that started waiting before it has taken its own (or given up), so a
// request for most of the pool is not overtaken by every later small one.
// It fails at once with an error wrapping ErrPoolTooSmall when n exceeds
// Capacity, and with ctx's error (context.DeadlineExceeded or Canceled,
// wrapped with the counts and the queue position) when ctx ends first:
// bound the wait with a context deadline. Alloc does not queue.
func (a *PageAllocator) AllocWait(ctx context.Context, n int) ([]int32, error) {
	if n > a.n {
		return nil, fmt.Errorf("%w: %d pages asked, the pool holds %d", ErrPoolTooSmall, n, a.n)
	}
	if n < 0 {
		return nil, fmt.Errorf("workload: allocate %d pages: count must be >= 0", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.waiters) == 0 && n <= len(a.free) {
		return a.takeLocked(n), nil
	}
	w := &pageWaiter{n: n}
	a.waiters = append(a.waiters, w)
	for {
		if a.waiters[0] == w && n <= len(a.free) {
			a.waiters = a.waiters[1:]
			a.wakeLocked() // the next waiter may fit too
			return a.takeLocked(n), nil
		}
		freed := a.freed
		a.mu.Unlock()
		select {
		case <-freed:
			a.mu.Lock()
		case <-ctx.Done():
			a.mu.Lock()
			pos := slices.Index(a.waiters, w)
			a.waiters = slices.Delete(a.waiters, pos, pos+1)
			a.wakeLocked()
			return nil, fmt.Errorf("%w: %d pages asked, %d of %d free, %d requests waiting before this one (waited for pages to be freed: %w)",
				ErrPoolExhausted, n, len(a.free), a.n, pos, ctx.Err())
		}
	}
}

// Waiting is the number of AllocWait calls waiting for pages now.
func (a *PageAllocator) Waiting() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.waiters)
}

// takeLocked takes n pages (n <= len(a.free)); a.mu held.
func (a *PageAllocator) takeLocked(n int) []int32 {
	out := slices.Clone(a.free[:n])
	a.free = a.free[n:]
	for _, p := range out {
		a.used[p] = true
	}
	return out
}

// wakeLocked wakes every AllocWait call; a.mu held.
func (a *PageAllocator) wakeLocked() {
	close(a.freed)
	a.freed = make(chan struct{})
}

// Free returns pages to the pool. A page out of range or not allocated is an
// error naming it, and then no page is freed.
func (a *PageAllocator) Free(pages []int32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	seen := make(map[int32]bool, len(pages))
	for _, p := range pages {
		if p < 0 || int(p) >= a.n {
			return fmt.Errorf("workload: free page %d: out of range [0, %d)", p, a.n)
		}
		if !a.used[p] || seen[p] {
			return fmt.Errorf("workload: free page %d: not allocated (double free?)", p)
		}
		seen[p] = true
	}
	for _, p := range pages {
		a.used[p] = false
	}
	a.wakeLocked()
	if a.rng == nil {
		a.free = append(a.free, pages...)
		slices.Sort(a.free)
		return nil
	}
	for _, p := range pages { // each to a random place (one Fisher–Yates step)
		a.free = append(a.free, p)
		j := a.rng.IntN(len(a.free))
		a.free[j], a.free[len(a.free)-1] = a.free[len(a.free)-1], a.free[j]
	}
	return nil
}

// AuxBuffer is one aux (metadata) buffer of SGLang's MetadataBuffers
// (disaggregation/utils.py, spec §6.5): RowBytes bytes per request row.
type AuxBuffer struct {
	// Name is SGLang's tensor name.
	Name string
	// RowBytes is the bytes of one row (SGLang aux_item_len).
	RowBytes uint64
}

// DefaultAux is the aux buffer list the demo, bench and tests build: the
// MetadataBuffers rows every SGLang version has, with their per-slot sizes
// (spec §6.5; speculative-decoding rows left out), bootstrap_room last.
var DefaultAux = []AuxBuffer{
	{"output_ids", 16 * 4},
	{"cached_tokens", 16 * 4},
	{"output_token_logprobs_val", 16 * 4},
	{"output_token_logprobs_idx", 16 * 4},
	{"output_top_logprobs_val", 128 * 4},
	{"output_top_logprobs_idx", 128 * 4},
	{"bootstrap_room", 8 * 8},
}

// BufferOptions say where and how NewKVBuffers allocates.
type BufferOptions struct {
	// Name labels the memory (memfd names, errors).
	Name string
	// Device is the CUDA device ordinal of the KV buffers, or -1 for host
	// memory. Aux buffers are always host memory (as SGLang's MetadataBuffers).
	Device int
	// Contiguous allocates all KV buffers back to back in one block (buffer i
	// at byte Layout.BufferOffset(i)), as kvx_kv_pool presents a
	// library-allocated pool; otherwise each buffer is its own allocation, as
	// a serving engine allocates one tensor per layer.
	Contiguous bool
	// Aux is the aux buffer list (nil: none) and AuxRows the rows of each.
	Aux     []AuxBuffer
	AuxRows int
	// Prefault makes host buffers resident and warm at allocation
	// (transport.WithPrefault), so the first transfer runs at the speed of the
	// later ones; it costs about one memory pass at start.
	Prefault bool
	// Stop, when closed, makes NewKVBuffers stop before the next buffer it
	// would allocate (a prefaulted pool of GiBs takes seconds), free what it
	// allocated and return an error wrapping ErrAllocStopped; nil: never.
	Stop <-chan struct{}
}

// ErrAllocStopped is wrapped by NewKVBuffers' error when BufferOptions.Stop
// was closed before every buffer was allocated.
var ErrAllocStopped = errors.New("allocation stopped")

// stopped returns an ErrAllocStopped error once o.Stop is closed, naming the
// buffers allocated of n.
func (o BufferOptions) stopped(done, n int) error {
	select {
	case <-o.Stop:
		return fmt.Errorf("workload: KV buffers %q: %w after %d of %d buffers", o.Name, ErrAllocStopped, done, n)
	default:
		return nil
	}
}

// allocOpts are the transport.AllocHost options these options ask for.
func (o BufferOptions) allocOpts() []transport.AllocOption {
	if o.Prefault {
		return []transport.AllocOption{transport.WithPrefault()}
	}
	return nil
}

// KVBuffers is one rank's KV memory laid out as a serving engine lays it out
// (spec §6.2): a buffer per layer for K and one for V (MHA/GQA) or one per
// layer (MLA), each Layout.NumPages × Layout.ItemLen bytes, plus aux buffers
// of AuxRows rows. Host buffers are memfd memory (transport.AllocHost), so the
// shm transport can share them; device buffers are cudaMalloc'ed on one GPU.
// Args describes them to engine.NewManager, which registers them and never
// frees them. Close frees everything; it is idempotent. Safe for concurrent
// use (the bytes themselves are not synchronised).
type KVBuffers struct {
	layout *Layout
	dev    int // -1: host
	aux    []AuxBuffer
	rows   int

	mu      sync.Mutex
	closed  bool
	hosts   []*transport.HostBuffer // KV host memory: one per buffer, or one block
	dptrs   []cuda.DevicePtr        // KV device memory: one per buffer, or one block
	kv      []kvargs.Buffer
	auxHost []*transport.HostBuffer
	auxBufs []kvargs.Buffer
	*PageAllocator
}

// NewKVBuffers allocates the KV (and aux) buffers of l, zeroed. Errors name
// the buffer, its size and the cause; device buffers wrap
// cuda.ErrNotSupported when this host has no usable CUDA.
func NewKVBuffers(l *Layout, o BufferOptions) (_ *KVBuffers, err error) {
	if o.Name == "" {
		o.Name = "kv"
	}
	if l.PoolBytes() == 0 || l.PoolBytes() > 1<<46 {
		return nil, fmt.Errorf("workload: KV buffers %q: %d bytes in all is out of range", o.Name, l.PoolBytes())
	}
	if o.AuxRows < 0 || (len(o.Aux) > 0 && o.AuxRows == 0) {
		return nil, fmt.Errorf("workload: KV buffers %q: %d aux rows; want >= 1 with aux buffers", o.Name, o.AuxRows)
	}
	b := &KVBuffers{layout: l, dev: o.Device, aux: slices.Clone(o.Aux), rows: o.AuxRows, PageAllocator: NewPageAllocator(l.NumPages)}
	defer func() {
		if err != nil {
			b.Close()
		}
	}()
	n := l.NumBuffers()
	bl := l.BufferLen()
	if o.Device >= 0 {
		if err := cuda.Available(); err != nil {
			return nil, fmt.Errorf("workload: KV buffers %q on cuda:%d: %w", o.Name, o.Device, err)
		}
		alloc := func(size uint64) (cuda.DevicePtr, error) {
			d, err := cuda.Malloc(o.Device, size)
			if err != nil {
				return 0, fmt.Errorf("workload: KV buffers %q: allocate %d bytes on cuda:%d: %w", o.Name, size, o.Device, err)
			}
			b.dptrs = append(b.dptrs, d)
			if err := cuda.Memset(o.Device, d, 0, size); err != nil {
				return 0, fmt.Errorf("workload: KV buffers %q: zero %d bytes on cuda:%d: %w", o.Name, size, o.Device, err)
			}
			return d, nil
		}
		dev := func(p cuda.DevicePtr) kvargs.Buffer {
			return kvargs.Buffer{Memory: transport.Memory{Addr: uintptr(p), Length: bl, Kind: transport.MemoryCUDA, Device: o.Device, FD: -1}, ItemLen: l.ItemLen()}
		}
		if o.Contiguous {
			d, err := alloc(l.PoolBytes())
			if err != nil {
				return nil, err
			}
			for i := 0; i < n; i++ {
				b.kv = append(b.kv, dev(d+cuda.DevicePtr(l.BufferOffset(i))))
			}
		} else {
			for i := 0; i < n; i++ {
				if err := o.stopped(i, n); err != nil {
					return nil, err
				}
				d, err := alloc(bl)
				if err != nil {
					return nil, err
				}
				b.kv = append(b.kv, dev(d))
			}
		}
	} else if o.Contiguous {
		h, err := transport.AllocHost(o.Name, int64(l.PoolBytes()), o.allocOpts()...)
		if err != nil {
			return nil, err
		}
		b.hosts = append(b.hosts, h)
		m := h.Memory()
		for i := 0; i < n; i++ {
			off := l.BufferOffset(i)
			b.kv = append(b.kv, kvargs.Buffer{Memory: transport.Memory{Addr: m.Addr + uintptr(off), Length: bl, Kind: transport.MemoryHost, FD: m.FD, FDOffset: off}, ItemLen: l.ItemLen()})
		}
	} else {
		for i := 0; i < n; i++ {
			if err := o.stopped(i, n); err != nil {
				return nil, err
			}
			layer, kv := l.BufferLayer(i)
			h, err := transport.AllocHost(fmt.Sprintf("%s-%s%d", o.Name, kvName(l, kv), layer), int64(bl), o.allocOpts()...)
			if err != nil {
				return nil, err
			}
			b.hosts = append(b.hosts, h)
			m := h.Memory()
			m.Length = bl // AllocHost rounds up to the OS page size
			b.kv = append(b.kv, kvargs.Buffer{Memory: m, ItemLen: l.ItemLen()})
		}
	}
	for _, a := range o.Aux {
		if a.RowBytes == 0 {
			return nil, fmt.Errorf("workload: aux buffer %q has 0-byte rows", a.Name)
		}
		h, err := transport.AllocHost(o.Name+"-aux-"+a.Name, int64(a.RowBytes)*int64(o.AuxRows), o.allocOpts()...)
		if err != nil {
			return nil, err
		}
		b.auxHost = append(b.auxHost, h)
		m := h.Memory()
		m.Length = a.RowBytes * uint64(o.AuxRows)
		b.auxBufs = append(b.auxBufs, kvargs.Buffer{Memory: m, ItemLen: a.RowBytes})
	}
	return b, nil
}

// kvName is "K", "V" or "latent" (MLA) for kv 0/1.
func kvName(l *Layout, kv int) string {
	switch {
	case l.Model.MLA:
		return "latent"
	case kv == 1:
		return "V"
	}
	return "K"
}

// Layout returns the geometry the buffers were built for.
func (b *KVBuffers) Layout() *Layout { return b.layout }

// Device returns the CUDA device ordinal of device KV buffers, and ok = false
// (dev -1) for host buffers.
func (b *KVBuffers) Device() (dev int, ok bool) { return b.dev, b.dev >= 0 }

// AuxRows is the number of rows of each aux buffer (0 without aux buffers).
func (b *KVBuffers) AuxRows() int { return b.rows }

// Aux is the aux buffer list the buffers were built with.
func (b *KVBuffers) Aux() []AuxBuffer { return slices.Clone(b.aux) }

// Args returns the KV arguments an engine would hand kvxfer for these
// buffers (SGLang's KVArgs, spec §6.1): the buffer lists, page size, KV heads
// per rank and in total, TP/PP placement and the first layer held.
func (b *KVBuffers) Args() kvargs.KVArgs {
	l := b.layout
	total := l.Model.NumKVHeads
	if l.Model.MLA {
		total = 1
	}
	return kvargs.KVArgs{
		KVBuffers: slices.Clone(b.kv), AuxBuffers: slices.Clone(b.auxBufs),
		PageSize: l.PageSize, KVHeadNum: l.HeadsPerRank, TotalKVHeadNum: total,
		EngineRank: l.TPRank, TPSize: l.TPSize, PPRank: l.PPRank, PPSize: l.PPSize,
		PrefillStartLayer: l.StartLayer, MLA: l.Model.MLA, GPUID: b.dev,
	}
}

// Buffer returns KV buffer i's description.
func (b *KVBuffers) Buffer(i int) kvargs.Buffer { return b.kv[i] }

// Bytes returns host KV buffer i's memory (valid until Close), nil for a
// device buffer (use ReadAt/WriteAt).
func (b *KVBuffers) Bytes(i int) []byte {
	if b.dev >= 0 {
		return nil
	}
	return b.kv[i].Bytes()
}

// AuxRow returns row `row` of aux buffer i (host memory; valid until Close).
func (b *KVBuffers) AuxRow(i, row int) []byte {
	m := b.auxBufs[i]
	off := uint64(row) * m.ItemLen
	return m.Bytes()[off : off+m.ItemLen]
}

// span checks [off, off+n) against KV buffer i.
func (b *KVBuffers) span(op string, i int, off uint64, n int) error {
	if i < 0 || i >= len(b.kv) {
		return fmt.Errorf("workload: KV buffer %s: buffer %d not in [0, %d)", op, i, len(b.kv))
	}
	size := b.kv[i].Length
	if off > size || uint64(n) > size-off {
		return fmt.Errorf("workload: KV buffer %d %s [%d, %d): outside the %d-byte buffer", i, op, off, off+uint64(n), size)
	}
	return nil
}

// ReadAt copies len(dst) bytes at byte offset off of KV buffer i into dst
// (cudaMemcpy device-to-host for a device buffer). Errors name the range.
func (b *KVBuffers) ReadAt(i int, dst []byte, off uint64) error {
	if err := b.span("read", i, off, len(dst)); err != nil {
		return err
	}
	if b.dev < 0 {
		copy(dst, b.Bytes(i)[off:])
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("workload: KV buffer read: %w", transport.ErrClosed)
	}
	if len(dst) == 0 {
		return nil
	}
	if err := cuda.CopyFromDevice(b.dev, dst, cuda.DevicePtr(b.kv[i].Addr)+cuda.DevicePtr(off)); err != nil {
		return fmt.Errorf("workload: KV buffer %d read [%d, %d) from cuda:%d: %w", i, off, off+uint64(len(dst)), b.dev, err)
	}
	return nil
}

// WriteAt copies src to byte offset off of KV buffer i (cudaMemcpy
// host-to-device for a device buffer). Errors name the range.
func (b *KVBuffers) WriteAt(i int, src []byte, off uint64) error {
	if err := b.span("write", i, off, len(src)); err != nil {
		return err
	}
	if b.dev < 0 {
		copy(b.Bytes(i)[off:], src)
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("workload: KV buffer write: %w", transport.ErrClosed)
	}
	if len(src) == 0 {
		return nil
	}
	if err := cuda.CopyToDevice(b.dev, cuda.DevicePtr(b.kv[i].Addr)+cuda.DevicePtr(off), src); err != nil {
		return fmt.Errorf("workload: KV buffer %d write [%d, %d) to cuda:%d: %w", i, off, off+uint64(len(src)), b.dev, err)
	}
	return nil
}

// Prefault makes host buffers resident now (transport.Prefault: populate and
// one write per page, contents kept), so the first transfers do not pay a
// page fault per 4 KiB on this side; device buffers are resident already.
// BufferOptions.Prefault does more, at allocation. Errors name the cause;
// the buffers stay usable either way.
func (b *KVBuffers) Prefault() error {
	for _, h := range append(slices.Clone(b.hosts), b.auxHost...) {
		if err := transport.Prefault(h.Memory()); err != nil {
			return fmt.Errorf("workload: prefault KV buffers: %w", err)
		}
	}
	return nil
}

// Close frees every buffer (munmap, or cudaFree). Close the KV manager that
// registered them first. Idempotent.
func (b *KVBuffers) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	var errs []error
	for _, h := range append(b.hosts, b.auxHost...) {
		errs = append(errs, h.Close())
	}
	for _, d := range b.dptrs {
		if err := cuda.Free(b.dev, d); err != nil {
			errs = append(errs, fmt.Errorf("workload: free KV buffer on cuda:%d: %w", b.dev, err))
		}
	}
	b.hosts, b.auxHost, b.dptrs = nil, nil, nil
	return errors.Join(errs...)
}

// Digest returns the SHA-256 (hex) of pages' bytes in every KV buffer: for
// each buffer in order, each page in the given order. The bytes a decode
// received for a request hash to the same value as a local KVBuffers of the
// same layout filled with that request's pattern on any pages, so a harness
// can check received KV without the engine's verification. Errors: a page
// outside a buffer, a failed device read.
func (b *KVBuffers) Digest(pages []int32) (string, error) {
	h := sha256.New()
	var row []byte
	for i, kb := range b.kv {
		if uint64(cap(row)) < kb.ItemLen {
			row = make([]byte, kb.ItemLen)
		}
		row = row[:kb.ItemLen]
		for _, p := range pages {
			if err := b.ReadAt(i, row, uint64(p)*kb.ItemLen); err != nil {
				return "", fmt.Errorf("workload: digest of page %d: %w", p, err)
			}
			h.Write(row)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
