// A fake CUDA runtime for cuda package tests: it exports a subset of the
// cudart API implemented on host memory, so the binding's load, dispatch,
// error and copy paths run with no GPU. Build switches:
//   -DFAKE_DEVICES=N   number of devices reported (default 1; 0 -> error 100)
//   -DFAKE_NO_COUNT    omit cudaGetDeviceCount (a required symbol)
//   -DFAKE_NO_HOST_REGISTER  omit cudaHostRegister/cudaHostUnregister
// cudaIpc* are deliberately absent (exercise the symbol-missing path).
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#ifndef FAKE_DEVICES
#define FAKE_DEVICES 1
#endif

typedef struct { int type; int device; void *devicePointer; void *hostPointer; } attr_t;

#define MAXA 256
static struct { void *p; size_t n; int type; } allocs[MAXA];
static int current = 0;

static void track(void *p, size_t n, int type) {
	for (int i = 0; i < MAXA; i++) if (!allocs[i].p) { allocs[i].p = p; allocs[i].n = n; allocs[i].type = type; return; }
}
static int untrack(void *p, int type) {
	for (int i = 0; i < MAXA; i++) if (allocs[i].p == p && allocs[i].type == type) { allocs[i].p = NULL; return 0; }
	return 1;
}

#ifndef FAKE_NO_COUNT
int cudaGetDeviceCount(int *n) {
	*n = FAKE_DEVICES;
	return FAKE_DEVICES == 0 ? 100 : 0;
}
#endif
int cudaSetDevice(int d) {
	if (d < 0 || d >= FAKE_DEVICES) return 101;
	current = d;
	return 0;
}
const char *cudaGetErrorString(int c) {
	switch (c) {
	case 1: return "fake: invalid argument";
	case 2: return "fake: out of memory";
	case 100: return "fake: no CUDA-capable device is detected";
	case 101: return "fake: invalid device ordinal";
	}
	return "fake: other error";
}
int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaMalloc(void **p, size_t n) {
	if (n > ((size_t)1 << 40)) return 2;
	*p = malloc(n);
	if (!*p) return 2;
	track(*p, n, 2);
	return 0;
}
int cudaFree(void *p) {
	if (!p) return 0;
	if (untrack(p, 2)) return 1;
	free(p);
	return 0;
}
int cudaMemset(void *p, int v, size_t n) { memset(p, v, n); return 0; }
int cudaMemcpy(void *d, const void *s, size_t n, int kind) {
	if (kind < 0 || kind > 4) return 21;
	memmove(d, s, n);
	return 0;
}
int cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, void *stream) {
	if (!stream) return 400;
	return cudaMemcpy(d, s, n, kind);
}
int cudaStreamCreateWithFlags(void **s, unsigned f) { *s = malloc(8); return 0; }
int cudaStreamSynchronize(void *s) { return s ? 0 : 400; }
int cudaStreamDestroy(void *s) { free(s); return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaHostAlloc(void **p, size_t n, unsigned flags) {
	if ((flags & 2) == 0) return 1;
	*p = malloc(n);
	if (!*p) return 2;
	memset(*p, 0x5a, n); // not zeroed, like CUDA: the binding must zero it
	track(*p, n, 1);
	return 0;
}
int cudaHostGetDevicePointer(void **d, void *h, unsigned flags) { *d = h; return 0; }
int cudaFreeHost(void *p) {
	if (untrack(p, 1)) return 1;
	free(p);
	return 0;
}
int cudaPointerGetAttributes(attr_t *a, const void *p) {
	for (int i = 0; i < MAXA; i++) {
		char *b = allocs[i].p;
		if (b && (const char *)p >= b && (const char *)p < b + allocs[i].n) {
			a->type = allocs[i].type;
			a->device = current;
			a->devicePointer = (void *)p;
			a->hostPointer = allocs[i].type == 1 ? (void *)p : NULL;
			return 0;
		}
	}
	a->type = 0;
	a->device = -2;
	return 0;
}
int cudaDeviceGetPCIBusId(char *buf, int len, int dev) {
	snprintf(buf, len, "0000:%02x:00.0", 0x18 + dev);
	return 0;
}
int cudaMemGetInfo(size_t *f, size_t *t) { *f = (size_t)1 << 30; *t = (size_t)2 << 30; return 0; }
#ifndef FAKE_NO_HOST_REGISTER
int cudaHostRegister(void *p, size_t n, unsigned flags) {
	if ((flags & 2) == 0) return 1;
	for (int i = 0; i < MAXA; i++) if (allocs[i].p == p) return 712;
	track(p, n, 1);
	return 0;
}
int cudaHostUnregister(void *p) { return untrack(p, 1) ? 1 : 0; }
#endif
