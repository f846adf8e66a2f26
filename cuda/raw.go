//go:build cgo

package cuda

// This file is the raw layer: the C function table filled by dlsym, the
// static inline helpers that call through it (returning KVX_ENOSYM when a
// pointer is NULL), and one lowercase Go function per helper. The prototypes
// are written here from the CUDA API reference; no toolkit header is needed.

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <stddef.h>
#include <time.h>

#define KVX_ENOSYM (-1)

typedef unsigned long long kvx_devptr; // CUdeviceptr on 64-bit hosts
typedef struct { unsigned char reserved[64]; } kvx_ipc_handle; // cudaIpcMemHandle_t
typedef struct {                      // struct cudaPointerAttributes (CUDA >= 11)
	int type;                         // enum cudaMemoryType
	int device;
	void *devicePointer;
	void *hostPointer;
} kvx_ptr_attr;

struct kvx_table {
	// runtime (libcudart)
	int (*cudaGetDeviceCount)(int *);
	int (*cudaSetDevice)(int);
	int (*cudaFree0)(void *); // cudaFree, also used as cudaFree(0) to initialise
	int (*cudaMalloc)(void **, size_t);
	int (*cudaMemset)(void *, int, size_t);
	int (*cudaMemcpy)(void *, const void *, size_t, int);
	int (*cudaMemcpyAsync)(void *, const void *, size_t, int, void *);
	int (*cudaStreamCreateWithFlags)(void **, unsigned);
	int (*cudaStreamSynchronize)(void *);
	int (*cudaStreamDestroy)(void *);
	int (*cudaDeviceSynchronize)(void);
	int (*cudaHostAlloc)(void **, size_t, unsigned);
	int (*cudaFreeHost)(void *);
	int (*cudaHostGetDevicePointer)(void **, void *, unsigned);
	int (*cudaHostRegister)(void *, size_t, unsigned);
	int (*cudaHostUnregister)(void *);
	int (*cudaPointerGetAttributes)(kvx_ptr_attr *, const void *);
	int (*cudaIpcGetMemHandle)(kvx_ipc_handle *, void *);
	int (*cudaIpcOpenMemHandle)(void **, kvx_ipc_handle, unsigned);
	int (*cudaIpcCloseMemHandle)(void *);
	int (*cudaDeviceGetPCIBusId)(char *, int, int);
	int (*cudaMemGetInfo)(size_t *, size_t *);
	int (*cudaRuntimeGetVersion)(int *);
	const char *(*cudaGetErrorString)(int);
	int (*cudaEventCreateWithFlags)(void **, unsigned);
	int (*cudaEventRecord)(void *, void *);
	int (*cudaEventQuery)(void *);
	int (*cudaEventSynchronize)(void *);
	int (*cudaEventDestroy)(void *);
	int (*cudaLaunchHostFunc)(void *, void (*)(void *), void *);
	// driver (libcuda)
	int (*cuInit)(unsigned);
	int (*cuDriverGetVersion)(int *);
	int (*cuDeviceGetName)(char *, int, int);
	int (*cuDeviceTotalMem_v2)(size_t *, int);
	int (*cuDeviceGetAttribute)(int *, int, int);
	int (*cuGetErrorString)(int, const char **);
	int (*cuCtxGetCurrent)(void **);
	int (*cuCtxSynchronize)(void);
	int (*cuMemGetHandleForAddressRange)(void *, kvx_devptr, size_t, int, unsigned long long);
	int (*cuModuleLoadData)(void **, const void *);
	int (*cuModuleGetFunction)(void **, void *, const char *);
	int (*cuModuleUnload)(void *);
	int (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
	                      unsigned, void *, void **, void **);
	int (*cuPointerGetAttribute)(void *, int, kvx_devptr);
	// nvrtc (libnvrtc)
	int (*nvrtcCreateProgram)(void **, const char *, const char *, int, const char **, const char **);
	int (*nvrtcCompileProgram)(void *, int, const char **);
	int (*nvrtcGetPTXSize)(void *, size_t *);
	int (*nvrtcGetPTX)(void *, char *);
	int (*nvrtcGetProgramLogSize)(void *, size_t *);
	int (*nvrtcGetProgramLog)(void *, char *);
	int (*nvrtcDestroyProgram)(void **);
	const char *(*nvrtcGetErrorString)(int);
};

static struct kvx_table kvx_fn;

// Loading. Called with the OS thread locked so dlerror belongs to this call.
static void *kvx_dlopen(const char *path, char **err) {
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		*err = e ? strdup(e) : NULL;
	}
	return h;
}

#define KVX_SYM(h, field, name) (*(void **)(&kvx_fn.field) = dlsym((h), (name)))

