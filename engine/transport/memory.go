package transport

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HostBuffer is host memory allocated outside the Go heap: a memfd mapped
// MAP_SHARED, so a NIC, a peer process (shm transport) or a C caller may keep
// pointers into it. Close unmaps it and closes the memfd; it is idempotent.
//
// A HostBuffer is safe for concurrent use; its bytes are not synchronised.
type HostBuffer struct {
	mu   sync.Mutex
	data []byte
	fd   int
	name string
}

// AllocHost allocates size bytes (rounded up to the page size) of zeroed host
// memory backed by a memfd named name (visible in /proc/PID/fd for debugging).
// With WithPrefault the memory is resident and warm before it is returned
// (see WithPrefault), so its first transfer runs at the speed of the later
// ones. Errors: size <= 0, memfd_create or mmap failures (ENOMEM: the error says
// to ask for less or raise the address-space/overcommit limits; the caller
// names its own size setting), a failed prefault.
func AllocHost(name string, size int64, opts ...AllocOption) (*HostBuffer, error) {
	var o allocOptions
	for _, opt := range opts {
		opt(&o)
	}
	if size <= 0 {
		return nil, fmt.Errorf("engine: allocate %q: size must be > 0 bytes, got %d", name, size)
	}
	pg := int64(unix.Getpagesize())
	size = (size + pg - 1) / pg * pg
	fd, err := unix.MemfdCreate("kvxfer:"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("engine: allocate %q (%d bytes): memfd_create: %w", name, size, err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("engine: allocate %q (%d bytes): ftruncate: %w", name, size, err)
	}
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("engine: allocate %q (%d bytes): mmap: %w (ask for less memory, or raise this process's limits: ulimit -v, vm.overcommit_memory, its memory cgroup)", name, size, err)
	}
	if o.prefault {
		if err := prefaultFresh(data); err != nil {
			_ = unix.Munmap(data)
			unix.Close(fd)
			return nil, fmt.Errorf("engine: allocate %q (%d bytes): %w", name, size, err)
		}
	}
	return &HostBuffer{data: data, fd: fd, name: name}, nil
}

// Bytes returns the buffer's memory. It is valid until Close.
func (h *HostBuffer) Bytes() []byte { return h.data }

// Addr returns the address of the first byte (0 after Close).
func (h *HostBuffer) Addr() uintptr {
	if len(h.data) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&h.data[0]))
}

// Len returns the size in bytes.
func (h *HostBuffer) Len() int { return len(h.data) }

// Memory describes the whole buffer for Transport.RegisterMemory.
func (h *HostBuffer) Memory() Memory {
	return Memory{Addr: h.Addr(), Length: uint64(len(h.data)), Kind: MemoryHost, FD: h.fd}
}

// Close unmaps the memory and closes the memfd. Idempotent.
func (h *HostBuffer) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.data == nil {
		return nil
	}
	err := unix.Munmap(h.data)
	h.data = nil
	if cerr := unix.Close(h.fd); err == nil {
		err = cerr
	}
	h.fd = -1
	if err != nil {
		return fmt.Errorf("engine: free %q: %w", h.name, err)
	}
	return nil
}

// Bytes returns a host range as a byte slice over the memory itself (nil for
// device memory or an empty range). The memory is not Go heap: it must stay
// mapped for as long as the slice is used.
func (m Memory) Bytes() []byte {
	if m.Kind != MemoryHost || m.Addr == 0 || m.Length == 0 {
		return nil
	}
	p := *(*unsafe.Pointer)(unsafe.Pointer(&m.Addr)) // a mapping outside the Go heap (see Memory)
	return unsafe.Slice((*byte)(p), int(m.Length))
}
