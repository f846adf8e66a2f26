//go:build cgo

package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// lib is the process-wide loaded state. mu is held for reading by every call
// into the function table and for writing by Load and Close, so Close never
// unloads a library under a running call.
var lib struct {
	mu      sync.RWMutex
	loaded  bool
	handles [3]unsafe.Pointer
	paths   [3]string
	devices int
	nvrtcTo []string // NVRTC candidates, opened lazily by CompileNVRTC
}

// availMu guards the cached outcome of Available.
var (
	availMu   sync.Mutex
	availDone bool
	availErr  error
)

// Load opens the CUDA runtime and driver libraries and counts devices. It is
// idempotent: once it has succeeded it returns nil until Close.
//
// Outcomes: nil (loaded, at least one device); an error wrapping
// ErrNotSupported and one of ErrLibraryNotFound, ErrSymbolMissing or
// ErrNoDevice, saying which library or symbol and what was tried; or another
// error (typically an *Error from cuInit or cudaGetDeviceCount) when the probe
// itself failed. After a failure nothing stays loaded.
func Load(opts ...Option) error {
	cfg := defaultConfig()
	for _, o := range opts {
		o(&cfg)
	}
	lib.mu.Lock()
	defer lib.mu.Unlock()
	if lib.loaded {
		return nil
	}
	err := loadLocked(cfg)
	if err != nil {
		closeLocked()
	}
	return err
}

func loadLocked(cfg loadConfig) error {
	h, path, err := rawOpen(libDriver, cfg.driver)
	if err != nil {
		return notSupported(ErrLibraryNotFound, "CUDA driver library (tried %v): %v; install the NVIDIA driver or set KVXFER_LIBCUDA", cfg.driver, err)
	}
	lib.handles[libDriver], lib.paths[libDriver] = h, path
	if s := rawMissing(libDriver); s != "" {
		return notSupported(ErrSymbolMissing, "%s lacks %s (driver too old)", path, s)
	}
	h, path, err = rawOpen(libRuntime, cfg.runtime)
	if err != nil {
		return notSupported(ErrLibraryNotFound, "CUDA runtime library (tried %v): %v; install the CUDA 12 or 13 runtime or set KVXFER_CUDART", cfg.runtime, err)
	}
	lib.handles[libRuntime], lib.paths[libRuntime] = h, path
	if s := rawMissing(libRuntime); s != "" {
		return notSupported(ErrSymbolMissing, "%s lacks %s (runtime too old)", path, s)
	}
	if err := rawCuInit(); err != nil {
		if errors.Is(err, ErrNotSupported) {
			return fmt.Errorf("cuda: initialise driver %s: %w", lib.paths[libDriver], err)
		}
		return fmt.Errorf("cuda: probe failed: initialise driver %s: %w", lib.paths[libDriver], err)
	}
	n, err := rawDeviceCount()
	if err != nil {
		if errors.Is(err, ErrNotSupported) {
			return fmt.Errorf("cuda: count devices: %w", err)
		}
		return fmt.Errorf("cuda: probe failed: count devices: %w", err)
	}
	if n == 0 {
		return notSupported(ErrNoDevice, "%s reports 0 devices (check nvidia-smi and CUDA_VISIBLE_DEVICES)", lib.paths[libRuntime])
	}
	lib.devices = n
	lib.nvrtcTo = cfg.nvrtc
	lib.loaded = true
	return nil
}

// Available reports whether CUDA can be used here, loading it with the
// default library names on first use (see Load for the three outcomes). A
// nil or not-supported answer is cached until Close; a failed probe is
// retried on the next call.
func Available() error {
	availMu.Lock()
	defer availMu.Unlock()
	if availDone {
		return availErr
	}
	err := Load()
	if err == nil || errors.Is(err, ErrNotSupported) {
		availDone, availErr = true, err
	}
	return err
}