static void kvx_bind_runtime(void *h) {
	KVX_SYM(h, cudaGetDeviceCount, "cudaGetDeviceCount");
	KVX_SYM(h, cudaSetDevice, "cudaSetDevice");
	KVX_SYM(h, cudaFree0, "cudaFree");
	KVX_SYM(h, cudaMalloc, "cudaMalloc");
	KVX_SYM(h, cudaMemset, "cudaMemset");
	KVX_SYM(h, cudaMemcpy, "cudaMemcpy");
	KVX_SYM(h, cudaMemcpyAsync, "cudaMemcpyAsync");
	KVX_SYM(h, cudaStreamCreateWithFlags, "cudaStreamCreateWithFlags");
	KVX_SYM(h, cudaStreamSynchronize, "cudaStreamSynchronize");
	KVX_SYM(h, cudaStreamDestroy, "cudaStreamDestroy");
	KVX_SYM(h, cudaDeviceSynchronize, "cudaDeviceSynchronize");
	KVX_SYM(h, cudaHostAlloc, "cudaHostAlloc");
	KVX_SYM(h, cudaFreeHost, "cudaFreeHost");
	KVX_SYM(h, cudaHostGetDevicePointer, "cudaHostGetDevicePointer");
	KVX_SYM(h, cudaHostRegister, "cudaHostRegister");
	KVX_SYM(h, cudaHostUnregister, "cudaHostUnregister");
	KVX_SYM(h, cudaPointerGetAttributes, "cudaPointerGetAttributes");
	KVX_SYM(h, cudaIpcGetMemHandle, "cudaIpcGetMemHandle");
	KVX_SYM(h, cudaIpcOpenMemHandle, "cudaIpcOpenMemHandle");
	KVX_SYM(h, cudaIpcCloseMemHandle, "cudaIpcCloseMemHandle");
	KVX_SYM(h, cudaDeviceGetPCIBusId, "cudaDeviceGetPCIBusId");
	KVX_SYM(h, cudaMemGetInfo, "cudaMemGetInfo");
	KVX_SYM(h, cudaRuntimeGetVersion, "cudaRuntimeGetVersion");
	KVX_SYM(h, cudaGetErrorString, "cudaGetErrorString");
	KVX_SYM(h, cudaEventCreateWithFlags, "cudaEventCreateWithFlags");
	KVX_SYM(h, cudaEventRecord, "cudaEventRecord");
	KVX_SYM(h, cudaEventQuery, "cudaEventQuery");
	KVX_SYM(h, cudaEventSynchronize, "cudaEventSynchronize");
	KVX_SYM(h, cudaEventDestroy, "cudaEventDestroy");
	KVX_SYM(h, cudaLaunchHostFunc, "cudaLaunchHostFunc");
}

