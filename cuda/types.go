package cuda

import "os"

// DevicePtr is an address in a CUDA device's (unified) address space.
type DevicePtr uintptr

// MemcpyKind is the direction of a copy (cudaMemcpyKind values).
type MemcpyKind int

const (
	// HostToHost copies between two host buffers.
	HostToHost MemcpyKind = 0
	// HostToDevice copies host memory to device memory.
	HostToDevice MemcpyKind = 1
	// DeviceToHost copies device memory to host memory.
	DeviceToHost MemcpyKind = 2
	// DeviceToDevice copies within or between devices.
	DeviceToDevice MemcpyKind = 3
	// Default lets CUDA infer the direction from the pointers (UVA).
	Default MemcpyKind = 4
)

// DeviceProps describes one CUDA device.
type DeviceProps struct {
	// Ordinal is the CUDA device index (after CUDA_VISIBLE_DEVICES).
	Ordinal int `json:"ordinal"`
	// Name is the marketing name, e.g. "NVIDIA H200".
	Name string `json:"name"`
	// PCIBusID is the PCI address in CUDA's form, e.g. "0000:18:00.0".
	PCIBusID string `json:"pci_bus_id"`
	// TotalMemory is the device memory size in bytes.
	TotalMemory uint64 `json:"total_memory_bytes"`
	// FreeMemory is the free device memory in bytes at the time of the call.
	FreeMemory uint64 `json:"free_memory_bytes"`
	// ComputeMajor and ComputeMinor are the compute capability (9.0 for H200).
	ComputeMajor int `json:"compute_major"`
	ComputeMinor int `json:"compute_minor"`
	// DmaBuf reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (false when the
	// driver does not say).
	DmaBuf bool `json:"dma_buf"`
}

// MemoryType is what CUDA knows about a pointer (cudaMemoryType values).
type MemoryType int

//go:generate go run golang.org/x/tools/cmd/stringer@v0.51.0 -type MemoryType -linecomment -output memorytype_string.go

const (
	// MemoryUnregistered is memory CUDA does not know (plain malloc/mmap).
	MemoryUnregistered MemoryType = 0 // unregistered
	// MemoryHost is pinned host memory (cudaHostAlloc/cudaHostRegister).
	MemoryHost MemoryType = 1 // host
	// MemoryDevice is device memory (cudaMalloc).
	MemoryDevice MemoryType = 2 // device
	// MemoryManaged is managed (unified) memory.
	MemoryManaged MemoryType = 3 // managed
)

// PointerInfo is the answer of PointerAttributes.
type PointerInfo struct {
	// Type says where the memory lives.
	Type MemoryType
	// Device is the owning device ordinal (-1 for unregistered memory).
	Device int
	// DevicePointer is the address usable in device code (0 if none).
	DevicePointer uintptr
	// HostPointer is the address usable on the host (0 if none).
	HostPointer uintptr
}

// IsDevice reports whether the pointer is device (or managed) memory.
func (p PointerInfo) IsDevice() bool { return p.Type == MemoryDevice || p.Type == MemoryManaged }

// IPCHandle is a cudaIpcMemHandle_t: 64 opaque bytes another process on the
// same host opens with OpenIPCHandle.
type IPCHandle [64]byte

// Option configures Load.
type Option func(*loadConfig)

type loadConfig struct {
	runtime []string
	driver  []string
	nvrtc   []string
}

// WithLibraryPath makes Load open the CUDA runtime from path (a file name
// for the dynamic loader's search, or an absolute path) instead of the
// default candidates.
func WithLibraryPath(path string) Option {
	return func(c *loadConfig) { c.runtime = []string{path} }
}

// WithDriverPath makes Load open the CUDA driver library from path instead
// of libcuda.so.1.
func WithDriverPath(path string) Option {
	return func(c *loadConfig) { c.driver = []string{path} }
}

// WithNVRTCPath makes the GPU proof open NVRTC from path instead of
// libnvrtc.so.13/.12.
func WithNVRTCPath(path string) Option {
	return func(c *loadConfig) { c.nvrtc = []string{path} }
}

// MayBePresent reports, without loading anything, whether CUDA can be here:
// the NVIDIA driver is loaded (/proc/driver/nvidia/version) or the
// environment names a CUDA library (KVXFER_LIBCUDA, KVXFER_CUDART). Callers
// that only need to choose a code path (the tcp transport's device
// copier) use it instead of reading the environment themselves; Available
// is the real check.
func MayBePresent() bool {
	if _, err := os.Stat("/proc/driver/nvidia/version"); err == nil {
		return true
	}
	return os.Getenv("KVXFER_LIBCUDA") != "" || os.Getenv("KVXFER_CUDART") != ""
}

// defaultConfig lists the candidates tried in order: the environment
// overrides KVXFER_CUDART, KVXFER_LIBCUDA and KVXFER_NVRTC (absolute paths),
// then the sonames, then the same sonames under $CUDA_HOME/lib64 and
// /usr/local/cuda/lib64 (toolkits that are not in the loader's cache).
func defaultConfig() loadConfig {
	dirs := []string{}
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if v := os.Getenv(env); v != "" {
			dirs = append(dirs, v+"/lib64")
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64")
	expand := func(env string, names ...string) []string {
		var out []string
		if v := os.Getenv(env); v != "" {
			out = append(out, v)
		}
		out = append(out, names...)
		for _, d := range dirs {
			for _, n := range names {
				out = append(out, d+"/"+n)
			}
		}
		return out
	}
	return loadConfig{
		runtime: expand("KVXFER_CUDART", "libcudart.so.13", "libcudart.so.12", "libcudart.so"),
		driver:  expand("KVXFER_LIBCUDA", "libcuda.so.1", "libcuda.so"),
		nvrtc:   expand("KVXFER_NVRTC", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"),
	}
}

// EventHandle is an event the caller owns (a cudaEvent_t, which is the
// driver's CUevent; PyTorch's torch.cuda.Event.cuda_event is one) on device
// Device. It is a comparable value: two handles of the same event are equal.
// The package never destroys it; it must stay valid while anything queries
// it.
type EventHandle struct {
	// Device is the ordinal of the device the event belongs to (made
	// current for the query).
	Device int
	// Event is the cudaEvent_t handle (non-zero).
	Event uintptr
}
