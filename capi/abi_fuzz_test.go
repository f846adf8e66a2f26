//go:build cgo

package main

import (
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/workload"
	"golang.org/x/sys/unix"
)

// batchABI is a tcp engine pair as two C callers would make it: target
// registered a region, the initiator registered its source memory and opened
// target's segment.
type batchABI struct {
	seg    uint64
	src    []byte // registered with the initiator
	dst    []byte // the target's region
	region uint32 // target's region id
}

func newBatchABI(tb testing.TB) *batchABI {
	tb.Helper()
	target, err := newEngine(engineConfig{role: 1, transport: "tcp"})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { target.close() })
	init, err := newEngine(engineConfig{role: 0, transport: "tcp"})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { init.close() })
	mmap := func(n int) []byte {
		m, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { unix.Munmap(m) })
		return m
	}
	dst, src := mmap(1<<16), mmap(1<<16)
	id, err := target.register(uintptr(unsafe.Pointer(&dst[0])), uint64(len(dst)), "host")
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := init.register(uintptr(unsafe.Pointer(&src[0])), uint64(len(src)), "host"); err != nil {
		tb.Fatal(err)
	}
	h, err := init.openSegmentName(1, target.te.Name())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if s, ok := segments.take(h); ok {
			s.close()
		}
	})
	return &batchABI{seg: h, src: src, dst: dst, region: uint32(id)}
}

// batch allocates a batch of capacity requests on env's segment; done
// waits for what was submitted to it and frees it, failing t when either
// does.
func (env *batchABI) batch(t *testing.T, capacity uint32) (b cBatch, done func()) {
	t.Helper()
	if rc := kvx_batch_alloc(cSegment(env.seg), cUint32(capacity), &b); rc != 0 {
		t.Fatalf("kvx_batch_alloc(%d) = %d", capacity, rc)
	}
	return b, func() {
		if rc := kvx_batch_wait(b, 30000); rc != 0 {
			t.Errorf("kvx_batch_wait = %d", rc)
		}
		if rc := kvx_batch_free(b); rc != 0 {
			t.Errorf("kvx_batch_free = %d", rc)
		}
	}
}

// submitWant is the status a submit of n requests into a batch of capacity
// with free of them unused returns: KVX_ERR_INVALID_ARGUMENT for n 0 or
// over the capacity, KVX_ERR_BUSY for n over what is free, else OK.
func submitWant(capacity, free, n uint32) int32 {
	switch {
	case n == 0 || n > capacity:
		return int32(stInvalidArgument)
	case n > free:
		return int32(stBusy)
	}
	return int32(stOK)
}

// guardedBytes returns n bytes that end where a PROT_NONE page begins: a
// read past them faults the process, so a test handing such an array to an
// export with a count past its end fails loudly if the export reads it.
// With n 0 the slice is empty and its data pointer is the guard page.
func guardedBytes(tb testing.TB, n int) []byte {
	tb.Helper()
	page := os.Getpagesize()
	size := (n + page - 1) / page * page
	if size == 0 {
		size = page
	}
	m, err := unix.Mmap(-1, 0, size+page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { unix.Munmap(m) })
	if err := unix.Mprotect(m[size:], unix.PROT_NONE); err != nil {
		tb.Fatal(err)
	}
	return m[size-n : size+page][:n] // cap reaches into the guard page: its data pointer is valid even for n 0
}

// guarded is guardedBytes for k write requests: the address of the first
// (the guard page when k is 0) and the k requests.
func guarded(tb testing.TB, k int) (*cWriteRequest, []cWriteRequest) {
	tb.Helper()
	b := guardedBytes(tb, k*int(unsafe.Sizeof(cWriteRequest{})))
	first := (*cWriteRequest)(unsafe.Pointer(unsafe.SliceData(b)))
	return first, unsafe.Slice(first, k)
}