static void kvx_bind_driver(void *h) {
	KVX_SYM(h, cuInit, "cuInit");
	KVX_SYM(h, cuDriverGetVersion, "cuDriverGetVersion");
	KVX_SYM(h, cuDeviceGetName, "cuDeviceGetName");
	KVX_SYM(h, cuDeviceTotalMem_v2, "cuDeviceTotalMem_v2");
	KVX_SYM(h, cuDeviceGetAttribute, "cuDeviceGetAttribute");
	KVX_SYM(h, cuGetErrorString, "cuGetErrorString");
	KVX_SYM(h, cuCtxGetCurrent, "cuCtxGetCurrent");
	KVX_SYM(h, cuCtxSynchronize, "cuCtxSynchronize");
	KVX_SYM(h, cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
	KVX_SYM(h, cuModuleLoadData, "cuModuleLoadData");
	KVX_SYM(h, cuModuleGetFunction, "cuModuleGetFunction");
	KVX_SYM(h, cuModuleUnload, "cuModuleUnload");
	KVX_SYM(h, cuLaunchKernel, "cuLaunchKernel");
	KVX_SYM(h, cuPointerGetAttribute, "cuPointerGetAttribute");
}

static void kvx_bind_nvrtc(void *h) {
	KVX_SYM(h, nvrtcCreateProgram, "nvrtcCreateProgram");
	KVX_SYM(h, nvrtcCompileProgram, "nvrtcCompileProgram");
	KVX_SYM(h, nvrtcGetPTXSize, "nvrtcGetPTXSize");
	KVX_SYM(h, nvrtcGetPTX, "nvrtcGetPTX");
	KVX_SYM(h, nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize");
	KVX_SYM(h, nvrtcGetProgramLog, "nvrtcGetProgramLog");
	KVX_SYM(h, nvrtcDestroyProgram, "nvrtcDestroyProgram");
	KVX_SYM(h, nvrtcGetErrorString, "nvrtcGetErrorString");
}

static void kvx_clear(int which) {
	// which: 0 runtime, 1 driver, 2 nvrtc. Pointers of one library are
	// cleared before it is dlclosed.
	size_t rt_end = offsetof(struct kvx_table, cuInit);
	size_t drv_end = offsetof(struct kvx_table, nvrtcCreateProgram);
	char *base = (char *)&kvx_fn;
	if (which == 0) memset(base, 0, rt_end);
	if (which == 1) memset(base + rt_end, 0, drv_end - rt_end);
	if (which == 2) memset(base + drv_end, 0, sizeof(kvx_fn) - drv_end);
}

// kvx_missing_runtime returns the name of the first required runtime symbol
// that is NULL, or NULL when all are present.
static const char *kvx_missing_runtime(void) {
	if (!kvx_fn.cudaGetDeviceCount) return "cudaGetDeviceCount";
	if (!kvx_fn.cudaSetDevice) return "cudaSetDevice";
	if (!kvx_fn.cudaGetErrorString) return "cudaGetErrorString";
	return NULL;
}
static const char *kvx_missing_driver(void) {
	if (!kvx_fn.cuInit) return "cuInit";
	if (!kvx_fn.cuGetErrorString) return "cuGetErrorString";
	return NULL;
}

// Device selection: make dev current on this OS thread for the runtime and,
// when the driver has no current context yet, initialise the runtime's
// primary context (cudaFree(0)) so driver calls in the same C call see it.
static int kvx_use(int dev) {
	if (!kvx_fn.cudaSetDevice) return KVX_ENOSYM;
	int r = kvx_fn.cudaSetDevice(dev);
	if (r != 0) return r;
	if (kvx_fn.cuCtxGetCurrent && kvx_fn.cudaFree0) {
		void *ctx = NULL;
		if (kvx_fn.cuCtxGetCurrent(&ctx) == 0 && ctx == NULL) {
			r = kvx_fn.cudaFree0(NULL);
		}
	}
	return r;
}

#define KVX_CALL(f, ...) (kvx_fn.f ? kvx_fn.f(__VA_ARGS__) : KVX_ENOSYM)
#define KVX_USE_OR_RETURN(dev) do { int _r = kvx_use(dev); if (_r != 0) return _r; } while (0)

static int kvx_device_count(int *n) { return KVX_CALL(cudaGetDeviceCount, n); }
static int kvx_runtime_version(int *v) { return KVX_CALL(cudaRuntimeGetVersion, v); }
static int kvx_driver_version(int *v) { return KVX_CALL(cuDriverGetVersion, v); }
static int kvx_cu_init(void) { return KVX_CALL(cuInit, 0); }

static const char *kvx_rt_errstr(int code) {
	return kvx_fn.cudaGetErrorString ? kvx_fn.cudaGetErrorString(code) : NULL;
}
static const char *kvx_drv_errstr(int code) {
	const char *s = NULL;
	if (!kvx_fn.cuGetErrorString || kvx_fn.cuGetErrorString(code, &s) != 0) return NULL;
	return s;
}
static const char *kvx_nvrtc_errstr(int code) {
	return kvx_fn.nvrtcGetErrorString ? kvx_fn.nvrtcGetErrorString(code) : NULL;
}

static int kvx_pci_bus_id(int dev, char *buf, int len) { return KVX_CALL(cudaDeviceGetPCIBusId, buf, len, dev); }
static int kvx_device_name(int dev, char *buf, int len) { return KVX_CALL(cuDeviceGetName, buf, len, dev); }
static int kvx_total_mem(int dev, size_t *n) { return KVX_CALL(cuDeviceTotalMem_v2, n, dev); }
static int kvx_attribute(int dev, int attr, int *v) { return KVX_CALL(cuDeviceGetAttribute, v, attr, dev); }
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2: a CUmemorytype) and, for device
// memory, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9).
static int kvx_cu_pointer_type(kvx_devptr p, unsigned *type, int *ordinal) {
	*type = 0;
	*ordinal = -1;
	int r = KVX_CALL(cuPointerGetAttribute, type, 2, p);
	if (r != 0 || *type != 2) return r;
	return KVX_CALL(cuPointerGetAttribute, ordinal, 9, p);
}
static int kvx_mem_info(int dev, size_t *free, size_t *total) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaMemGetInfo, free, total);
}

