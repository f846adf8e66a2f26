// A fake CUDA driver for cuda package tests. The "kernel launch" runs the
// proof kernel's logic on the host, so the module/launch plumbing (argument
// marshalling, result read-back) is exercised with no GPU.
//   -DFAKE_DMABUF  export cuMemGetHandleForAddressRange (returns an fd of /dev/null)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <string.h>
#include <stdlib.h>

int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetName(char *buf, int len, int dev) {
	strncpy(buf, "Fake H200", len - 1);
	buf[len - 1] = 0;
	return 0;
}
int cuDeviceTotalMem_v2(size_t *n, int dev) { *n = (size_t)141 << 30; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
	switch (attr) {
	case 75: *v = 9; return 0;
	case 76: *v = 0; return 0;
	case 124: *v = 1; return 0;
	}
	return 1;
}
int cuGetErrorString(int c, const char **s) {
	switch (c) {
	case 1: *s = "fake driver: invalid argument"; return 0;
	case 218: *s = "fake driver: a PTX JIT compilation failed"; return 0;
	}
	*s = "fake driver: other error";
	return 0;
}
static int ctx_token;
int cuCtxGetCurrent(void **c) { *c = &ctx_token; return 0; }
int cuCtxSynchronize(void) { return 0; }
#ifdef FAKE_DMABUF
int cuMemGetHandleForAddressRange(void *h, unsigned long long p, size_t n, int type, unsigned long long flags) {
	if (type != 1 || flags != 0) return 1;
	*(int *)h = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return *(int *)h < 0 ? 304 : 0;
}
#endif
static int module_token, function_token;
int cuModuleLoadData(void **m, const void *image) {
	if (!strstr((const char *)image, ".entry kvx_check_room")) return 218;
	*m = &module_token;
	return 0;
}
int cuModuleGetFunction(void **f, void *m, const char *name) {
	if (m != &module_token || strcmp(name, "kvx_check_room") != 0) return 500;
	*f = &function_token;
	return 0;
}
int cuModuleUnload(void *m) { return m == &module_token ? 0 : 400; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void *stream, void **params, void **extra) {
	if (f != &function_token || !params) return 400;
	const unsigned long long *slot = (const unsigned long long *)(*(unsigned long long *)params[0]);
	unsigned long long expected = *(unsigned long long *)params[1];
	unsigned long long *out = (unsigned long long *)(*(unsigned long long *)params[2]);
	out[0] = slot[0];
	out[1] = slot[0] == expected ? 1 : 0;
	return 0;
}

/* cuPointerGetAttribute answers from the fake runtime's allocation table
 * (the runtime and the driver are separate libraries, as in CUDA): it asks
 * the cudaPointerGetAttributes of every loaded fake libcudart (a test
 * process may hold earlier ones that dlclose did not unload) and uses the
 * first that knows the pointer. Memory none allocated is
 * CUDA_ERROR_INVALID_VALUE, as the real driver answers for host memory. */
typedef struct { int type; int device; void *devicePointer; void *hostPointer; } fake_attr_t;
struct lookup { unsigned long long p; fake_attr_t a; };
static int ask_rt(struct dl_phdr_info *info, size_t size, void *data) {
	struct lookup *q = data;
	const char *n = info->dlpi_name;
	size_t l = n ? strlen(n) : 0;
	if (l < 15 || strcmp(n + l - 15, "libcudart.so.13") != 0) return 0;
	void *h = dlopen(n, RTLD_NOW | RTLD_NOLOAD);
	if (!h) return 0;
	int (*get)(fake_attr_t *, const void *) = (int (*)(fake_attr_t *, const void *))dlsym(h, "cudaPointerGetAttributes");
	fake_attr_t a = {0};
	int found = get && get(&a, (const void *)q->p) == 0 && a.type != 0;
	dlclose(h);
	if (found) q->a = a;
	return found;
}
int cuPointerGetAttribute(void *data, int attr, unsigned long long p) {
	struct lookup q = {p, {0}};
	dl_iterate_phdr(ask_rt, &q);
	if (q.a.type == 0) return 1; /* not CUDA memory */
	switch (attr) {
	case 2: *(unsigned *)data = q.a.type == 2 ? 2u : q.a.type == 1 ? 1u : 4u; return 0; /* CUmemorytype */
	case 9: *(int *)data = q.a.device; return 0;
	}
	return 1;
}