// FuzzBatchSubmitArgs drives kvx_batch_alloc / kvx_batch_submit as a C
// caller may: a batch of capacity requests, pre of them submitted, then a
// submit of n requests from an array that holds exactly the free capacity
// and ends at a guard page. An n over the capacity is
// KVX_ERR_INVALID_ARGUMENT, an n over what is free KVX_ERR_BUSY, both
// without reading the array (before the fix the capacity check came after
// the copy, which faulted on the guard page); the rest is sent.
func FuzzBatchSubmitArgs(f *testing.F) {
	f.Add(uint32(4), uint32(0), uint32(4))
	f.Add(uint32(4), uint32(0), uint32(5))
	f.Add(uint32(1), uint32(0), uint32(1<<20))
	f.Add(uint32(8), uint32(6), uint32(3))
	f.Add(uint32(8), uint32(8), uint32(1))
	f.Add(uint32(3), uint32(1), uint32(0))
	f.Add(uint32(64), uint32(0), uint32(0xFFFFFFFF))
	f.Add(uint32(3), uint32(3), uint32(2)) // capacity 4, 3 submitted, n 2 > the 1 free: KVX_ERR_BUSY
	env := newBatchABI(f)
	f.Fuzz(func(t *testing.T, capacity, pre, n uint32) {
		capacity = 1 + capacity%64
		pre %= capacity + 1
		b, done := env.batch(t, capacity)
		defer done()
		fill := func(rs []cWriteRequest) {
			for i := range rs {
				rs[i] = cWriteRequest{local_addr: cUint64(uintptr(unsafe.Pointer(&env.src[0])) + uintptr(i*64)),
					remote_offset: cUint64(i * 64), length: 64, remote_region: cUint32(env.region), count: 1}
			}
		}
		if pre > 0 {
			p, first := guarded(t, int(pre))
			fill(first)
			if rc := kvx_batch_submit(b, p, cUint32(pre)); rc != 0 {
				t.Fatalf("first submit of %d into capacity %d = %d", pre, capacity, rc)
			}
		}
		free := capacity - pre
		p, arr := guarded(t, int(free))
		fill(arr)
		want := submitWant(capacity, free, n)
		if rc := kvx_batch_submit(b, p, cUint32(n)); int32(rc) != want {
			t.Fatalf("capacity %d, %d submitted, n %d: rc %d, want %d", capacity, pre, n, rc, want)
		}
	})
}

// TestPageListsCheckedBeforeRead: a page count past the KV buffers' pages
// is refused before the caller's list is read (the list here ends at a
// guard page, so a read past it faults the test), for the sender's two page
// exports and the receiver's.
func TestPageListsCheckedBeforeRead(t *testing.T) {
	const pool = 4
	kc := kvConfig{modelName: "llama-3.1-8b", layout: workload.LayoutOptions{PageSize: 16, NumPages: pool},
		bootstrapTimeout: 3 * time.Second, waitingTimeout: 3 * time.Second}
	pages := func(n int) *cInt32 {
		b := guardedBytes(t, 4*n)
		return (*cInt32)(unsafe.Pointer(unsafe.SliceData(b)))
	}
	srv, _ := directoryAndEngine(t, "")
	eng := func(role int32) *engineObj {
		e, err := newEngine(engineConfig{role: role, transport: "tcp", bootstrapAddr: srv.Addr()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.close() })
		return e
	}
	pk, err := newKV(eng(0), kc)
	if err != nil {
		t.Fatal(err)
	}
	ph := kvs.add(pk)
	t.Cleanup(func() { kvx_kv_destroy(cKV(ph)) })
	var s cRoom
	if rc := kvx_kv_sender_create(cKV(ph), 7, &s); rc != 0 {
		t.Fatalf("kvx_kv_sender_create = %d", rc)
	}
	if rc := kvx_kv_sender_send(s, pages(pool), pool+1, 1); int32(rc) != int32(stInvalidArgument) {
		t.Errorf("kvx_kv_sender_send of %d pages from a %d-page pool: rc %d, want KVX_ERR_INVALID_ARGUMENT", pool+1, pool, rc)
	}
	if rc := kvx_kv_sender_send_layers(s, pages(0), 1<<30, 0, 0, nil); int32(rc) != int32(stInvalidArgument) {
		t.Errorf("kvx_kv_sender_send_layers of 2^30 pages: rc %d, want KVX_ERR_INVALID_ARGUMENT", rc)
	}

	dk, err := newKV(eng(1), kc)
	if err != nil {
		t.Fatal(err)
	}
	dh := kvs.add(dk)
	t.Cleanup(func() { kvx_kv_destroy(cKV(dh)) })
	var r cRoom
	if rc := kvx_kv_receiver_create(cKV(dh), nil, 7, &r); rc != 0 {
		t.Fatalf("kvx_kv_receiver_create = %d", rc)
	}
	if rc := kvx_kv_receiver_init(r, pages(pool), pool+1); int32(rc) != int32(stInvalidArgument) {
		t.Errorf("kvx_kv_receiver_init of %d pages into a %d-page pool: rc %d, want KVX_ERR_INVALID_ARGUMENT", pool+1, pool, rc)
	}
}