static int kvx_malloc(int dev, kvx_devptr *p, size_t n) {
	KVX_USE_OR_RETURN(dev);
	void *v = NULL;
	int r = KVX_CALL(cudaMalloc, &v, n);
	*p = (kvx_devptr)(uintptr_t)v;
	return r;
}
static int kvx_free(int dev, kvx_devptr p) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaFree0, (void *)(uintptr_t)p);
}
static int kvx_memset(int dev, kvx_devptr p, int v, size_t n) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaMemset, (void *)(uintptr_t)p, v, n);
}
static int kvx_memcpy(int dev, uintptr_t dst, uintptr_t src, size_t n, int kind) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaMemcpy, (void *)dst, (const void *)src, n, kind);
}
// kvx_memcpy_go is kvx_memcpy with one side in Go memory (pinned by cgo for
// the call; the copy is synchronous).
static int kvx_memcpy_go(int dev, uintptr_t dst, void *gobuf, uintptr_t src, size_t n, int kind) {
	KVX_USE_OR_RETURN(dev);
	if (dst == 0) dst = (uintptr_t)gobuf; else src = (uintptr_t)gobuf;
	return KVX_CALL(cudaMemcpy, (void *)dst, (const void *)src, n, kind);
}
static int kvx_memcpy_async(int dev, uintptr_t dst, uintptr_t src, size_t n, int kind, void *stream) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaMemcpyAsync, (void *)dst, (const void *)src, n, kind, stream);
}
static int kvx_stream_create(int dev, void **s) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaStreamCreateWithFlags, s, 1); // cudaStreamNonBlocking
}
static int kvx_stream_sync(int dev, void *s) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaStreamSynchronize, s);
}
static int kvx_stream_destroy(int dev, void *s) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaStreamDestroy, s);
}
static int kvx_device_sync(int dev) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaDeviceSynchronize);
}
// cudaHostAllocPortable (1) | cudaHostAllocMapped (2), then the device alias.
static int kvx_host_alloc_mapped(int dev, size_t n, void **host, kvx_devptr *devp) {
	KVX_USE_OR_RETURN(dev);
	void *h = NULL, *d = NULL;
	int r = KVX_CALL(cudaHostAlloc, &h, n, 1 | 2);
	if (r != 0) return r;
	r = KVX_CALL(cudaHostGetDevicePointer, &d, h, 0);
	if (r != 0) {
		KVX_CALL(cudaFreeHost, h);
		return r;
	}
	*host = h;
	*devp = (kvx_devptr)(uintptr_t)d;
	return 0;
}
static int kvx_free_host(int dev, void *h) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaFreeHost, h);
}
// cudaHostRegisterPortable (1) | cudaHostRegisterMapped (2), then the alias.
static int kvx_host_register(int dev, void *h, size_t n, kvx_devptr *devp) {
	KVX_USE_OR_RETURN(dev);
	int r = KVX_CALL(cudaHostRegister, h, n, 1 | 2);
	if (r != 0) return r;
	void *d = NULL;
	r = KVX_CALL(cudaHostGetDevicePointer, &d, h, 0);
	if (r != 0) {
		KVX_CALL(cudaHostUnregister, h);
		return r;
	}
	*devp = (kvx_devptr)(uintptr_t)d;
	return 0;
}
static int kvx_host_unregister(int dev, void *h) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaHostUnregister, h);
}
static int kvx_ptr_attributes(uintptr_t p, kvx_ptr_attr *a) {
	memset(a, 0, sizeof(*a));
	return KVX_CALL(cudaPointerGetAttributes, a, (const void *)p);
}
static int kvx_ipc_get(int dev, kvx_devptr p, kvx_ipc_handle *h) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaIpcGetMemHandle, h, (void *)(uintptr_t)p);
}
static int kvx_ipc_open(int dev, kvx_ipc_handle *h, kvx_devptr *p) {
	KVX_USE_OR_RETURN(dev);
	void *v = NULL;
	int r = KVX_CALL(cudaIpcOpenMemHandle, &v, *h, 1); // cudaIpcMemLazyEnablePeerAccess
	*p = (kvx_devptr)(uintptr_t)v;
	return r;
}
static int kvx_ipc_close(int dev, kvx_devptr p) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaIpcCloseMemHandle, (void *)(uintptr_t)p);
}
// CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1; the handle is an int fd.
static int kvx_dmabuf_fd(int dev, kvx_devptr p, size_t n, int *fd) {
	KVX_USE_OR_RETURN(dev);
	*fd = -1;
	return KVX_CALL(cuMemGetHandleForAddressRange, (void *)fd, p, n, 1, 0ULL);
}

// Events (cudaEventDisableTiming = 2: no timestamps, the cheapest kind) and
// the stream gate. An event handle is a cudaEvent_t, the same object as the
// driver's CUevent, so a caller's event (PyTorch's torch.cuda.Event) is
// queried here as is.
static int kvx_event_create(int dev, void **e) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaEventCreateWithFlags, e, 2);
}
static int kvx_event_record(int dev, void *e, void *stream) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaEventRecord, e, stream);
}
static int kvx_event_query(int dev, void *e) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaEventQuery, e);
}
static int kvx_event_sync(int dev, void *e) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaEventSynchronize, e);
}
static int kvx_event_destroy(int dev, void *e) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaEventDestroy, e);
}

