package tcp

import (
	"fmt"
	"sync"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// deviceCopier is the seam for CUDA device memory (Memory.Kind ==
// transport.MemoryCUDA). TCP cannot send from or receive into device memory
// directly, so a copier stages each frame through a host bounce buffer:
//
//   - RegisterMemory calls check(m) once per device region; an error (wrapping
//     transport.ErrUnsupportedMemory when there is no CUDA) refuses the region.
//   - the sender calls copyFromDevice(dst, src, dev) for each block of a frame
//     whose local memory is device memory, then writes dst (host) to the socket;
//   - the receiver reads a block into a host bounce buffer and calls
//     copyToDevice(dst, dev, src) to land it in the device region, acking only
//     after the copy returned (the bytes are then in device memory).
//
// dst and src host slices are bounce buffers owned by this package (at most
// bounceSize bytes each); device addresses are absolute device pointers. The
// copies must be synchronous. Implementations must be safe for concurrent use
// (every stream copies in its own goroutine).
//
// On a host with the NVIDIA driver (/proc/driver/nvidia/version), or when
// KVXFER_LIBCUDA or KVXFER_CUDART names the CUDA libraries at start-up, the
// copier is cudaCopier: CUDA is loaded on the first device registration and
// each copy moves through a pinned (cudaHostAlloc mapped) staging buffer.
// Elsewhere it is noDevice: every device region is refused with
// ErrUnsupportedMemory and CapDeviceMemory is not advertised.
type deviceCopierIface interface {
	check(m transport.Memory) error
	copyFromDevice(dst []byte, src uintptr, device int) error
	copyToDevice(dst uintptr, device int, src []byte) error
}

// deviceCopier is the active copier; tests swap it for a host-memory fake.
var deviceCopier deviceCopierIface = defaultCopier()

// bounceSize is the largest block staged through a bounce buffer at once, bytes.
const bounceSize = 4 << 20

func defaultCopier() deviceCopierIface {
	if cuda.MayBePresent() {
		return &cudaCopier{}
	}
	return noDevice{}
}

type noDevice struct{}

func (noDevice) check(m transport.Memory) error {
	return fmt.Errorf("tcp: register %d bytes of cuda:%d memory at %#x: %w (no CUDA bounce copier in this build; use host or pinned memory)",
		m.Length, m.Device, m.Addr, transport.ErrUnsupportedMemory)
}

func (noDevice) copyFromDevice([]byte, uintptr, int) error {
	return fmt.Errorf("tcp: copy from device: %w", transport.ErrUnsupportedMemory)
}

func (noDevice) copyToDevice(uintptr, int, []byte) error {
	return fmt.Errorf("tcp: copy to device: %w", transport.ErrUnsupportedMemory)
}

// cudaCopier stages device<->host copies through pinned host buffers of
// bounceSize bytes, kept per device in a free list (at most maxPinned per
// device; more concurrent copies fall back to a pageable cudaMemcpy straight
// into the caller's bounce slice). Pinned buffers live until the process
// exits: they are few and reused by every stream.
type cudaCopier struct {
	mu   sync.Mutex
	free map[int][]*cuda.HostMem
	made map[int]int
}

// maxPinned bounds the pinned staging buffers per device (bytes: maxPinned *
// bounceSize).
const maxPinned = 16

func (c *cudaCopier) check(m transport.Memory) error {
	if err := cuda.Available(); err != nil {
		return fmt.Errorf("tcp: register %d bytes of cuda:%d memory at %#x: %w: %w", m.Length, m.Device, m.Addr, transport.ErrUnsupportedMemory, err)
	}
	for _, p := range []uintptr{m.Addr, m.Addr + uintptr(m.Length) - 1} {
		info, err := cuda.PointerAttributes(p)
		if err != nil {
			return fmt.Errorf("tcp: register cuda:%d memory at %#x (%d bytes): %w", m.Device, m.Addr, m.Length, err)
		}
		if !info.IsDevice() || info.Device != m.Device {
			return fmt.Errorf("tcp: register cuda:%d memory at %#x (%d bytes): address %#x is %s memory of device %d, not device memory of cuda:%d",
				m.Device, m.Addr, m.Length, p, info.Type, info.Device, m.Device)
		}
	}
	return nil
}

// get returns a pinned staging buffer for device, or nil when the per-device
// bound is reached or pinned memory cannot be had (the caller then copies
// through pageable memory).
func (c *cudaCopier) get(device int) *cuda.HostMem {
	c.mu.Lock()
	if c.free == nil {
		c.free, c.made = map[int][]*cuda.HostMem{}, map[int]int{}
	}
	if l := c.free[device]; len(l) > 0 {
		b := l[len(l)-1]
		c.free[device] = l[:len(l)-1]
		c.mu.Unlock()
		return b
	}
	if c.made[device] >= maxPinned {
		c.mu.Unlock()
		return nil
	}
	c.made[device]++
	c.mu.Unlock()
	b, err := cuda.AllocMapped(device, bounceSize)
	if err != nil {
		c.mu.Lock()
		c.made[device]--
		c.mu.Unlock()
		return nil
	}
	return b
}

func (c *cudaCopier) put(device int, b *cuda.HostMem) {
	c.mu.Lock()
	c.free[device] = append(c.free[device], b)
	c.mu.Unlock()
}

func (c *cudaCopier) copyFromDevice(dst []byte, src uintptr, device int) error {
	for len(dst) > 0 {
		n := min(len(dst), bounceSize)
		b := c.get(device)
		if b == nil {
			if err := cuda.CopyFromDevice(device, dst[:n], cuda.DevicePtr(src)); err != nil {
				return err
			}
		} else {
			err := cuda.Memcpy(device, b.Host(), src, uint64(n), cuda.DeviceToHost)
			if err == nil {
				copy(dst[:n], b.Bytes()[:n])
			}
			c.put(device, b)
			if err != nil {
				return err
			}
		}
		dst, src = dst[n:], src+uintptr(n)
	}
	return nil
}

func (c *cudaCopier) copyToDevice(dst uintptr, device int, src []byte) error {
	for len(src) > 0 {
		n := min(len(src), bounceSize)
		b := c.get(device)
		if b == nil {
			if err := cuda.CopyToDevice(device, cuda.DevicePtr(dst), src[:n]); err != nil {
				return err
			}
		} else {
			copy(b.Bytes()[:n], src[:n])
			err := cuda.Memcpy(device, uintptr(dst), b.Host(), uint64(n), cuda.HostToDevice)
			c.put(device, b)
			if err != nil {
				return err
			}
		}
		dst, src = dst+uintptr(n), src[n:]
	}
	return nil
}
