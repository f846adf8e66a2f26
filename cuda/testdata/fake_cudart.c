// A fake CUDA runtime for cuda package tests: it exports a subset of the
// cudart API implemented on host memory, so the binding's load, dispatch,
// error and copy paths run with no GPU. Build switches:
//   -DFAKE_DEVICES=N   number of devices reported (default 1; 0 -> error 100)
//   -DFAKE_NO_COUNT    omit cudaGetDeviceCount (a required symbol)
//   -DFAKE_NO_HOST_REGISTER  omit cudaHostRegister/cudaHostUnregister
//   -DFAKE_NO_EVENTS  omit the cudaEvent* functions and cudaLaunchHostFunc
// cudaIpc* are deliberately absent (exercise the symbol-missing path).
// Streams are asynchronous as on a GPU: each has a worker thread running its
// operations (copies, host functions, event records) in order, so work
// enqueued behind a host function that blocks waits for it, and an event
// completes when the operations recorded before it have run.
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

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
// ---- streams and events -------------------------------------------------
enum { OP_COPY, OP_HOSTFN, OP_RECORD };
struct fake_event;
typedef struct op {
	int kind;
	void *d;
	const void *s;
	size_t n;
	void (*fn)(void *);
	void *ud;
	struct fake_event *ev;
	unsigned long long seq;
	struct op *next;
} op_t;
typedef struct fake_stream {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	op_t *head, *tail;
	int busy, quit;
} fake_stream;
typedef struct fake_event {
	unsigned long long recorded, completed; // seq of the last record / the last one run
} fake_event;