// The gate: a host function enqueued on a stream (cudaLaunchHostFunc) that
// returns once the host opens the gate, so the work enqueued after it waits
// for the host. It runs on CUDA's callback thread and calls no CUDA API (the
// rule for host functions). The struct is C memory (kvx_gate_new).
typedef struct { int open; int done; } kvx_gate;
static kvx_gate *kvx_gate_new(void) { return calloc(1, sizeof(kvx_gate)); }
static void kvx_gate_fn(void *p) {
	kvx_gate *g = p;
	struct timespec ts = {0, 50000}; // 50 us
	while (!__atomic_load_n(&g->open, __ATOMIC_ACQUIRE)) nanosleep(&ts, NULL);
	__atomic_store_n(&g->done, 1, __ATOMIC_RELEASE);
}
static int kvx_gate_launch(int dev, void *stream, kvx_gate *g) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cudaLaunchHostFunc, stream, kvx_gate_fn, g);
}
static void kvx_gate_open(kvx_gate *g) { __atomic_store_n(&g->open, 1, __ATOMIC_RELEASE); }
static int kvx_gate_done(kvx_gate *g) { return __atomic_load_n(&g->done, __ATOMIC_ACQUIRE); }

// The GPU proof: load a module (PTX text), fetch the kernel, run it on one
// thread and wait. args are the kernel's three pointer/u64 parameters.
static int kvx_module_load(int dev, const char *image, void **mod) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cuModuleLoadData, mod, (const void *)image);
}
static int kvx_module_function(void *mod, const char *name, void **fn) {
	return KVX_CALL(cuModuleGetFunction, fn, mod, name);
}
static int kvx_module_unload(int dev, void *mod) {
	KVX_USE_OR_RETURN(dev);
	return KVX_CALL(cuModuleUnload, mod);
}
static int kvx_launch3(int dev, void *fn, unsigned long long a0, unsigned long long a1, unsigned long long a2) {
	KVX_USE_OR_RETURN(dev);
	void *args[3] = {&a0, &a1, &a2};
	int r = KVX_CALL(cuLaunchKernel, fn, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL);
	if (r != 0) return r;
	return KVX_CALL(cuCtxSynchronize);
}

// NVRTC: compile src to PTX. On success *ptx is malloc'ed (caller frees);
// the log (malloc'ed, may be NULL) is returned in both cases.
static int kvx_nvrtc_compile(const char *src, const char *name, const char *arch,
                             char **ptx, char **log) {
	void *prog = NULL;
	*ptx = NULL;
	*log = NULL;
	int r = KVX_CALL(nvrtcCreateProgram, &prog, src, name, 0, NULL, NULL);
	if (r != 0) return r;
	const char *opts[1] = {arch};
	int cr = KVX_CALL(nvrtcCompileProgram, prog, 1, opts);
	size_t n = 0;
	if (KVX_CALL(nvrtcGetProgramLogSize, prog, &n) == 0 && n > 1) {
		*log = malloc(n);
		if (*log && KVX_CALL(nvrtcGetProgramLog, prog, *log) != 0) {
			free(*log);
			*log = NULL;
		}
	}
	if (cr == 0) {
		n = 0;
		cr = KVX_CALL(nvrtcGetPTXSize, prog, &n);
		if (cr == 0) {
			*ptx = malloc(n + 1);
			cr = *ptx ? KVX_CALL(nvrtcGetPTX, prog, *ptx) : 1;
			if (*ptx) (*ptx)[n] = 0;
		}
	}
	KVX_CALL(nvrtcDestroyProgram, &prog);
	return cr;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"unsafe"
)

// Which library a handle belongs to (index into lib.handles).
const (
	libRuntime = 0
	libDriver  = 1
	libNVRTC   = 2
)

// rawOpen dlopens the first of candidates that loads and binds its symbols.
// It returns the handle and the path used, or an error listing every
// candidate's dlerror text.
func rawOpen(which int, candidates []string) (unsafe.Pointer, string, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var errs []string
	for _, path := range candidates {
		cpath := C.CString(path)
		var cerr *C.char
		h := C.kvx_dlopen(cpath, &cerr)
		C.free(unsafe.Pointer(cpath))
		if h == nil {
			msg := "unknown dlopen error"
			if cerr != nil {
				msg = C.GoString(cerr)
				C.free(unsafe.Pointer(cerr))
			}
			errs = append(errs, msg)
			continue
		}
		switch which {
		case libRuntime:
			C.kvx_bind_runtime(h)
		case libDriver:
			C.kvx_bind_driver(h)
		case libNVRTC:
			C.kvx_bind_nvrtc(h)
		}
		return h, path, nil
	}
	if len(errs) > 1 {
		return nil, "", fmt.Errorf("%s (and %d more candidates failed)", errs[0], len(errs)-1)
	}
	return nil, "", errors.New(strings.Join(errs, "; "))
}