// Close unloads the libraries (dlclose) and forgets the cached Available
// answer. It is idempotent. Memory, streams and modules created before Close
// must already be released: their handles are meaningless afterwards.
func Close() error {
	lib.mu.Lock()
	closeLocked()
	lib.mu.Unlock()
	availMu.Lock()
	availDone, availErr = false, nil
	availMu.Unlock()
	return nil
}

func closeLocked() {
	for _, which := range []int{libNVRTC, libRuntime, libDriver} {
		rawClose(which, lib.handles[which])
		lib.handles[which], lib.paths[which] = nil, ""
	}
	lib.loaded = false
	lib.devices = 0
}

// Libraries returns the paths Load opened for the runtime, the driver and
// NVRTC ("" for one not loaded).
func Libraries() (runtimePath, driverPath, nvrtcPath string) {
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	return lib.paths[libRuntime], lib.paths[libDriver], lib.paths[libNVRTC]
}

// Versions returns the runtime and driver versions as CUDA encodes them
// (1000*major + 10*minor, e.g. 13000), 0 when unknown.
func Versions() (runtimeVersion, driverVersion int) {
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	return rawVersions()
}

// use takes the read lock and checks that the libraries are loaded and dev
// is a valid ordinal. The caller must call the returned unlock.
func use(op string, dev int) (func(), error) {
	lib.mu.RLock()
	if !lib.loaded {
		lib.mu.RUnlock()
		return nil, fmt.Errorf("cuda: %s: %w", op, ErrNotLoaded)
	}
	if dev < 0 || dev >= lib.devices {
		n := lib.devices
		lib.mu.RUnlock()
		return nil, fmt.Errorf("cuda: %s: device %d out of range [0,%d): %w", op, dev, n, ErrInvalidValue)
	}
	return lib.mu.RUnlock, nil
}

// DeviceCount returns the number of visible CUDA devices (ErrNotLoaded
// before Load).
func DeviceCount() (int, error) {
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	if !lib.loaded {
		return 0, fmt.Errorf("cuda: device count: %w", ErrNotLoaded)
	}
	return lib.devices, nil
}

// Device returns the properties of device dev: name, PCI bus id, total and
// free memory in bytes, compute capability, dma-buf support.
func Device(dev int) (DeviceProps, error) {
	unlock, err := use("device properties", dev)
	if err != nil {
		return DeviceProps{}, err
	}
	defer unlock()
	return rawDeviceProps(dev)
}

// Malloc allocates size bytes (> 0) of device memory on dev. Free it with
// Free. Errors: an *Error matching ErrOutOfMemory when the device is full.
func Malloc(dev int, size uint64) (DevicePtr, error) {
	if size == 0 {
		return 0, fmt.Errorf("cuda: malloc on device %d: size must be > 0 bytes: %w", dev, ErrInvalidValue)
	}
	unlock, err := use("malloc", dev)
	if err != nil {
		return 0, err
	}
	defer unlock()
	p, err := rawMalloc(dev, size)
	if err != nil {
		return 0, fmt.Errorf("cuda: malloc %d bytes on device %d: %w", size, dev, err)
	}
	return p, nil
}

