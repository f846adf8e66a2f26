//go:build cgo

package main

// The //exports of layer-wise sending (issue 24): a prefill sends a room's
// KV layer range by layer range as its forward pass produces it, each
// range's writes optionally waiting for the CUDA event the caller recorded
// after that range's KV write.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"context"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// senderPages resolves a sender handle and copies its page list (n pages
// at pages), checking both; emptyOK says whether n may be 0.
func senderPages(op string, sender C.kvx_room_t, pages *C.int32_t, n C.uint32_t, emptyOK bool) (*roomObj, []int32, error) {
	r, ok := rooms.get(uint64(sender))
	switch {
	case !ok:
		return nil, nil, badHandle(op, "room", uint64(sender))
	case r.sender == nil:
		return nil, nil, fail(stInvalidArgument, "%s: handle %d is a receiver; only senders send", op, sender)
	case pages == nil && n > 0:
		return nil, nil, nullArg(op, "pages")
	case n == 0 && !emptyOK:
		return nil, nil, fail(stInvalidArgument, "%s: n is 0 pages and last is 0 (nothing to do)", op)
	case int64(n) > int64(r.kv.mgr.NumPages()):
		return nil, nil, fail(stInvalidArgument, "%s: n %d is more pages than the KV buffers hold (%d); nothing was read", op, n, r.kv.mgr.NumPages())
	}
	var ps []int32
	if n > 0 {
		ps = append(ps, unsafe.Slice((*int32)(unsafe.Pointer(pages)), int(n))...)
	}
	if err := checkPageList(op, ps, r.kv.mgr.NumPages()); err != nil {
		return nil, nil, err
	}
	return r, ps, nil
}

// sendErr is the status of a Send/SendLayers refusal: validation errors
// are invalid arguments (they never come from a transfer).
func sendErr(op string, err error) error {
	code := codeOf(err)
	if code == stTransferFailed {
		code = stInvalidArgument
	}
	return failWrap(code, err, "%s", op)
}

// eventDevice is the device a caller's CUDA event is queried on: the
// rank's gpu_id, else the device of its first CUDA KV buffer, else 0.
func eventDevice(m *engine.Manager) int {
	a := m.KVArgs()
	if a.GPUID >= 0 {
		return a.GPUID
	}
	for _, b := range a.KVBuffers {
		if b.Kind == transport.MemoryCUDA {
			return b.Device
		}
	}
	return 0
}

//export kvx_kv_sender_send_layers
func kvx_kv_sender_send_layers(sender C.kvx_room_t, pages *C.int32_t, n C.uint32_t, firstLayer, lastLayer C.uint32_t, cudaEvent unsafe.Pointer) (rc C.int) {
	const op = "kvx_kv_sender_send_layers"
	defer guard(op, &rc)
	r, ps, err := senderPages(op, sender, pages, n, true)
	if err != nil {
		return finish(err)
	}
	if firstLayer > 1<<20 || lastLayer > 1<<20 {
		return finish(fail(stInvalidArgument, "%s: layers %d..%d: over the limit of 2^20", op, firstLayer, lastLayer))
	}
	var after engine.Event
	if cudaEvent != nil {
		if err := cuda.Load(); err != nil {
			return finish(failWrap(stNotSupported, err, "%s: a CUDA event was given but CUDA cannot be loaded on this host (pass NULL to send at once)", op))
		}
		after = cuda.EventHandle{Device: eventDevice(r.kv.mgr), Event: uintptr(cudaEvent)}
	}
	if err := r.sender.SendLayers(ps, int(firstLayer), int(lastLayer), after); err != nil {
		return finish(sendErr(op, err))
	}
	return finish(nil)
}

//export kvx_kv_sender_flush
func kvx_kv_sender_flush(sender C.kvx_room_t, timeoutMS C.uint32_t) (rc C.int) {
	const op = "kvx_kv_sender_flush"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(sender))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(sender)))
	case r.sender == nil:
		return finish(fail(stInvalidArgument, "%s: handle %d is a receiver; only senders flush", op, sender))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMS)*time.Millisecond)
	defer cancel()
	if err := r.sender.Flush(ctx); err != nil {
		if ctx.Err() != nil && r.sender.Failure() == nil {
			return finish(failWrap(stTimeout, err, "%s: after %d ms", op, timeoutMS))
		}
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
}