// rawClose clears a library's function pointers and dlcloses it.
func rawClose(which int, h unsafe.Pointer) {
	if h == nil {
		return
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.kvx_clear(C.int(which))
	C.dlclose(h)
}

// rawMissing names the first required symbol the loaded library lacks ("" if
// none).
func rawMissing(which int) string {
	var s *C.char
	switch which {
	case libRuntime:
		s = C.kvx_missing_runtime()
	case libDriver:
		s = C.kvx_missing_driver()
	}
	if s == nil {
		return ""
	}
	return C.GoString(s)
}

// rawErr converts a status to nil or an *Error with the library's message.
func rawErr(op string, api API, code C.int) error {
	if code == 0 {
		return nil
	}
	e := &Error{Op: op, API: api, Code: Code(code)}
	if code != C.KVX_ENOSYM {
		var s *C.char
		switch api {
		case Runtime:
			s = C.kvx_rt_errstr(code)
		case Driver:
			s = C.kvx_drv_errstr(code)
		case NVRTC:
			s = C.kvx_nvrtc_errstr(code)
		}
		if s != nil {
			e.msg = C.GoString(s)
		}
	}
	return e
}

func rawDeviceCount() (int, error) {
	var n C.int
	err := rawErr("cudaGetDeviceCount", Runtime, C.kvx_device_count(&n))
	return int(n), err
}

func rawCuInit() error { return rawErr("cuInit", Driver, C.kvx_cu_init()) }

func rawVersions() (rt, drv int) {
	var a, b C.int
	if C.kvx_runtime_version(&a) != 0 {
		a = 0
	}
	if C.kvx_driver_version(&b) != 0 {
		b = 0
	}
	return int(a), int(b)
}

// CUdevice_attribute values from the driver API reference.
const (
	attrComputeMajor = 75
	attrComputeMinor = 76
	attrDmaBuf       = 124
)

func rawDeviceProps(dev int) (DeviceProps, error) {
	p := DeviceProps{Ordinal: dev}
	buf := make([]byte, 256)
	cbuf := (*C.char)(unsafe.Pointer(&buf[0]))
	if err := rawErr("cudaDeviceGetPCIBusId", Runtime, C.kvx_pci_bus_id(C.int(dev), cbuf, C.int(len(buf)))); err != nil {
		return p, err
	}
	p.PCIBusID = C.GoString(cbuf)
	clear(buf)
	if err := rawErr("cuDeviceGetName", Driver, C.kvx_device_name(C.int(dev), cbuf, C.int(len(buf)))); err != nil {
		return p, err
	}
	p.Name = C.GoString(cbuf)
	var total C.size_t
	if err := rawErr("cuDeviceTotalMem_v2", Driver, C.kvx_total_mem(C.int(dev), &total)); err != nil {
		return p, err
	}
	p.TotalMemory = uint64(total)
	var free, tot C.size_t
	if err := rawErr("cudaMemGetInfo", Runtime, C.kvx_mem_info(C.int(dev), &free, &tot)); err == nil {
		p.FreeMemory = uint64(free)
	} else if !errors.Is(err, ErrSymbolMissing) {
		return p, err
	}
	var v C.int
	if C.kvx_attribute(C.int(dev), attrComputeMajor, &v) == 0 {
		p.ComputeMajor = int(v)
	}
	if C.kvx_attribute(C.int(dev), attrComputeMinor, &v) == 0 {
		p.ComputeMinor = int(v)
	}
	if C.kvx_attribute(C.int(dev), attrDmaBuf, &v) == 0 {
		p.DmaBuf = v != 0
	}
	return p, nil
}

func rawMalloc(dev int, n uint64) (DevicePtr, error) {
	var p C.kvx_devptr
	err := rawErr("cudaMalloc", Runtime, C.kvx_malloc(C.int(dev), &p, C.size_t(n)))
	return DevicePtr(p), err
}

func rawFree(dev int, p DevicePtr) error {
	return rawErr("cudaFree", Runtime, C.kvx_free(C.int(dev), C.kvx_devptr(p)))
}

func rawMemset(dev int, p DevicePtr, v byte, n uint64) error {
	return rawErr("cudaMemset", Runtime, C.kvx_memset(C.int(dev), C.kvx_devptr(p), C.int(v), C.size_t(n)))
}

func rawMemcpy(dev int, dst, src uintptr, n uint64, kind MemcpyKind) error {
	return rawErr("cudaMemcpy", Runtime, C.kvx_memcpy(C.int(dev), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.int(kind)))
}

// rawMemcpyGo copies between a Go slice and dev memory: toGo selects the
// direction (device->Go when true).
func rawMemcpyGo(dev int, other uintptr, buf []byte, toGo bool) error {
	if len(buf) == 0 {
		return nil
	}
	gp := unsafe.Pointer(&buf[0])
	var r C.int
	if toGo {
		r = C.kvx_memcpy_go(C.int(dev), 0, gp, C.uintptr_t(other), C.size_t(len(buf)), C.int(Default))
	} else {
		r = C.kvx_memcpy_go(C.int(dev), C.uintptr_t(other), gp, 0, C.size_t(len(buf)), C.int(Default))
	}
	return rawErr("cudaMemcpy", Runtime, r)
}

func rawMemcpyAsync(dev int, dst, src uintptr, n uint64, kind MemcpyKind, s unsafe.Pointer) error {
	return rawErr("cudaMemcpyAsync", Runtime, C.kvx_memcpy_async(C.int(dev), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.int(kind), s))
}

func rawStreamCreate(dev int) (unsafe.Pointer, error) {
	var s unsafe.Pointer
	err := rawErr("cudaStreamCreateWithFlags", Runtime, C.kvx_stream_create(C.int(dev), &s))
	return s, err
}

func rawStreamSync(dev int, s unsafe.Pointer) error {
	return rawErr("cudaStreamSynchronize", Runtime, C.kvx_stream_sync(C.int(dev), s))
}

func rawStreamDestroy(dev int, s unsafe.Pointer) error {
	return rawErr("cudaStreamDestroy", Runtime, C.kvx_stream_destroy(C.int(dev), s))
}

func rawDeviceSync(dev int) error {
	return rawErr("cudaDeviceSynchronize", Runtime, C.kvx_device_sync(C.int(dev)))
}

func rawHostAllocMapped(dev int, n uint64) (unsafe.Pointer, DevicePtr, error) {
	var h unsafe.Pointer
	var d C.kvx_devptr
	err := rawErr("cudaHostAlloc", Runtime, C.kvx_host_alloc_mapped(C.int(dev), C.size_t(n), &h, &d))
	return h, DevicePtr(d), err
}

func rawFreeHost(dev int, h unsafe.Pointer) error {
	return rawErr("cudaFreeHost", Runtime, C.kvx_free_host(C.int(dev), h))
}

func rawHostRegister(dev int, h unsafe.Pointer, n uint64) (DevicePtr, error) {
	var d C.kvx_devptr
	err := rawErr("cudaHostRegister", Runtime, C.kvx_host_register(C.int(dev), h, C.size_t(n), &d))
	return DevicePtr(d), err
}

func rawHostUnregister(dev int, h unsafe.Pointer) error {
	return rawErr("cudaHostUnregister", Runtime, C.kvx_host_unregister(C.int(dev), h))
}

func rawPointerAttributes(p uintptr) (PointerInfo, error) {
	var a C.kvx_ptr_attr
	if err := rawErr("cudaPointerGetAttributes", Runtime, C.kvx_ptr_attributes(C.uintptr_t(p), &a)); err != nil {
		return PointerInfo{Device: -1}, err
	}
	info := PointerInfo{
		Type:          MemoryType(a._type),
		Device:        int(a.device),
		DevicePointer: uintptr(a.devicePointer),
		HostPointer:   uintptr(a.hostPointer),
	}
	if info.Type == MemoryUnregistered {
		info.Device = -1
	}
	return info, nil
}

// cuErrorInvalidValue is CUDA_ERROR_INVALID_VALUE: what
// cuPointerGetAttribute returns for memory the driver does not know.
const cuErrorInvalidValue = 1

func rawPointerDevice(p uintptr) (int, bool, error) {
	var typ C.uint
	var ord C.int
	rc := C.kvx_cu_pointer_type(C.kvx_devptr(p), &typ, &ord)
	if rc == cuErrorInvalidValue && typ == 0 {
		return -1, false, nil // not CUDA memory: plain host memory
	}
	if err := rawErr("cuPointerGetAttribute", Driver, rc); err != nil {
		return -1, false, err
	}
	if typ != 2 { // CU_MEMORYTYPE_DEVICE
		return -1, false, nil
	}
	return int(ord), true, nil
}

func rawIPCGet(dev int, p DevicePtr) (IPCHandle, error) {
	var h C.kvx_ipc_handle
	err := rawErr("cudaIpcGetMemHandle", Runtime, C.kvx_ipc_get(C.int(dev), C.kvx_devptr(p), &h))
	var out IPCHandle
	copy(out[:], unsafe.Slice((*byte)(unsafe.Pointer(&h.reserved[0])), len(out)))
	return out, err
}

func rawIPCOpen(dev int, h IPCHandle) (DevicePtr, error) {
	var ch C.kvx_ipc_handle
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&ch.reserved[0])), len(h)), h[:])
	var p C.kvx_devptr
	err := rawErr("cudaIpcOpenMemHandle", Runtime, C.kvx_ipc_open(C.int(dev), &ch, &p))
	return DevicePtr(p), err
}

