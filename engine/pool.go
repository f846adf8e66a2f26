package engine

import (
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/cuda"
)

// ErrPoolExhausted is returned by PageAllocator.Alloc when fewer pages are free
// than asked for; the wrapping error gives both counts.
var ErrPoolExhausted = errors.New("engine: KV pool exhausted")

// PageAllocator hands out page indices in [0, n). Free pages are kept sorted
// and handed out lowest first, so a fresh pool gives contiguous runs (which the
// sender coalesces) and a fragmented one still works. Safe for concurrent use.
type PageAllocator struct {
	mu   sync.Mutex
	n    int
	free []int32 // ascending
	used []bool
}

// NewPageAllocator returns an allocator of n pages, all free.
func NewPageAllocator(n int) *PageAllocator {
	a := &PageAllocator{n: n, free: make([]int32, n), used: make([]bool, n)}
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

// Alloc takes n pages (n ≥ 0), lowest indices first. It returns an error
// wrapping ErrPoolExhausted when fewer than n are free (nothing is taken).
func (a *PageAllocator) Alloc(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("engine: allocate %d pages: count must be >= 0", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if n > len(a.free) {
		return nil, fmt.Errorf("%w: %d pages asked, %d of %d free (free finished requests or raise the pool size)", ErrPoolExhausted, n, len(a.free), a.n)
	}
	out := slices.Clone(a.free[:n])
	a.free = a.free[n:]
	for _, p := range out {
		a.used[p] = true
	}
	return out, nil
}

// Free returns pages to the pool. A page out of range or not allocated is an
// error naming it, and then no page is freed.
func (a *PageAllocator) Free(pages []int32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	seen := make(map[int32]bool, len(pages))
	for _, p := range pages {
		if p < 0 || int(p) >= a.n {
			return fmt.Errorf("engine: free page %d: out of range [0, %d)", p, a.n)
		}
		if !a.used[p] || seen[p] {
			return fmt.Errorf("engine: free page %d: not allocated (double free?)", p)
		}
		seen[p] = true
	}
	for _, p := range pages {
		a.used[p] = false
	}
	a.free = append(a.free, pages...)
	slices.Sort(a.free)
	return nil
}

// KVPool is one rank's KV cache: a Layout's buffers back to back in one
// block of memory, plus a page allocator. The block is host memory allocated
// outside the Go heap (NewKVPool, AllocHost) or CUDA device memory
// (NewDeviceKVPool, cudaMalloc). Register Memory() with each transport.
// Close frees the memory; it is idempotent.
type KVPool struct {
	layout *Layout
	buf    *HostBuffer // host pools
	// Device pools: dptr is the cudaMalloc'ed block of size bytes on CUDA
	// device dev (0 once closed).
	dev  int
	size uint64
	mu   sync.Mutex
	dptr cuda.DevicePtr
	*PageAllocator
}

// poolSize checks l's pool size (bytes) for name.
func poolSize(l *Layout, name string) (uint64, error) {
	size := l.PoolBytes()
	if size == 0 || size > 1<<46 {
		return 0, fmt.Errorf("engine: KV pool %q: size %d bytes is out of range", name, size)
	}
	return size, nil
}

// NewKVPool allocates the pool for l (l.PoolBytes() bytes, zeroed) in host
// memory. name appears in /proc/PID/fd. Errors name the size and cause.
func NewKVPool(l *Layout, name string) (*KVPool, error) {
	size, err := poolSize(l, name)
	if err != nil {
		return nil, err
	}
	buf, err := AllocHost(name, int64(size))
	if err != nil {
		return nil, err
	}
	return &KVPool{layout: l, buf: buf, dev: -1, PageAllocator: NewPageAllocator(l.NumPages)}, nil
}

// NewDeviceKVPool allocates the pool for l (l.PoolBytes() bytes, zeroed) in
// the memory of CUDA device dev (cudaMalloc); Memory() then has Kind
// MemoryCUDA, so only transports with CapDeviceMemory can register it.
// The CPU reaches it only through ReadAt/WriteAt (Bytes is nil). Errors wrap
// cuda.ErrNotSupported when this host has no usable CUDA (no driver, no
// device, no cgo), and name the device and size otherwise.
func NewDeviceKVPool(l *Layout, name string, dev int) (*KVPool, error) {
	size, err := poolSize(l, name)
	if err != nil {
		return nil, err
	}
	if dev < 0 {
		return nil, fmt.Errorf("engine: KV pool %q: CUDA device %d: want an ordinal >= 0", name, dev)
	}
	if err := cuda.Available(); err != nil {
		return nil, fmt.Errorf("engine: KV pool %q on cuda:%d: %w", name, dev, err)
	}
	d, err := cuda.Malloc(dev, size)
	if err != nil {
		return nil, fmt.Errorf("engine: KV pool %q: allocate %d bytes on cuda:%d: %w", name, size, dev, err)
	}
	if err := cuda.Memset(dev, d, 0, size); err != nil {
		_ = cuda.Free(dev, d)
		return nil, fmt.Errorf("engine: KV pool %q: zero %d bytes on cuda:%d: %w", name, size, dev, err)
	}
	return &KVPool{layout: l, dev: dev, size: size, dptr: d, PageAllocator: NewPageAllocator(l.NumPages)}, nil
}

// Layout returns the pool's geometry.
func (p *KVPool) Layout() *Layout { return p.layout }

// Device returns the CUDA device ordinal of a device pool, and ok = false
// (dev -1) for a host pool.
func (p *KVPool) Device() (dev int, ok bool) {
	if p.buf != nil {
		return -1, false
	}
	return p.dev, true
}

// Memory describes the pool for Transport.RegisterMemory.
func (p *KVPool) Memory() Memory {
	if p.buf != nil {
		return p.buf.Memory()
	}
	return Memory{Addr: p.Addr(), Length: p.size, Kind: MemoryCUDA, Device: p.dev, FD: -1}
}

// Bytes returns a host pool's memory (valid until Close); nil for a device
// pool (use ReadAt/WriteAt).
func (p *KVPool) Bytes() []byte {
	if p.buf == nil {
		return nil
	}
	return p.buf.Bytes()
}

// Addr returns the address of the pool's first byte (a device pointer for a
// device pool; 0 once a device pool is closed).
func (p *KVPool) Addr() uintptr {
	if p.buf != nil {
		return p.buf.Addr()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return uintptr(p.dptr)
}

// span checks [off, off+n) against the pool size.
func (p *KVPool) span(op string, off uint64, n int) error {
	size := p.size
	if p.buf != nil {
		size = uint64(p.buf.Len())
	}
	if off > size || uint64(n) > size-off {
		return fmt.Errorf("engine: KV pool %s [%d, %d): outside the %d-byte pool", op, off, off+uint64(n), size)
	}
	return nil
}

// ReadAt copies len(dst) bytes at byte offset off of the pool into dst
// (cudaMemcpy device-to-host for a device pool). Errors name the range.
func (p *KVPool) ReadAt(dst []byte, off uint64) error {
	if err := p.span("read", off, len(dst)); err != nil {
		return err
	}
	if p.buf != nil {
		copy(dst, p.buf.Bytes()[off:])
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dptr == 0 {
		return fmt.Errorf("engine: KV pool read: %w", ErrClosed)
	}
	if len(dst) == 0 {
		return nil
	}
	if err := cuda.CopyFromDevice(p.dev, dst, p.dptr+cuda.DevicePtr(off)); err != nil {
		return fmt.Errorf("engine: KV pool read [%d, %d) from cuda:%d: %w", off, off+uint64(len(dst)), p.dev, err)
	}
	return nil
}

// WriteAt copies src to byte offset off of the pool (cudaMemcpy
// host-to-device for a device pool). Errors name the range.
func (p *KVPool) WriteAt(src []byte, off uint64) error {
	if err := p.span("write", off, len(src)); err != nil {
		return err
	}
	if p.buf != nil {
		copy(p.buf.Bytes()[off:], src)
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dptr == 0 {
		return fmt.Errorf("engine: KV pool write: %w", ErrClosed)
	}
	if len(src) == 0 {
		return nil
	}
	if err := cuda.CopyToDevice(p.dev, p.dptr+cuda.DevicePtr(off), src); err != nil {
		return fmt.Errorf("engine: KV pool write [%d, %d) to cuda:%d: %w", off, off+uint64(len(src)), p.dev, err)
	}
	return nil
}

// crcUpdate extends crc (CRC32C) over the n bytes at byte offset off; a
// device pool's bytes are copied to the host through *scratch first.
func (p *KVPool) crcUpdate(crc uint32, off, n uint64, scratch *[]byte) (uint32, error) {
	if p.buf != nil {
		return crc32.Update(crc, castagnoli, p.buf.Bytes()[off:off+n]), nil
	}
	if uint64(cap(*scratch)) < n {
		*scratch = make([]byte, n)
	}
	b := (*scratch)[:n]
	if err := p.ReadAt(b, off); err != nil {
		return crc, err
	}
	return crc32.Update(crc, castagnoli, b), nil
}

// Item returns the ItemLen bytes of page `page` in buffer `buf` of a host
// pool (it panics on a device pool: use ReadAt/WriteAt at ItemOffset).
func (p *KVPool) Item(buf, page int) []byte {
	off := p.ItemOffset(buf, page)
	return p.buf.Bytes()[off : off+p.layout.ItemLen()]
}

// ItemOffset is the byte offset of page `page` in buffer `buf` inside the
// pool; the item is Layout().ItemLen() bytes long.
func (p *KVPool) ItemOffset(buf, page int) uint64 {
	return p.layout.BufferOffset(buf) + uint64(page)*p.layout.ItemLen()
}

// Prefault makes a host pool resident now (madvise MADV_POPULATE_WRITE,
// Linux ≥ 5.14), so the first transfers do not pay one page fault per 4 KiB
// on either side; a device pool is resident already (nil). Errors name the
// cause; the pool stays usable either way (on older kernels memory is then
// faulted in on first use).
func (p *KVPool) Prefault() error {
	b := p.Bytes()
	if len(b) == 0 {
		return nil
	}
	if err := unix.Madvise(b, unix.MADV_POPULATE_WRITE); err != nil {
		return fmt.Errorf("engine: prefault KV pool (%d bytes): %w (kernel older than 5.14, or not enough memory)", len(b), err)
	}
	return nil
}

// Close frees the pool memory (munmap, or cudaFree for a device pool).
// Deregister it from every transport first. Idempotent.
func (p *KVPool) Close() error {
	if p.buf != nil {
		return p.buf.Close()
	}
	p.mu.Lock()
	d := p.dptr
	p.dptr = 0
	p.mu.Unlock()
	if d == 0 {
		return nil
	}
	if err := cuda.Free(p.dev, d); err != nil {
		return fmt.Errorf("engine: KV pool: free %d bytes on cuda:%d: %w", p.size, p.dev, err)
	}
	return nil
}
