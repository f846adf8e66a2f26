// Package cuda is kvxfer's binding of the CUDA runtime (libcudart), the CUDA
// driver (libcuda) and NVRTC, loaded at run time with dlopen so that the
// module builds with no CUDA toolkit and runs on hosts with no GPU.
//
// # Loading
//
// Load opens libcudart.so.13, .12 or the unversioned name (and libcuda.so.1)
// into a C function table; every call goes through a small C helper that
// returns a sentinel code when its symbol is missing, so an old or partial
// library yields an *Error wrapping ErrSymbolMissing, never a crash. Load and
// Available have three outcomes:
//
//   - nil: the libraries are loaded and at least one device is visible;
//   - an error wrapping ErrNotSupported, with the reason also matched by
//     ErrLibraryNotFound, ErrSymbolMissing or ErrNoDevice;
//   - any other error: the probe itself failed (driver error), and the result
//     is not cached.
//
// Without cgo (CGO_ENABLED=0) every function returns ErrNoCgo.
//
// # Threads and devices
//
// CUDA keeps the current device per OS thread, and goroutines move between
// threads. Every function here therefore takes the device ordinal and makes
// it current inside the same C call that uses it; callers never need
// runtime.LockOSThread.
//
// # Lifetimes
//
// Device memory (Malloc), mapped pinned host memory (AllocMapped), streams,
// events (NewEvent), stream gates (Stream.Gate) and IPC mappings are owned by
// the caller and released by their Free/Close calls, which are idempotent
// where they are methods. An EventHandle is a caller's own event (a
// cudaEvent_t, e.g. PyTorch's): the package queries it and never destroys
// it. Close unloads the
// libraries; call it only when no other goroutine uses the package. Memory a
// GPU or NIC keeps is never Go heap: Go slices passed to the synchronous
// copies are used only for the length of the call.
//
// GPU topology (PCI bus ids, NUMA nodes through NVML) lives in the subpackage
// cuda/gputopo so that programs that only need device memory do not link
// go-nvml.
package cuda