func rawIPCClose(dev int, p DevicePtr) error {
	return rawErr("cudaIpcCloseMemHandle", Runtime, C.kvx_ipc_close(C.int(dev), C.kvx_devptr(p)))
}

func rawDmaBufFD(dev int, p DevicePtr, n uint64) (int, error) {
	var fd C.int
	err := rawErr("cuMemGetHandleForAddressRange", Driver, C.kvx_dmabuf_fd(C.int(dev), C.kvx_devptr(p), C.size_t(n), &fd))
	if err != nil {
		return -1, err
	}
	return int(fd), nil
}

func rawModuleLoad(dev int, image string) (unsafe.Pointer, error) {
	cimg := C.CString(image)
	defer C.free(unsafe.Pointer(cimg))
	var mod unsafe.Pointer
	err := rawErr("cuModuleLoadData", Driver, C.kvx_module_load(C.int(dev), cimg, &mod))
	return mod, err
}

func rawModuleFunction(mod unsafe.Pointer, name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var fn unsafe.Pointer
	err := rawErr("cuModuleGetFunction", Driver, C.kvx_module_function(mod, cname, &fn))
	return fn, err
}

func rawModuleUnload(dev int, mod unsafe.Pointer) error {
	return rawErr("cuModuleUnload", Driver, C.kvx_module_unload(C.int(dev), mod))
}