// Stream threads may outlive a dlclose of this library (a stream destroyed
// with work still queued, as CUDA allows): the library pins itself in the
// process (RTLD_NODELETE) when it is loaded so their code stays mapped.
__attribute__((constructor)) static void pin_library(void) {
	Dl_info info;
	if (dladdr((void *)pin_library, &info) && info.dli_fname) dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

#define MAXS 256
static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_stream *streams[MAXS];
static fake_event *events[MAXS];

static int known(void **table, void *p) {
	int ok = 0;
	pthread_mutex_lock(&table_mu);
	for (int i = 0; i < MAXS && p; i++) if (table[i] == p) ok = 1;
	pthread_mutex_unlock(&table_mu);
	return ok;
}
static int add(void **table, void *p) {
	pthread_mutex_lock(&table_mu);
	for (int i = 0; i < MAXS; i++) if (!table[i]) { table[i] = p; pthread_mutex_unlock(&table_mu); return 0; }
	pthread_mutex_unlock(&table_mu);
	return 2;
}
static void drop(void **table, void *p) {
	pthread_mutex_lock(&table_mu);
	for (int i = 0; i < MAXS; i++) if (table[i] == p) table[i] = NULL;
	pthread_mutex_unlock(&table_mu);
}

static void *stream_worker(void *arg) {
	fake_stream *st = arg;
	pthread_mutex_lock(&st->mu);
	for (;;) {
		while (!st->head && !st->quit) pthread_cond_wait(&st->cv, &st->mu);
		if (!st->head) break; // quit and drained
		op_t *o = st->head;
		st->head = o->next;
		if (!st->head) st->tail = NULL;
		st->busy = 1;
		pthread_mutex_unlock(&st->mu);
		switch (o->kind) {
		case OP_COPY: memmove(o->d, o->s, o->n); break;
		case OP_HOSTFN: o->fn(o->ud); break;
		case OP_RECORD: __atomic_store_n(&o->ev->completed, o->seq, __ATOMIC_RELEASE); break;
		}
		free(o);
		pthread_mutex_lock(&st->mu);
		st->busy = 0;
		pthread_cond_broadcast(&st->cv);
	}
	pthread_mutex_unlock(&st->mu);
	pthread_mutex_destroy(&st->mu);
	pthread_cond_destroy(&st->cv);
	free(st);
	return NULL;
}

static int enqueue(void *stream, op_t o) {
	if (!known((void **)streams, stream)) return 400;
	fake_stream *st = stream;
	op_t *n = malloc(sizeof(*n));
	if (!n) return 2;
	*n = o;
	n->next = NULL;
	pthread_mutex_lock(&st->mu);
	if (st->tail) st->tail->next = n; else st->head = n;
	st->tail = n;
	pthread_cond_broadcast(&st->cv);
	pthread_mutex_unlock(&st->mu);
	return 0;
}

int cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, void *stream) {
	if (!stream) return 400;
	if (kind < 0 || kind > 4) return 21;
	op_t o = {OP_COPY, d, s, n};
	return enqueue(stream, o);
}
int cudaStreamCreateWithFlags(void **s, unsigned f) {
	fake_stream *st = calloc(1, sizeof(*st));
	if (!st) return 2;
	pthread_mutex_init(&st->mu, NULL);
	pthread_cond_init(&st->cv, NULL);
	pthread_t th;
	if (add((void **)streams, st) || pthread_create(&th, NULL, stream_worker, st)) {
		drop((void **)streams, st);
		free(st);
		return 2;
	}
	pthread_detach(th);
	*s = st;
	return 0;
}
static void stream_wait(fake_stream *st) {
	pthread_mutex_lock(&st->mu);
	while (st->head || st->busy) pthread_cond_wait(&st->cv, &st->mu);
	pthread_mutex_unlock(&st->mu);
}
int cudaStreamSynchronize(void *s) {
	if (!known((void **)streams, s)) return 400;
	stream_wait(s);
	return 0;
}
// As CUDA: destroy returns at once; work already enqueued still runs, then
// the worker frees the stream.
int cudaStreamDestroy(void *s) {
	if (!known((void **)streams, s)) return 400;
	drop((void **)streams, s);
	fake_stream *st = s;
	pthread_mutex_lock(&st->mu);
	st->quit = 1;
	pthread_cond_broadcast(&st->cv);
	pthread_mutex_unlock(&st->mu);
	return 0;
}
int cudaDeviceSynchronize(void) {
	fake_stream *all[MAXS];
	pthread_mutex_lock(&table_mu);
	memcpy(all, streams, sizeof(all));
	pthread_mutex_unlock(&table_mu);
	for (int i = 0; i < MAXS; i++) if (all[i] && known((void **)streams, all[i])) stream_wait(all[i]);
	return 0;
}
#ifndef FAKE_NO_EVENTS
int cudaEventCreateWithFlags(void **e, unsigned flags) {
	fake_event *ev = calloc(1, sizeof(*ev));
	if (!ev) return 2;
	if (add((void **)events, ev)) { free(ev); return 2; }
	*e = ev;
	return 0;
}
int cudaEventRecord(void *e, void *stream) {
	if (!known((void **)events, e)) return 400;
	fake_event *ev = e;
	op_t o = {OP_RECORD};
	o.ev = ev;
	o.seq = __atomic_add_fetch(&ev->recorded, 1, __ATOMIC_ACQ_REL);
	return enqueue(stream, o);
}
// cudaSuccess when every record has run (or there was none), else
// cudaErrorNotReady (600); an unknown handle is cudaErrorInvalidResourceHandle.
int cudaEventQuery(void *e) {
	if (!known((void **)events, e)) return 400;
	fake_event *ev = e;
	return __atomic_load_n(&ev->completed, __ATOMIC_ACQUIRE) == __atomic_load_n(&ev->recorded, __ATOMIC_ACQUIRE) ? 0 : 600;
}
int cudaEventSynchronize(void *e) {
	struct timespec ts = {0, 20000};
	int r;
	while ((r = cudaEventQuery(e)) == 600) nanosleep(&ts, NULL);
	return r;
}
int cudaEventDestroy(void *e) {
	if (!known((void **)events, e)) return 400;
	drop((void **)events, e); // kept allocated: a pending record still writes it
	return 0;
}
int cudaLaunchHostFunc(void *stream, void (*fn)(void *), void *ud) {
	if (!fn) return 1;
	op_t o = {OP_HOSTFN};
	o.fn = fn;
	o.ud = ud;
	return enqueue(stream, o);
}
#endif
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