// Free releases device memory from Malloc. Freeing 0 is a no-op.
func Free(dev int, p DevicePtr) error {
	if p == 0 {
		return nil
	}
	unlock, err := use("free", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawFree(dev, p)
}

// Memset sets n bytes of device memory at p to value (synchronous).
func Memset(dev int, p DevicePtr, value byte, n uint64) error {
	unlock, err := use("memset", dev)
	if err != nil {
		return err
	}
	defer unlock()
	if err := rawMemset(dev, p, value, n); err != nil {
		return err
	}
	return rawDeviceSync(dev)
}

// Memcpy copies n bytes from src to dst synchronously, with dev current.
// Both addresses must be outside the Go heap (device memory, pinned or
// mmapped host memory); use CopyToDevice/CopyFromDevice for Go slices.
func Memcpy(dev int, dst, src uintptr, n uint64, kind MemcpyKind) error {
	if n == 0 {
		return nil
	}
	unlock, err := use("memcpy", dev)
	if err != nil {
		return err
	}
	defer unlock()
	if err := rawMemcpy(dev, dst, src, n, kind); err != nil {
		return fmt.Errorf("cuda: copy %d bytes %#x -> %#x on device %d: %w", n, src, dst, dev, err)
	}
	return nil
}

// CopyToDevice copies src (any host memory, Go slices included; used only
// during the call) to device memory dst.
func CopyToDevice(dev int, dst DevicePtr, src []byte) error {
	unlock, err := use("copy to device", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawMemcpyGo(dev, uintptr(dst), src, false)
}

// CopyFromDevice copies len(dst) bytes from device memory src into dst.
func CopyFromDevice(dev int, dst []byte, src DevicePtr) error {
	unlock, err := use("copy from device", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawMemcpyGo(dev, uintptr(src), dst, true)
}

// Stream is a CUDA stream (created non-blocking) on one device. It is safe
// for concurrent use as CUDA streams are; Close destroys it (idempotent).
type Stream struct {
	mu      sync.Mutex
	dev     int
	h       unsafe.Pointer
	cleanup runtime.Cleanup
}

// NewStream creates a stream on dev. Close it when done.
func NewStream(dev int) (*Stream, error) {
	unlock, err := use("create stream", dev)
	if err != nil {
		return nil, err
	}
	defer unlock()
	h, err := rawStreamCreate(dev)
	if err != nil {
		return nil, err
	}
	s := &Stream{dev: dev, h: h}
	s.cleanup = runtime.AddCleanup(s, func(h uintptr) { destroyLeaked(dev, h, false) }, uintptr(h))
	return s, nil
}

// Device returns the stream's device ordinal.
func (s *Stream) Device() int { return s.dev }

// MemcpyAsync enqueues a copy of n bytes from src to dst. Both ranges must
// stay valid and unchanged until Synchronize returns; host memory must be
// pinned (AllocMapped) or the copy degrades to a synchronous one.
func (s *Stream) MemcpyAsync(dst, src uintptr, n uint64, kind MemcpyKind) error {
	s.mu.Lock()
	h := s.h
	s.mu.Unlock()
	if h == nil {
		return fmt.Errorf("cuda: memcpy on closed stream: %w", ErrInvalidValue)
	}
	unlock, err := use("memcpy async", s.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawMemcpyAsync(s.dev, dst, src, n, kind, h)
}

// Synchronize waits for every operation enqueued on the stream.
func (s *Stream) Synchronize() error {
	s.mu.Lock()
	h := s.h
	s.mu.Unlock()
	if h == nil {
		return fmt.Errorf("cuda: synchronize closed stream: %w", ErrInvalidValue)
	}
	unlock, err := use("synchronize stream", s.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawStreamSync(s.dev, h)
}

// Close destroys the stream; idempotent.
func (s *Stream) Close() error {
	s.mu.Lock()
	h := s.h
	s.h = nil
	s.mu.Unlock()
	if h == nil {
		return nil
	}
	s.cleanup.Stop()
	unlock, err := use("destroy stream", s.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawStreamDestroy(s.dev, h)
}

// HostMem is mapped, portable pinned host memory (cudaHostAlloc with
// cudaHostAllocMapped|cudaHostAllocPortable): the same bytes are reachable at
// Host() from the CPU and at DevicePtr() from device code, which is what
// makes the metadata ring GPU-visible. Close frees it (idempotent); a
// cleanup frees a leaked HostMem and logs nothing.
type HostMem struct {
	mu      sync.Mutex
	dev     int
	host    unsafe.Pointer
	dptr    DevicePtr
	size    uint64
	cleanup runtime.Cleanup
}

// AllocMapped allocates size bytes (> 0) of mapped pinned host memory with
// dev current. The memory is not zeroed by CUDA; AllocMapped zeroes it.
func AllocMapped(dev int, size uint64) (*HostMem, error) {
	if size == 0 {
		return nil, fmt.Errorf("cuda: mapped host alloc on device %d: size must be > 0 bytes: %w", dev, ErrInvalidValue)
	}
	unlock, err := use("mapped host alloc", dev)
	if err != nil {
		return nil, err
	}
	defer unlock()
	h, d, err := rawHostAllocMapped(dev, size)
	if err != nil {
		return nil, fmt.Errorf("cuda: mapped host alloc of %d bytes on device %d: %w", size, dev, err)
	}
	clear(unsafe.Slice((*byte)(h), size))
	m := &HostMem{dev: dev, host: h, dptr: d, size: size}
	m.cleanup = runtime.AddCleanup(m, func(h uintptr) { destroyLeaked(dev, h, true) }, uintptr(h))
	return m, nil
}

// Host returns the host address (0 after Close).
func (m *HostMem) Host() uintptr { m.mu.Lock(); defer m.mu.Unlock(); return uintptr(m.host) }

// DevicePtr returns the device-side address of the same bytes (0 after Close).
func (m *HostMem) DevicePtr() DevicePtr { m.mu.Lock(); defer m.mu.Unlock(); return m.dptr }

// Len returns the size in bytes.
func (m *HostMem) Len() uint64 { return m.size }

// Device returns the ordinal that was current at allocation.
func (m *HostMem) Device() int { return m.dev }

// Bytes returns the memory as a slice, valid until Close (nil after).
func (m *HostMem) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.host == nil {
		return nil
	}
	return unsafe.Slice((*byte)(m.host), m.size)
}

// Close frees the memory (cudaFreeHost); idempotent.
func (m *HostMem) Close() error {
	m.mu.Lock()
	h := m.host
	m.host, m.dptr = nil, 0
	m.mu.Unlock()
	if h == nil {
		return nil
	}
	m.cleanup.Stop()
	unlock, err := use("free mapped host memory", m.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawFreeHost(m.dev, h)
}

// RegisterHost page-locks existing host memory b (mmap or memfd memory,
// never Go heap) with cudaHostRegisterMapped|Portable and returns the device
// alias of b[0]. b must stay mapped until UnregisterHost. This is how a
// memfd-backed ring (shareable with the shm transport) becomes GPU-visible.
func RegisterHost(dev int, b []byte) (DevicePtr, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("cuda: register host memory on device %d: empty range: %w", dev, ErrInvalidValue)
	}
	unlock, err := use("register host memory", dev)
	if err != nil {
		return 0, err
	}
	defer unlock()
	d, err := rawHostRegister(dev, unsafe.Pointer(unsafe.SliceData(b)), uint64(len(b)))
	if err != nil {
		return 0, fmt.Errorf("cuda: register %d bytes of host memory at %p on device %d: %w", len(b), unsafe.SliceData(b), dev, err)
	}
	return d, nil
}

// UnregisterHost undoes RegisterHost for the same b.
func UnregisterHost(dev int, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	unlock, err := use("unregister host memory", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawHostUnregister(dev, unsafe.Pointer(unsafe.SliceData(b)))
}

// destroyLeaked is the safety net for a Stream or HostMem that was never
// closed: it frees the handle if the libraries are still loaded (Close of
// the package already invalidated it otherwise) and counts the leak.
func destroyLeaked(dev int, h uintptr, host bool) {
	leaked.Add(1)
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	if !lib.loaded {
		return
	}
	p := *(*unsafe.Pointer)(unsafe.Pointer(&h))
	if host {
		rawFreeHost(dev, p)
	} else {
		rawStreamDestroy(dev, p)
	}
}

// leaked counts Streams and HostMems freed by the garbage collector instead
// of Close (a bug in the caller); tests check it stays 0.
var leaked atomic.Int64

// Leaked returns how many Streams and HostMems were reclaimed by the garbage
// collector without Close since the process started.
func Leaked() int64 { return leaked.Load() }

// PointerAttributes asks CUDA what p is: device, pinned host, managed or
// unregistered memory, and which device owns it.
func PointerAttributes(p uintptr) (PointerInfo, error) {
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	if !lib.loaded {
		return PointerInfo{Device: -1}, fmt.Errorf("cuda: pointer attributes: %w", ErrNotLoaded)
	}
	return rawPointerAttributes(p)
}

// PointerDevice asks the CUDA driver (cuPointerGetAttribute:
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE, then DEVICE_ORDINAL) whether p is
// device memory: ok is true with the owning device's ordinal for device
// memory (cudaMalloc, PyTorch's CUDA tensors), false for host memory,
// pinned or not, managed memory and memory the driver does not know (its
// CUDA_ERROR_INVALID_VALUE). Errors: the libraries are not loaded
// (ErrNotLoaded), a driver without the symbol (ErrSymbolMissing), another
// driver error.
func PointerDevice(p uintptr) (dev int, ok bool, err error) {
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	if !lib.loaded {
		return -1, false, fmt.Errorf("cuda: pointer device: %w", ErrNotLoaded)
	}
	return rawPointerDevice(p)
}

// IPCGetHandle exports device memory p (from Malloc on dev) for another
// process on the same host.
func IPCGetHandle(dev int, p DevicePtr) (IPCHandle, error) {
	unlock, err := use("ipc get handle", dev)
	if err != nil {
		return IPCHandle{}, err
	}
	defer unlock()
	return rawIPCGet(dev, p)
}

// IPCOpenHandle maps another process's exported memory into this process on
// dev. Close the mapping with IPCCloseHandle.
func IPCOpenHandle(dev int, h IPCHandle) (DevicePtr, error) {
	unlock, err := use("ipc open handle", dev)
	if err != nil {
		return 0, err
	}
	defer unlock()
	return rawIPCOpen(dev, h)
}

// IPCCloseHandle unmaps memory opened with IPCOpenHandle.
func IPCCloseHandle(dev int, p DevicePtr) error {
	unlock, err := use("ipc close handle", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawIPCClose(dev, p)
}

// DmaBufFD exports the device range [ptr, ptr+size) as a dma-buf file
// descriptor (cuMemGetHandleForAddressRange with
// CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) for ibv_reg_dmabuf_mr. ptr and size
// must be aligned to the host page size. The caller owns fd and closes it
// after registering. Errors wrap ErrNotSupported when the driver, kernel or
// device cannot export dma-bufs (then fall back to peer-memory registration).
func DmaBufFD(ptr uintptr, size uint64) (fd int, err error) {
	info, err := PointerAttributes(ptr)
	if err != nil {
		return -1, fmt.Errorf("cuda: dma-buf for %#x: %w", ptr, err)
	}
	if !info.IsDevice() {
		return -1, fmt.Errorf("cuda: dma-buf for %#x: pointer is %s memory, not device memory: %w", ptr, info.Type, ErrInvalidValue)
	}
	pg := uint64(os.Getpagesize())
	if uint64(ptr)%pg != 0 || size == 0 || size%pg != 0 {
		return -1, fmt.Errorf("cuda: dma-buf for %#x+%d: address and size must be multiples of the %d-byte page size: %w", ptr, size, pg, ErrInvalidValue)
	}
	unlock, err := use("dma-buf export", info.Device)
	if err != nil {
		return -1, err
	}
	defer unlock()
	fd, err = rawDmaBufFD(info.Device, DevicePtr(ptr), size)
	if err != nil {
		return -1, fmt.Errorf("cuda: dma-buf for %#x+%d on device %d: %w", ptr, size, info.Device, err)
	}
	return fd, nil
}

// DmaBufRange is DmaBufFD for any device range: it exports the enclosing
// page-aligned range [floor(ptr), ceil(ptr+size)) and returns the fd and the
// offset of ptr inside it (pass offset to ibv_reg_dmabuf_mr). The caller
// closes fd.
func DmaBufRange(ptr uintptr, size uint64) (fd int, offset uint64, err error) {
	if size == 0 {
		return -1, 0, fmt.Errorf("cuda: dma-buf for %#x: size must be > 0 bytes: %w", ptr, ErrInvalidValue)
	}
	pg := uint64(os.Getpagesize())
	start := uint64(ptr) &^ (pg - 1)
	end := (uint64(ptr) + size + pg - 1) &^ (pg - 1)
	fd, err = DmaBufFD(uintptr(start), end-start)
	return fd, uint64(ptr) - start, err
}

// Synchronize waits for all work on dev.
func Synchronize(dev int) error {
	unlock, err := use("synchronize device", dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawDeviceSync(dev)
}

// CompileNVRTC compiles the CUDA C source (name: its file name in the
// compiler's messages, e.g. "kernel.cu") to PTX for dev's compute
// capability with NVRTC, which it opens on first use (the path from
// WithNVRTCPath, else the usual names). Errors: ErrLibraryNotFound (wrapped
// with ErrNotSupported) when NVRTC is not installed; a compile error
// carries the compiler's log.
func CompileNVRTC(dev int, source, name string) (string, error) {
	props, err := Device(dev)
	if err != nil {
		return "", err
	}
	lib.mu.Lock()
	if !lib.loaded {
		lib.mu.Unlock()
		return "", fmt.Errorf("cuda: nvrtc: %w", ErrNotLoaded)
	}
	if lib.handles[libNVRTC] == nil {
		h, path, err := rawOpen(libNVRTC, lib.nvrtcTo)
		if err != nil {
			lib.mu.Unlock()
			return "", notSupported(ErrLibraryNotFound, "NVRTC (tried %v): %v; install cuda-nvrtc or set KVXFER_NVRTC", lib.nvrtcTo, err)
		}
		lib.handles[libNVRTC], lib.paths[libNVRTC] = h, path
	}
	lib.mu.Unlock()
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	arch := fmt.Sprintf("--gpu-arch=compute_%d%d", props.ComputeMajor, props.ComputeMinor)
	ptx, err := rawNVRTCCompile(source, name, arch)
	if err != nil {
		return "", fmt.Errorf("cuda: nvrtc compile of %s (%s): %w", name, arch, err)
	}
	return ptx, nil
}

// Module is a CUDA module loaded on one device (cuModuleLoadData). Close it
// when done; its methods are safe for concurrent use.
type Module struct {
	dev int
	mu  sync.Mutex
	h   unsafe.Pointer // nil after Close
}

// LoadModule loads image (PTX text, which the driver JIT-compiles, or a
// cubin) on dev. Errors name the driver call (cuModuleLoadData).
func LoadModule(dev int, image string) (*Module, error) {
	unlock, err := use("load module", dev)
	if err != nil {
		return nil, err
	}
	defer unlock()
	h, err := rawModuleLoad(dev, image)
	if err != nil {
		return nil, err
	}
	return &Module{dev: dev, h: h}, nil
}

// Launch3 runs the module's kernel name (its unmangled entry) as one block
// of one thread with three 64-bit parameters (device pointers or values),
// and waits for it to finish. Errors: ErrInvalidValue after Close, a
// missing kernel (cuModuleGetFunction) or a failed launch.
func (m *Module) Launch3(name string, a0, a1, a2 uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.h == nil {
		return fmt.Errorf("cuda: launch %s: module closed: %w", name, ErrInvalidValue)
	}
	unlock, err := use("launch kernel", m.dev)
	if err != nil {
		return err
	}
	defer unlock()
	fn, err := rawModuleFunction(m.h, name)
	if err != nil {
		return err
	}
	return rawLaunch3(m.dev, fn, a0, a1, a2)
}

// Close unloads the module (cuModuleUnload); idempotent.
func (m *Module) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.h == nil {
		return nil
	}
	unlock, err := use("unload module", m.dev)
	if err != nil {
		m.h = nil // the libraries are gone, and the module with them
		return err
	}
	defer unlock()
	h := m.h
	m.h = nil
	return rawModuleUnload(m.dev, h)
}