func rawLaunch3(dev int, fn unsafe.Pointer, a0, a1, a2 uint64) error {
	return rawErr("cuLaunchKernel", Driver, C.kvx_launch3(C.int(dev), fn, C.ulonglong(a0), C.ulonglong(a1), C.ulonglong(a2)))
}

// rawNVRTCCompile compiles CUDA C source to PTX for arch ("--gpu-arch=compute_90").
func rawNVRTCCompile(src, name, arch string) (string, error) {
	csrc, cname, carch := C.CString(src), C.CString(name), C.CString(arch)
	defer C.free(unsafe.Pointer(csrc))
	defer C.free(unsafe.Pointer(cname))
	defer C.free(unsafe.Pointer(carch))
	var ptx, log *C.char
	r := C.kvx_nvrtc_compile(csrc, cname, carch, &ptx, &log)
	var logText, ptxText string
	if log != nil {
		logText = C.GoString(log)
		C.free(unsafe.Pointer(log))
	}
	if ptx != nil {
		ptxText = C.GoString(ptx)
		C.free(unsafe.Pointer(ptx))
	}
	if err := rawErr("nvrtcCompileProgram", NVRTC, r); err != nil {
		if logText != "" {
			return "", fmt.Errorf("%w; compiler log:\n%s", err, logText)
		}
		return "", err
	}
	return ptxText, nil
}

func rawEventCreate(dev int) (unsafe.Pointer, error) {
	var e unsafe.Pointer
	err := rawErr("cudaEventCreateWithFlags", Runtime, C.kvx_event_create(C.int(dev), &e))
	return e, err
}

func rawEventRecord(dev int, e, s unsafe.Pointer) error {
	return rawErr("cudaEventRecord", Runtime, C.kvx_event_record(C.int(dev), e, s))
}

// rawEventQuery returns the raw status of cudaEventQuery: 0 complete,
// codeNotReady pending, anything else an error (as an *Error).
func rawEventQuery(dev int, e unsafe.Pointer) (Code, error) {
	r := C.kvx_event_query(C.int(dev), e)
	if Code(r) == codeNotReady {
		return codeNotReady, nil
	}
	return Code(r), rawErr("cudaEventQuery", Runtime, r)
}

func rawEventSync(dev int, e unsafe.Pointer) error {
	return rawErr("cudaEventSynchronize", Runtime, C.kvx_event_sync(C.int(dev), e))
}

func rawEventDestroy(dev int, e unsafe.Pointer) error {
	return rawErr("cudaEventDestroy", Runtime, C.kvx_event_destroy(C.int(dev), e))
}

// rawGateNew allocates a closed gate in C memory (nil when out of memory).
func rawGateNew() unsafe.Pointer { return unsafe.Pointer(C.kvx_gate_new()) }

func rawGateLaunch(dev int, s, g unsafe.Pointer) error {
	return rawErr("cudaLaunchHostFunc", Runtime, C.kvx_gate_launch(C.int(dev), s, (*C.kvx_gate)(g)))
}

func rawGateOpen(g unsafe.Pointer)      { C.kvx_gate_open((*C.kvx_gate)(g)) }
func rawGateDone(g unsafe.Pointer) bool { return C.kvx_gate_done((*C.kvx_gate)(g)) != 0 }
func rawGateFree(g unsafe.Pointer)      { C.free(g) }