// FuzzBatchSubmitSoAArgs is FuzzBatchSubmitArgs for kvx_batch_submit_soa:
// the three arrays hold exactly the free capacity and end at guard pages;
// an n over the capacity is KVX_ERR_INVALID_ARGUMENT, an n over what is
// free KVX_ERR_BUSY, both without reading them; the rest is sent. Entry
// bad (a length 0 at a fuzzed index) is KVX_ERR_INVALID_ARGUMENT with
// nothing sent.
func FuzzBatchSubmitSoAArgs(f *testing.F) {
	f.Add(uint32(4), uint32(0), uint32(4), uint32(99))
	f.Add(uint32(4), uint32(0), uint32(5), uint32(99))
	f.Add(uint32(8), uint32(6), uint32(3), uint32(1))
	f.Add(uint32(3), uint32(1), uint32(0), uint32(0))
	f.Add(uint32(64), uint32(0), uint32(0xFFFFFFFF), uint32(7))
	f.Add(uint32(3), uint32(3), uint32(2), uint32(5)) // capacity 4, 3 submitted, n 2 > the 1 free: KVX_ERR_BUSY
	env := newBatchABI(f)
	arrays := func(t *testing.T, k int, bad uint32) (*cUint64, *cUint64, *cUint64) {
		mk := func() []uint64 {
			b := guardedBytes(t, 8*k)
			return unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), k)
		}
		l, r, n := mk(), mk(), mk()
		for i := 0; i < k; i++ {
			l[i], r[i], n[i] = uint64(uintptr(unsafe.Pointer(&env.src[0])))+uint64(i*64), uint64(i*64), 64
			if uint32(i) == bad {
				n[i] = 0
			}
		}
		p := func(s []uint64) *cUint64 { return (*cUint64)(unsafe.Pointer(unsafe.SliceData(s))) }
		return p(l), p(r), p(n)
	}
	f.Fuzz(func(t *testing.T, capacity, pre, n, bad uint32) {
		capacity = 1 + capacity%64
		pre %= capacity + 1
		b, done := env.batch(t, capacity)
		defer done()
		if pre > 0 {
			l, r, k := arrays(t, int(pre), ^uint32(0))
			if rc := kvx_batch_submit_soa(b, cUint32(pre), l, r, k, cUint32(env.region)); rc != 0 {
				t.Fatalf("first submit of %d into capacity %d = %d", pre, capacity, rc)
			}
		}
		free := capacity - pre
		l, r, k := arrays(t, int(free), bad)
		want := submitWant(capacity, free, n)
		if want == int32(stOK) && bad < n {
			want = int32(stInvalidArgument)
		}
		if rc := kvx_batch_submit_soa(b, cUint32(n), l, r, k, cUint32(env.region)); int32(rc) != want {
			t.Fatalf("capacity %d, %d submitted, n %d, zero length at %d: rc %d, want %d", capacity, pre, n, bad, rc, want)
		}
	})
}
