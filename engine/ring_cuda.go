package engine

import (
	"errors"
	"fmt"
	"sync"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// cudaRing is ring memory a GPU can read: a memfd-backed HostBuffer (so the
// shm transport can still share it by fd) page-locked and mapped into the
// device's address space with cudaHostRegister(Mapped|Portable).
type cudaRing struct {
	*transport.HostBuffer
	mu   sync.Mutex
	dev  int
	dptr cuda.DevicePtr
}

// DevicePtr returns the ring's device alias (0 after Close).
func (r *cudaRing) DevicePtr() uintptr {
	r.mu.Lock()
	defer r.mu.Unlock()
	return uintptr(r.dptr)
}

// Close unregisters the memory from CUDA, then unmaps it; idempotent.
func (r *cudaRing) Close() error {
	r.mu.Lock()
	d := r.dptr
	r.dptr = 0
	r.mu.Unlock()
	var uerr error
	if d != 0 {
		uerr = cuda.UnregisterHost(r.dev, r.Bytes())
	}
	if err := r.HostBuffer.Close(); err != nil {
		return err
	}
	if uerr != nil {
		return fmt.Errorf("engine: metadata ring: unregister from cuda:%d: %w", r.dev, uerr)
	}
	return nil
}

// CUDARingMemory returns a RingAllocator that places the metadata ring where
// a kernel on CUDA device dev can read it: AllocHost memory registered with
// cudaHostRegister (mapped, portable), so RingMemory.DevicePtr is the
// device alias of the ring's first byte and the same bytes stay shareable
// by fd. When CUDA is not supported on this host (no library, no device, no
// cgo) it returns plain AllocHost memory with DevicePtr 0, so callers keep
// one code path. A CUDA probe failure or a failed registration is an error
// that names the device.
func CUDARingMemory(dev int) RingAllocator {
	return func(size int) (RingMemory, error) {
		if err := cuda.Available(); err != nil {
			if errors.Is(err, cuda.ErrNotSupported) {
				return HostRingMemory(size)
			}
			return nil, fmt.Errorf("engine: metadata ring on cuda:%d: %w", dev, err)
		}
		b, err := transport.AllocHost("meta-ring", int64(size))
		if err != nil {
			return nil, err
		}
		d, err := cuda.RegisterHost(dev, b.Bytes())
		if err == nil {
			return &cudaRing{HostBuffer: b, dev: dev, dptr: d}, nil
		}
		b.Close()
		// Some drivers refuse to pin shared (memfd) mappings: fall back to
		// cudaHostAlloc'ed mapped memory, GPU-visible but with no fd (the
		// shm transport then cannot share the ring; tcp and rdma can).
		m, merr := cuda.AllocMapped(dev, uint64(size))
		if merr != nil {
			return nil, fmt.Errorf("engine: metadata ring: make %d bytes GPU-visible on cuda:%d: %w (cudaHostAlloc fallback: %w)", size, dev, err, merr)
		}
		return mappedRing{m}, nil
	}
}

// mappedRing is ring memory from cudaHostAlloc (mapped, portable): the
// fallback when registering memfd memory fails. It has no fd.
type mappedRing struct{ m *cuda.HostMem }

func (r mappedRing) Bytes() []byte      { return r.m.Bytes() }
func (r mappedRing) DevicePtr() uintptr { return uintptr(r.m.DevicePtr()) }
func (r mappedRing) Close() error       { return r.m.Close() }
func (r mappedRing) Memory() transport.Memory {
	return transport.Memory{Addr: r.m.Host(), Length: r.m.Len(), Kind: transport.MemoryHost, FD: -1}
}

// AutoRingMemory is the RingAllocator to use by default: GPU-visible memory
// on CUDA device 0 when CUDA is present, plain host memory otherwise; it is
// CUDARingMemory(0). A caller whose GPU is another device uses
// CUDARingMemory(dev) (the C ABI reads KVXFER_RING_DEVICE for it).
func AutoRingMemory(size int) (RingMemory, error) { return CUDARingMemory(0)(size) }
