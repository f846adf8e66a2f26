package tcp

import (
	"fmt"

	"github.com/kvxfer/kvxfer/engine"
)

// deviceCopier is the seam for CUDA device memory (Memory.Kind ==
// engine.MemoryCUDA). TCP cannot send from or receive into device memory
// directly, so a copier stages each frame through a host bounce buffer:
//
//   - RegisterMemory calls check(m) once per device region; an error (wrapping
//     engine.ErrUnsupportedMemory when there is no CUDA) refuses the region.
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
// Today the copier is noDevice: every device region is refused with
// ErrUnsupportedMemory. The CUDA package fills it (pinned bounce buffers,
// cuMemcpyDtoH/HtoD on a stream) by assigning deviceCopier from an init in a
// file of this package built with its tag, or through a setter added then.
type deviceCopierIface interface {
	check(m engine.Memory) error
	copyFromDevice(dst []byte, src uintptr, device int) error
	copyToDevice(dst uintptr, device int, src []byte) error
}

// deviceCopier is the active copier; tests swap it for a host-memory fake.
var deviceCopier deviceCopierIface = noDevice{}

// bounceSize is the largest block staged through a bounce buffer at once, bytes.
const bounceSize = 4 << 20

type noDevice struct{}

func (noDevice) check(m engine.Memory) error {
	return fmt.Errorf("tcp: register %d bytes of cuda:%d memory at %#x: %w (no CUDA bounce copier in this build; use host or pinned memory)",
		m.Length, m.Device, m.Addr, engine.ErrUnsupportedMemory)
}

func (noDevice) copyFromDevice([]byte, uintptr, int) error {
	return fmt.Errorf("tcp: copy from device: %w", engine.ErrUnsupportedMemory)
}

func (noDevice) copyToDevice(uintptr, int, []byte) error {
	return fmt.Errorf("tcp: copy to device: %w", engine.ErrUnsupportedMemory)
}
