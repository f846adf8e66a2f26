//go:build cgo

package main

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
const char *kvx_last_error(void); // lasterror.c (the prototypes are left out here)
*/
import "C"

// Go names of the C ABI's argument types, for the package's tests: a
// _test.go file cannot import "C", so the tests that call the exports as a
// C caller would (abi_fuzz_test.go) build their arguments with these.
type (
	cBatch        = C.kvx_batch_t
	cSegment      = C.kvx_segment_t
	cWriteRequest = C.kvx_write_request
	cUint32       = C.uint32_t
	cUint64       = C.uint64_t
	cKV           = C.kvx_kv_t
	cRoom         = C.kvx_room_t
	cInt32        = C.int32_t
	cEngine       = C.kvx_engine_t
	cRegion       = C.kvx_region_t
	cHostBuf      = C.kvx_hostbuf_t
	cTransferStat = C.kvx_transfer_status
)

// lastErrorText is kvx_last_error() of the calling thread, for the tests.
func lastErrorText() string { return C.GoString(C.kvx_last_error()) }
