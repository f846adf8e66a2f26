//go:build cgo

package main

// Helpers the exports share: last-error recording, panic recovery and
// output-buffer copies. They call C, so this file has its own preamble.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"runtime/debug"
	"unsafe"
)

// finish records err as the calling thread's last error ("" on success) and
// returns its status code.
func finish(err error) C.int {
	if err == nil {
		C.kvx__set_last_error(nil, 0)
		return C.int(stOK)
	}
	msg := "kvxfer: " + err.Error()
	C.kvx__set_last_error((*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
	return C.int(codeOf(err))
}

// guard turns a panic inside an export into KVX_ERR_INTERNAL; deferred
// first thing in every export.
func guard(op string, rc *C.int) {
	if r := recover(); r != nil {
		*rc = finish(fail(stInternal, "%s: internal error (please report): %v\n%s", op, r, debug.Stack()))
	}
}

func nullArg(op, name string) error {
	return fail(stInvalidArgument, "%s: %s is NULL", op, name)
}

func badHandle(op, kind string, h uint64) error {
	if h == 0 {
		return fail(stBadHandle, "%s: %s handle is 0 (not created, or creation failed)", op, kind)
	}
	return fail(stBadHandle, "%s: %s handle %d is unknown or already destroyed", op, kind, h)
}

// writeOut copies data (plus a NUL when str) into buf[0:cap] and reports the
// needed size.
func writeOut(op string, data []byte, str bool, buf unsafe.Pointer, capacity C.size_t, needed *C.size_t) error {
	need := len(data)
	if str {
		need++
	}
	if needed != nil {
		*needed = C.size_t(need)
	}
	if buf == nil && capacity > 0 {
		return nullArg(op, "buf")
	}
	if int(capacity) < need {
		return fail(stBufferTooSmall, "%s: buffer of %d bytes is too small; %d needed", op, capacity, need)
	}
	out := unsafe.Slice((*byte)(buf), need)
	copy(out, data)
	if str {
		out[len(data)] = 0
	}
	return nil
}

func goStr(s *C.char) string {
	if s == nil {
		return ""
	}
	return C.GoString(s)
}
