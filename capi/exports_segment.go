//go:build cgo

package main

// The //exports of segments (Mooncake-style named segments) and transfer
// batches.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"context"
	"sort"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

//export kvx_segment_export
func kvx_segment_export(eng C.kvx_engine_t, peer *C.char, buf unsafe.Pointer, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_segment_export"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	p := goStr(peer)
	if p == "" {
		p = "peer"
	}
	blob, err := e.exportSegment(p)
	if err != nil {
		return finish(err)
	}
	return finish(writeOut(op, blob, false, buf, capacity, needed))
}

//export kvx_segment_open
func kvx_segment_open(eng C.kvx_engine_t, blob unsafe.Pointer, length C.size_t, out *C.kvx_segment_t) (rc C.int) {
	const op = "kvx_segment_open"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	switch {
	case !ok:
		return finish(badHandle(op, "engine", uint64(eng)))
	case blob == nil:
		return finish(nullArg(op, "blob"))
	case length == 0:
		return finish(fail(stInvalidArgument, "%s: len is 0 bytes", op))
	case length > maxSegmentDesc:
		return finish(fail(stInvalidArgument, "%s: len %d bytes is over the %d-byte descriptor limit", op, length, maxSegmentDesc))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	h, err := e.openSegment(uint64(eng), C.GoBytes(blob, C.int(length)))
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_segment_t(h)
	return finish(nil)
}

//export kvx_segment_open_name
func kvx_segment_open_name(eng C.kvx_engine_t, name *C.char, out *C.kvx_segment_t) (rc C.int) {
	const op = "kvx_segment_open_name"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	switch {
	case !ok:
		return finish(badHandle(op, "engine", uint64(eng)))
	case name == nil:
		return finish(nullArg(op, "name"))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	h, err := e.openSegmentName(uint64(eng), goStr(name))
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_segment_t(h)
	return finish(nil)
}

//export kvx_segment_regions
func kvx_segment_regions(seg C.kvx_segment_t, out *C.kvx_region_info, capacity C.uint32_t, n *C.uint32_t) (rc C.int) {
	const op = "kvx_segment_regions"
	defer guard(op, &rc)
	s, ok := segments.get(uint64(seg))
	switch {
	case !ok:
		return finish(badHandle(op, "segment", uint64(seg)))
	case n == nil:
		return finish(nullArg(op, "n"))
	case out == nil && capacity > 0:
		return finish(nullArg(op, "out"))
	}
	regs := s.seg.Descriptor().Regions
	sort.Slice(regs, func(i, j int) bool { return regs[i].ID < regs[j].ID })
	*n = C.uint32_t(len(regs))
	if capacity > 0 {
		dst := unsafe.Slice(out, int(capacity))
		for i := 0; i < len(regs) && i < int(capacity); i++ {
			dst[i] = C.kvx_region_info{addr: C.uint64_t(regs[i].Addr), length: C.uint64_t(regs[i].Length),
				region: C.uint32_t(regs[i].ID), kind: C.int32_t(regs[i].Kind)}
		}
	}
	return finish(nil)
}

//export kvx_segment_refresh
func kvx_segment_refresh(seg C.kvx_segment_t) (rc C.int) {
	const op = "kvx_segment_refresh"
	defer guard(op, &rc)
	s, ok := segments.get(uint64(seg))
	if !ok {
		return finish(badHandle(op, "segment", uint64(seg)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.eng.timeout)
	defer cancel()
	if err := s.seg.Refresh(ctx); err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_segment_read
func kvx_segment_read(seg C.kvx_segment_t, reqs *C.kvx_write_request, n C.uint32_t, timeoutMS C.uint32_t) (rc C.int) {
	const op = "kvx_segment_read"
	defer guard(op, &rc)
	s, ok := segments.get(uint64(seg))
	switch {
	case !ok:
		return finish(badHandle(op, "segment", uint64(seg)))
	case reqs == nil:
		return finish(nullArg(op, "reqs"))
	case n == 0:
		return finish(fail(stInvalidArgument, "%s: n is 0 requests", op))
	case n > maxBatchCapacity:
		return finish(fail(stInvalidArgument, "%s: n %d is over the limit of %d requests", op, n, maxBatchCapacity))
	}
	rr := requests(unsafe.Slice(reqs, int(n)))
	timeout := s.eng.timeout
	if timeoutMS > 0 {
		timeout = time.Duration(timeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := s.resolve(ctx, op, transport.OpRead, rr); err != nil {
		return finish(err)
	}
	if err := s.seg.ReadRegions(ctx, rr); err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
}

// requests copies C requests into transport requests (the caller's array is
// not kept).
func requests(in []C.kvx_write_request) []transport.WriteRequest {
	out := make([]transport.WriteRequest, len(in))
	for i, r := range in {
		out[i] = transport.WriteRequest{
			Local:        uintptr(r.local_addr),
			Remote:       transport.RegionID(r.remote_region),
			RemoteOffset: uint64(r.remote_offset),
			Length:       uint64(r.length),
			Count:        uint32(r.count),
			LocalStride:  uint64(r.local_stride),
			RemoteStride: uint64(r.remote_stride),
		}
	}
	return out
}

//export kvx_segment_close
func kvx_segment_close(seg C.kvx_segment_t) (rc C.int) {
	const op = "kvx_segment_close"
	defer guard(op, &rc)
	s, ok := segments.take(uint64(seg))
	if !ok {
		return finish(badHandle(op, "segment", uint64(seg)))
	}
	s.eng.mu.Lock()
	delete(s.eng.segments, uint64(seg))
	s.eng.mu.Unlock()
	return finish(s.close())
}

// maxBatchCapacity bounds kvx_batch_alloc's capacity (requests).
const maxBatchCapacity = 1 << 20

//export kvx_batch_alloc
func kvx_batch_alloc(seg C.kvx_segment_t, capacity C.uint32_t, out *C.kvx_batch_t) (rc C.int) {
	const op = "kvx_batch_alloc"
	defer guard(op, &rc)
	s, ok := segments.get(uint64(seg))
	switch {
	case !ok:
		return finish(badHandle(op, "segment", uint64(seg)))
	case capacity == 0:
		return finish(fail(stInvalidArgument, "%s: capacity is 0 requests", op))
	case capacity > maxBatchCapacity:
		return finish(fail(stInvalidArgument, "%s: capacity %d is over the limit of %d requests", op, capacity, maxBatchCapacity))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return finish(fail(stClosed, "%s: segment %d is closed", op, seg))
	}
	h := batches.add(&batchObj{seg: s, capacity: uint32(capacity)})
	s.batches[h] = struct{}{}
	*out = C.kvx_batch_t(h)
	return finish(nil)
}

//export kvx_batch_submit
func kvx_batch_submit(batch C.kvx_batch_t, reqs *C.kvx_write_request, n C.uint32_t) (rc C.int) {
	const op = "kvx_batch_submit"
	defer guard(op, &rc)
	return finish(batchSubmit(op, batch, reqs, n, transport.OpWrite))
}

//export kvx_batch_submit_read
func kvx_batch_submit_read(batch C.kvx_batch_t, reqs *C.kvx_write_request, n C.uint32_t) (rc C.int) {
	const op = "kvx_batch_submit_read"
	defer guard(op, &rc)
	return finish(batchSubmit(op, batch, reqs, n, transport.OpRead))
}

//export kvx_batch_submit_soa
func kvx_batch_submit_soa(batch C.kvx_batch_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t) (rc C.int) {
	const op = "kvx_batch_submit_soa"
	defer guard(op, &rc)
	return finish(batchSubmitSoA(op, batch, n, localAddrs, remoteOffsets, lengths, remoteRegion, transport.OpWrite))
}

//export kvx_batch_submit_read_soa
func kvx_batch_submit_read_soa(batch C.kvx_batch_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t) (rc C.int) {
	const op = "kvx_batch_submit_read_soa"
	defer guard(op, &rc)
	return finish(batchSubmitSoA(op, batch, n, localAddrs, remoteOffsets, lengths, remoteRegion, transport.OpRead))
}

// batchSubmitSoA checks the arguments of kvx_batch_submit_soa / _read_soa
// (fn) and submits the n entries of the three arrays (read in place, not
// kept) as one transfer batch of dir.
func batchSubmitSoA(fn string, batch C.kvx_batch_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t, dir transport.Op) error {
	b, ok := batches.get(uint64(batch))
	switch {
	case !ok:
		return badHandle(fn, "batch", uint64(batch))
	case n == 0:
		return fail(stInvalidArgument, "%s: n is 0 requests", fn)
	case uint32(n) > b.capacity:
		return fail(stInvalidArgument, "%s: n %d is over the batch capacity of %d requests (kvx_batch_alloc's capacity); nothing was read", fn, n, b.capacity)
	}
	e, err := soaEntries(fn, n, localAddrs, remoteOffsets, lengths, remoteRegion)
	if err != nil {
		return err
	}
	return b.submitEntries(fn, uint64(batch), dir, e)
}

// soaEntries views the caller's three struct-of-arrays columns of n
// requests (local addresses, remote offsets, lengths in bytes; C memory the
// caller keeps for the call) as segengine.Entries into remoteRegion, after
// checking that none is NULL (stInvalidArgument naming the column). n is
// checked by the caller against its batch's capacity first.
func soaEntries(fn string, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t) (segengine.Entries, error) {
	switch {
	case localAddrs == nil:
		return segengine.Entries{}, nullArg(fn, "local_addrs")
	case remoteOffsets == nil:
		return segengine.Entries{}, nullArg(fn, "remote_offsets")
	case lengths == nil:
		return segengine.Entries{}, nullArg(fn, "lengths")
	}
	return segengine.Entries{
		Local:  unsafe.Slice((*uint64)(unsafe.Pointer(localAddrs)), int(n)),
		Remote: unsafe.Slice((*uint64)(unsafe.Pointer(remoteOffsets)), int(n)),
		Length: unsafe.Slice((*uint64)(unsafe.Pointer(lengths)), int(n)),
		Region: transport.RegionID(remoteRegion),
	}, nil
}

// batchSubmit checks the arguments of kvx_batch_submit / _read (fn) and
// submits the requests as one transfer batch of dir.
func batchSubmit(fn string, batch C.kvx_batch_t, reqs *C.kvx_write_request, n C.uint32_t, dir transport.Op) error {
	b, ok := batches.get(uint64(batch))
	switch {
	case !ok:
		return badHandle(fn, "batch", uint64(batch))
	case reqs == nil:
		return nullArg(fn, "reqs")
	case n == 0:
		return fail(stInvalidArgument, "%s: n is 0 requests", fn)
	case uint32(n) > b.capacity:
		return fail(stInvalidArgument, "%s: n %d is over the batch capacity of %d requests (kvx_batch_alloc's capacity); nothing was read", fn, n, b.capacity)
	}
	// The caller's array is read only once n fits in what is left of the
	// batch: an n past its capacity says nothing about the array's length.
	if free := b.free(); uint32(n) > free {
		return fail(stBusy, "%s: %d requests do not fit: batch capacity %d, %d free (allocate a larger batch); nothing was read", fn, n, b.capacity, free)
	}
	in := unsafe.Slice(reqs, int(n))
	if e, ok := asEntries(in); ok {
		// One block each, one remote region: the struct-of-arrays path
		// (cached region lookups, coalesced while translated).
		return b.submitEntries(fn, uint64(batch), dir, e)
	}
	return b.submit(fn, uint64(batch), dir, requests(in))
}

// asEntries returns the requests as struct-of-arrays entries when every one
// is a single block (count 0 or 1) addressed to the same remote region (or
// all by peer address); false otherwise.
func asEntries(in []C.kvx_write_request) (segengine.Entries, bool) {
	if len(in) < 2 {
		return segengine.Entries{}, false
	}
	region := in[0].remote_region
	for i := range in {
		if in[i].count > 1 || in[i].remote_region != region {
			return segengine.Entries{}, false
		}
	}
	e := segengine.Entries{Local: make([]uint64, len(in)), Remote: make([]uint64, len(in)), Length: make([]uint64, len(in)), Region: transport.RegionID(region)}
	for i := range in {
		e.Local[i], e.Remote[i], e.Length[i] = uint64(in[i].local_addr), uint64(in[i].remote_offset), uint64(in[i].length)
	}
	return e, true
}

//export kvx_batch_status
func kvx_batch_status(batch C.kvx_batch_t, index C.uint32_t, out *C.kvx_transfer_status) (rc C.int) {
	const op = "kvx_batch_status"
	defer guard(op, &rc)
	b, ok := batches.get(uint64(batch))
	switch {
	case !ok:
		return finish(badHandle(op, "batch", uint64(batch)))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	state, code, bytes, err := b.status(uint32(index))
	if err != nil {
		return finish(err)
	}
	out.state = C.int32_t(state)
	out.error = C.int32_t(code)
	out.bytes_done = C.uint64_t(bytes)
	return finish(nil)
}

//export kvx_batch_wait
func kvx_batch_wait(batch C.kvx_batch_t, timeoutMS C.uint32_t) (rc C.int) {
	const op = "kvx_batch_wait"
	defer guard(op, &rc)
	b, ok := batches.get(uint64(batch))
	if !ok {
		return finish(badHandle(op, "batch", uint64(batch)))
	}
	return finish(b.wait(time.Duration(timeoutMS) * time.Millisecond))
}

//export kvx_batch_cancel
func kvx_batch_cancel(batch C.kvx_batch_t) (rc C.int) {
	const op = "kvx_batch_cancel"
	defer guard(op, &rc)
	b, ok := batches.get(uint64(batch))
	if !ok {
		return finish(badHandle(op, "batch", uint64(batch)))
	}
	return finish(b.cancelAll())
}

//export kvx_batch_free
func kvx_batch_free(batch C.kvx_batch_t) (rc C.int) {
	const op = "kvx_batch_free"
	defer guard(op, &rc)
	b, ok := batches.get(uint64(batch))
	if !ok {
		return finish(badHandle(op, "batch", uint64(batch)))
	}
	if !b.markFreed() {
		return finish(fail(stBusy, "%s: batch %d still has pending requests; wait for them (kvx_batch_wait) or cancel them first", op, batch))
	}
	if _, ok := batches.take(uint64(batch)); !ok {
		return finish(badHandle(op, "batch", uint64(batch)))
	}
	b.seg.mu.Lock()
	delete(b.seg.batches, uint64(batch))
	b.seg.mu.Unlock()
	b.release()
	return finish(nil)
}

//export kvx_segment_write_soa
func kvx_segment_write_soa(seg C.kvx_segment_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t, timeoutMS C.uint32_t) (rc C.int) {
	const op = "kvx_segment_write_soa"
	defer guard(op, &rc)
	return finish(segmentSyncSoA(op, seg, n, localAddrs, remoteOffsets, lengths, remoteRegion, timeoutMS, transport.OpWrite))
}

//export kvx_segment_read_soa
func kvx_segment_read_soa(seg C.kvx_segment_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion C.uint32_t, timeoutMS C.uint32_t) (rc C.int) {
	const op = "kvx_segment_read_soa"
	defer guard(op, &rc)
	return finish(segmentSyncSoA(op, seg, n, localAddrs, remoteOffsets, lengths, remoteRegion, timeoutMS, transport.OpRead))
}

// segmentSyncSoA is kvx_segment_write_soa / _read_soa (fn): the n entries
// of the three arrays (read in place, not kept) as one engine batch of
// dir, waited for on the calling goroutine and released. It is the batch
// path (kvx_batch_alloc, kvx_batch_submit_soa, kvx_batch_wait,
// kvx_batch_free) in one call: one entry into Go instead of four, no batch
// handle, no tracking goroutine and no notification per call. On timeout
// the batch is canceled and the call returns KVX_ERR_TIMEOUT; a read is
// first waited for (up to cancelWait) so no byte lands after it returns
// (the message says so when it did not stop in that time).
func segmentSyncSoA(fn string, seg C.kvx_segment_t, n C.uint32_t, localAddrs, remoteOffsets, lengths *C.uint64_t, remoteRegion, timeoutMS C.uint32_t, dir transport.Op) error {
	s, ok := segments.get(uint64(seg))
	switch {
	case !ok:
		return badHandle(fn, "segment", uint64(seg))
	case n == 0:
		return fail(stInvalidArgument, "%s: n is 0 requests", fn)
	case n > maxBatchCapacity:
		return fail(stInvalidArgument, "%s: n %d is over the limit of %d requests", fn, n, maxBatchCapacity)
	}
	e, err := soaEntries(fn, n, localAddrs, remoteOffsets, lengths, remoteRegion)
	if err != nil {
		return err
	}
	timeout := s.eng.timeout
	if timeoutMS > 0 {
		timeout = time.Duration(timeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	id, err := s.seg.SubmitEntries(ctx, dir, e)
	if err != nil {
		return failWrap(stOK, err, "%s: submit %d %s requests", fn, n, dir)
	}
	st, err := s.seg.Wait(ctx, id)
	if err != nil && !st.State.Terminal() {
		if s2, err2 := s.seg.Poll(id); err2 == nil && s2.State.Terminal() {
			st = s2
		} else {
			_ = s.seg.Cancel(id) // best effort; what follows checks whether it stopped
			if dir == transport.OpRead {
				// No byte may land in local memory after the call: wait
				// for the canceled read to stop.
				wctx, wcancel := context.WithTimeout(context.Background(), cancelWait)
				st, err = s.seg.Wait(wctx, id)
				wcancel()
				if err == nil || st.State.Terminal() {
					s.seg.Release(id)
					return fail(stTimeout, "%s: %d %s requests not done after %v; canceled", fn, n, dir, timeout)
				}
			}
			// A write (as kvx_batch_cancel: it may still land) or a read
			// that did not stop: released once terminal, which the
			// transport's own peer-loss deadline bounds.
			go func() {
				_, _ = s.seg.Wait(context.Background(), id)
				s.seg.Release(id)
			}()
			if dir == transport.OpRead {
				return fail(stTimeout, "%s: %d %s requests not done after %v and still running %v after being canceled; the memory may still be written until the peer is declared lost", fn, n, dir, timeout, cancelWait)
			}
			return fail(stTimeout, "%s: %d %s requests not done after %v; canceled", fn, n, dir, timeout)
		}
	}
	s.seg.Release(id)
	if st.State != transport.BatchCompleted {
		code := codeOf(st.Err)
		if st.State == transport.BatchCanceled {
			code = stCanceled
		}
		return failWrap(code, st.Err, "%s: %d %s requests %s", fn, n, dir, st.State)
	}
	return nil
}

// cancelWait bounds how long a timed-out kvx_segment_read_soa waits for
// its canceled batch to stop.
const cancelWait = 10 * time.Second
