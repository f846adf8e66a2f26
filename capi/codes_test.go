//go:build cgo

package main

import (
	"testing"
	"unsafe"
)

// TestDocumentedReturnCodes calls the exports as a C caller would, in the
// cases whose code include/kvxfer.h names, and checks each code.
func TestDocumentedReturnCodes(t *testing.T) {
	env := newBatchABI(t)
	e, err := newEngine(engineConfig{role: 0, transport: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	eh := cEngine(engines.add(e))
	t.Cleanup(func() { kvx_engine_destroy(eh) })
	want := func(what string, rc, code int32) {
		t.Helper()
		if rc != code {
			t.Errorf("%s: rc %d (%s), want %d (%s)", what, rc, statusNames[status(rc)], code, statusNames[status(code)])
		}
	}

	// kvx_free_host: KVX_ERR_BUSY while registered, then OK, then BAD_HANDLE.
	var hb cHostBuf
	var addr unsafe.Pointer
	var n cUint64
	want("kvx_alloc_host", int32(kvx_alloc_host(nil, 4096, &hb, &addr, &n)), int32(stOK))
	var region cRegion
	want("kvx_register_memory", int32(kvx_register_memory(eh, addr, n, nil, &region)), int32(stOK))
	want("kvx_register_memory overlapping", int32(kvx_register_memory(eh, addr, n, nil, &region)), int32(stInvalidArgument))
	want("kvx_register_memory len 0", int32(kvx_register_memory(eh, addr, 0, nil, &region)), int32(stInvalidArgument))
	want("kvx_free_host while registered", int32(kvx_free_host(hb)), int32(stBusy))
	want("kvx_deregister_memory", int32(kvx_deregister_memory(eh, region)), int32(stOK))
	want("kvx_deregister_memory again", int32(kvx_deregister_memory(eh, region)), int32(stUnknownRegion))
	want("kvx_free_host", int32(kvx_free_host(hb)), int32(stOK))
	want("kvx_free_host again", int32(kvx_free_host(hb)), int32(stBadHandle))

	// kvx_batch_status past the capacity; kvx_batch_wait(0) of a finished
	// batch is KVX_OK every time (it raced the expired timer before).
	var b cBatch
	want("kvx_batch_alloc", int32(kvx_batch_alloc(cSegment(env.seg), 2, &b)), int32(stOK))
	p, rs := guarded(t, 1)
	rs[0] = cWriteRequest{local_addr: cUint64(uintptr(unsafe.Pointer(&env.src[0]))), length: 64, remote_region: cUint32(env.region), count: 1}
	want("kvx_batch_submit", int32(kvx_batch_submit(b, p, 1)), int32(stOK))
	want("kvx_batch_wait", int32(kvx_batch_wait(b, 30000)), int32(stOK))
	for i := 0; i < 200; i++ {
		if rc := kvx_batch_wait(b, 0); rc != 0 {
			t.Fatalf("kvx_batch_wait(0) of a completed batch, try %d: rc %d, want KVX_OK", i, rc)
		}
	}
	var st cTransferStat
	want("kvx_batch_status index 1 (not submitted)", int32(kvx_batch_status(b, 1, &st)), int32(stOK))
	if st.state != 0 {
		t.Errorf("kvx_batch_status of an index not submitted: state %d, want KVX_TRANSFER_EMPTY", st.state)
	}
	want("kvx_batch_status past the capacity", int32(kvx_batch_status(b, 2, &st)), int32(stInvalidArgument))
	want("kvx_batch_free", int32(kvx_batch_free(b)), int32(stOK))
	want("kvx_batch_free again", int32(kvx_batch_free(b)), int32(stBadHandle))
}
