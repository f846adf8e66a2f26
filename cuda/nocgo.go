//go:build !cgo

package cuda

import "fmt"

// This file keeps the package's API when cgo is off: every call returns an
// error wrapping ErrNoCgo (and ErrNotSupported, so callers that degrade on
// "not supported" degrade here too).

var errNoCgo = fmt.Errorf("%w: %w", ErrNotSupported, ErrNoCgo)

// Load returns ErrNoCgo: CUDA cannot be loaded without cgo.
func Load(opts ...Option) error { return errNoCgo }

// Available returns ErrNoCgo.
func Available() error { return errNoCgo }

// Close does nothing.
func Close() error { return nil }

// Libraries returns empty paths.
func Libraries() (runtimePath, driverPath, nvrtcPath string) { return "", "", "" }

// Versions returns zeros.
func Versions() (runtimeVersion, driverVersion int) { return 0, 0 }

// DeviceCount returns ErrNoCgo.
func DeviceCount() (int, error) { return 0, errNoCgo }

// Device returns ErrNoCgo.
func Device(dev int) (DeviceProps, error) { return DeviceProps{}, errNoCgo }

// Malloc returns ErrNoCgo.
func Malloc(dev int, size uint64) (DevicePtr, error) { return 0, errNoCgo }

// Free returns ErrNoCgo.
func Free(dev int, p DevicePtr) error { return errNoCgo }

// Memset returns ErrNoCgo.
func Memset(dev int, p DevicePtr, value byte, n uint64) error { return errNoCgo }

// Memcpy returns ErrNoCgo.
func Memcpy(dev int, dst, src uintptr, n uint64, kind MemcpyKind) error { return errNoCgo }

// CopyToDevice returns ErrNoCgo.
func CopyToDevice(dev int, dst DevicePtr, src []byte) error { return errNoCgo }

// CopyFromDevice returns ErrNoCgo.
func CopyFromDevice(dev int, dst []byte, src DevicePtr) error { return errNoCgo }

// Stream is a CUDA stream; without cgo none can be created.
type Stream struct{}

// NewStream returns ErrNoCgo.
func NewStream(dev int) (*Stream, error) { return nil, errNoCgo }

// Device returns -1.
func (s *Stream) Device() int { return -1 }

// MemcpyAsync returns ErrNoCgo.
func (s *Stream) MemcpyAsync(dst, src uintptr, n uint64, kind MemcpyKind) error { return errNoCgo }

// Synchronize returns ErrNoCgo.
func (s *Stream) Synchronize() error { return errNoCgo }

// Close does nothing.
func (s *Stream) Close() error { return nil }

// HostMem is mapped pinned host memory; without cgo none can be allocated.
type HostMem struct{}

// AllocMapped returns ErrNoCgo.
func AllocMapped(dev int, size uint64) (*HostMem, error) { return nil, errNoCgo }

// Host returns 0.
func (m *HostMem) Host() uintptr { return 0 }

// DevicePtr returns 0.
func (m *HostMem) DevicePtr() DevicePtr { return 0 }

// Len returns 0.
func (m *HostMem) Len() uint64 { return 0 }

// Device returns -1.
func (m *HostMem) Device() int { return -1 }

// Bytes returns nil.
func (m *HostMem) Bytes() []byte { return nil }

// Close does nothing.
func (m *HostMem) Close() error { return nil }

// RegisterHost returns ErrNoCgo.
func RegisterHost(dev int, b []byte) (DevicePtr, error) { return 0, errNoCgo }

// UnregisterHost returns ErrNoCgo.
func UnregisterHost(dev int, b []byte) error { return errNoCgo }

// PointerDevice returns ErrNoCgo.
func PointerDevice(p uintptr) (int, bool, error) { return -1, false, errNoCgo }

// PointerAttributes returns ErrNoCgo.
func PointerAttributes(p uintptr) (PointerInfo, error) { return PointerInfo{Device: -1}, errNoCgo }

// IPCGetHandle returns ErrNoCgo.
func IPCGetHandle(dev int, p DevicePtr) (IPCHandle, error) { return IPCHandle{}, errNoCgo }

// IPCOpenHandle returns ErrNoCgo.
func IPCOpenHandle(dev int, h IPCHandle) (DevicePtr, error) { return 0, errNoCgo }

// IPCCloseHandle returns ErrNoCgo.
func IPCCloseHandle(dev int, p DevicePtr) error { return errNoCgo }

// DmaBufFD returns ErrNoCgo.
func DmaBufFD(ptr uintptr, size uint64) (fd int, err error) { return -1, errNoCgo }

// DmaBufRange returns ErrNoCgo.
func DmaBufRange(ptr uintptr, size uint64) (fd int, offset uint64, err error) { return -1, 0, errNoCgo }

// Synchronize returns ErrNoCgo.
func Synchronize(dev int) error { return errNoCgo }

// CompileNVRTC returns ErrNoCgo.
func CompileNVRTC(dev int, source, name string) (string, error) { return "", errNoCgo }

// Module is a loaded CUDA module; without cgo none can be loaded.
type Module struct{}

// LoadModule returns ErrNoCgo.
func LoadModule(dev int, image string) (*Module, error) { return nil, errNoCgo }

// Launch3 returns ErrNoCgo.
func (m *Module) Launch3(name string, a0, a1, a2 uint64) error { return errNoCgo }

// Close returns nil.
func (m *Module) Close() error { return nil }

// Leaked returns 0.
func Leaked() int64 { return 0 }

// Event is a CUDA event; without cgo none can be created.
type Event struct{}

// NewEvent returns ErrNoCgo.
func NewEvent(dev int) (*Event, error) { return nil, errNoCgo }

// Handle returns a zero handle.
func (e *Event) Handle() EventHandle { return EventHandle{} }

// Device returns -1.
func (e *Event) Device() int { return -1 }

// Query returns ErrNoCgo.
func (e *Event) Query() (bool, error) { return false, errNoCgo }

// Synchronize returns ErrNoCgo.
func (e *Event) Synchronize() error { return errNoCgo }

// Close does nothing.
func (e *Event) Close() error { return nil }

// Query returns ErrNoCgo.
func (h EventHandle) Query() (bool, error) { return false, errNoCgo }

// Record returns ErrNoCgo.
func (s *Stream) Record(e *Event) error { return errNoCgo }

// Gate holds a stream; without cgo none can be made.
type Gate struct{}

// Gate returns ErrNoCgo.
func (s *Stream) Gate() (*Gate, error) { return nil, errNoCgo }

// Open does nothing.
func (g *Gate) Open() {}

// Close does nothing.
func (g *Gate) Close() error { return nil }
