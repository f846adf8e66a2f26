package engine

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
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
// block of host memory allocated outside the Go heap (AllocHost), plus a page
// allocator. Register Memory() with each transport. Close frees the memory;
// it is idempotent.
type KVPool struct {
	layout *Layout
	buf    *HostBuffer
	*PageAllocator
}

// NewKVPool allocates the pool for l (l.PoolBytes() bytes, zeroed). name
// appears in /proc/PID/fd. Errors name the size and cause.
func NewKVPool(l *Layout, name string) (*KVPool, error) {
	size := l.PoolBytes()
	if size == 0 || size > 1<<46 {
		return nil, fmt.Errorf("engine: KV pool %q: size %d bytes is out of range", name, size)
	}
	buf, err := AllocHost(name, int64(size))
	if err != nil {
		return nil, err
	}
	return &KVPool{layout: l, buf: buf, PageAllocator: NewPageAllocator(l.NumPages)}, nil
}

// Layout returns the pool's geometry.
func (p *KVPool) Layout() *Layout { return p.layout }

// Memory describes the pool for Transport.RegisterMemory.
func (p *KVPool) Memory() Memory { return p.buf.Memory() }

// Bytes returns the pool's memory (valid until Close).
func (p *KVPool) Bytes() []byte { return p.buf.Bytes() }

// Addr returns the address of the pool's first byte.
func (p *KVPool) Addr() uintptr { return p.buf.Addr() }

// Item returns the ItemLen bytes of page `page` in buffer `buf`.
func (p *KVPool) Item(buf, page int) []byte {
	il := p.layout.ItemLen()
	off := p.layout.BufferOffset(buf) + uint64(page)*il
	return p.buf.Bytes()[off : off+il]
}

// Prefault makes the whole pool resident now (madvise MADV_POPULATE_WRITE,
// Linux ≥ 5.14), so the first transfers do not pay one page fault per 4 KiB
// on either side. Errors name the cause; the pool stays usable either way
// (on older kernels memory is then faulted in on first use).
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

// Close frees the pool memory. Deregister it from every transport first.
func (p *KVPool) Close() error { return p.buf.Close() }
