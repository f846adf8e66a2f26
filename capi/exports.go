//go:build cgo

package main

// Every //export of the C ABI, and nothing else. The preamble only includes
// the header's types (KVX_TYPES_ONLY): cgo writes its own prototypes, which
// drop `const`. header_test.go checks these names against include/kvxfer.h.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sort"
	"strconv"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

//export kvx_bootstrap_start
func kvx_bootstrap_start(host *C.char, port C.uint16_t, out *C.kvx_bootstrap_t) (rc C.int) {
	defer guard("kvx_bootstrap_start", &rc)
	if out == nil {
		return finish(nullArg("kvx_bootstrap_start", "out"))
	}
	b, err := startBootstrap(goStr(host), int(port))
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_bootstrap_t(bootstraps.add(b))
	return finish(nil)
}

//export kvx_bootstrap_addr
func kvx_bootstrap_addr(server C.kvx_bootstrap_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard("kvx_bootstrap_addr", &rc)
	b, ok := bootstraps.get(uint64(server))
	if !ok {
		return finish(badHandle("kvx_bootstrap_addr", "bootstrap", uint64(server)))
	}
	return finish(writeOut("kvx_bootstrap_addr", []byte(b.srv.Addr()), true, unsafe.Pointer(buf), capacity, needed))
}

//export kvx_bootstrap_stop
func kvx_bootstrap_stop(server C.kvx_bootstrap_t) (rc C.int) {
	defer guard("kvx_bootstrap_stop", &rc)
	b, ok := bootstraps.take(uint64(server))
	if !ok {
		return finish(badHandle("kvx_bootstrap_stop", "bootstrap", uint64(server)))
	}
	return finish(b.stop())
}

//export kvx_engine_create
func kvx_engine_create(cfg *C.kvx_engine_config, out *C.kvx_engine_t) (rc C.int) {
	const op = "kvx_engine_create"
	defer guard(op, &rc)
	if cfg == nil {
		return finish(nullArg(op, "cfg"))
	}
	if out == nil {
		return finish(nullArg(op, "out"))
	}
	if cfg.struct_size < C.KVX_ENGINE_CONFIG_SIZE_V1 || uintptr(cfg.struct_size) > unsafe.Sizeof(*cfg) {
		return finish(fail(stInvalidArgument, "%s: cfg->struct_size is %d, want sizeof(kvx_engine_config) = %d (or %d from a 0.1 header); zero-initialise the struct and set struct_size", op, cfg.struct_size, unsafe.Sizeof(*cfg), C.KVX_ENGINE_CONFIG_SIZE_V1))
	}
	ec := engineConfig{
		role:          int32(cfg.role),
		transport:     goStr(cfg.transport),
		listenHost:    goStr(cfg.listen_host),
		listenPort:    int(cfg.listen_port),
		bootstrapAddr: goStr(cfg.bootstrap_addr),
		streams:       int(cfg.streams),
	}
	// Fields appended after 0.1: read only what the caller's struct holds.
	has := func(off, size uintptr) bool { return uintptr(cfg.struct_size) >= off+size }
	metaSet := false
	if has(unsafe.Offsetof(cfg.local_hostname), unsafe.Sizeof(cfg.local_hostname)) {
		ec.localHostname = goStr(cfg.local_hostname)
	}
	if has(unsafe.Offsetof(cfg.metadata_server), unsafe.Sizeof(cfg.metadata_server)) && cfg.metadata_server != nil {
		ec.metadataServer, metaSet = goStr(cfg.metadata_server), true
	}
	if has(unsafe.Offsetof(cfg.segment_name), unsafe.Sizeof(cfg.segment_name)) {
		ec.segmentName = goStr(cfg.segment_name)
	}
	if has(unsafe.Offsetof(cfg.rpc_timeout_ms), unsafe.Sizeof(cfg.rpc_timeout_ms)) {
		ec.rpcTimeout = time.Duration(cfg.rpc_timeout_ms) * time.Millisecond
	}
	if has(unsafe.Offsetof(cfg.devices), unsafe.Sizeof(cfg.devices)) {
		ec.devices = splitDevices(goStr(cfg.devices))
	}
	if !metaSet {
		ec.metadataServer = getenv("KVXFER_METADATA")
	}
	e, err := newEngine(ec)
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_engine_t(engines.add(e))
	return finish(nil)
}

//export kvx_engine_destroy
func kvx_engine_destroy(eng C.kvx_engine_t) (rc C.int) {
	const op = "kvx_engine_destroy"
	defer guard(op, &rc)
	if inCallback() {
		return finish(fail(stBusy, "%s: called from inside the engine's notification callback; destroy it from another thread", op))
	}
	e, ok := engines.take(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	if err := e.close(); err != nil {
		return finish(failWrap(stOK, err, "%s: close transport %s", op, e.tr.Name()))
	}
	return finish(nil)
}

//export kvx_engine_transport
func kvx_engine_transport(eng C.kvx_engine_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_engine_transport"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	return finish(writeOut(op, []byte(e.tr.Name()), true, unsafe.Pointer(buf), capacity, needed))
}

//export kvx_engine_rpc_port
func kvx_engine_rpc_port(eng C.kvx_engine_t, port *C.uint16_t) (rc C.int) {
	const op = "kvx_engine_rpc_port"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	switch {
	case !ok:
		return finish(badHandle(op, "engine", uint64(eng)))
	case port == nil:
		return finish(nullArg(op, "port"))
	}
	*port = C.uint16_t(e.te.RPCPort())
	return finish(nil)
}

//export kvx_engine_segment_name
func kvx_engine_segment_name(eng C.kvx_engine_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_engine_segment_name"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	return finish(writeOut(op, []byte(e.te.Name()), true, unsafe.Pointer(buf), capacity, needed))
}

//export kvx_engine_set_notify
func kvx_engine_set_notify(eng C.kvx_engine_t, fn C.kvx_notify_fn, userData unsafe.Pointer) (rc C.int) {
	const op = "kvx_engine_set_notify"
	defer guard(op, &rc)
	if inCallback() {
		return finish(fail(stBusy, "%s: called from inside a notification callback; change the callback from another thread", op))
	}
	e, ok := engines.get(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	e.notify.set(fn, userData)
	return finish(nil)
}

//export kvx_alloc_host
func kvx_alloc_host(name *C.char, size C.uint64_t, out *C.kvx_hostbuf_t, addr *unsafe.Pointer, length *C.uint64_t) (rc C.int) {
	const op = "kvx_alloc_host"
	defer guard(op, &rc)
	switch {
	case out == nil:
		return finish(nullArg(op, "out"))
	case addr == nil:
		return finish(nullArg(op, "addr"))
	case length == nil:
		return finish(nullArg(op, "len"))
	case size == 0:
		return finish(fail(stInvalidArgument, "%s: size is 0 bytes", op))
	case uint64(size) > 1<<46:
		return finish(fail(stInvalidArgument, "%s: size %d bytes is over the 64 TiB limit", op, size))
	}
	n := goStr(name)
	if n == "" {
		n = "capi"
	}
	hb, err := engine.AllocHost(n, int64(size))
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	*out = C.kvx_hostbuf_t(hostBufs.add(hb))
	// The memory is an mmap outside the Go heap, so handing C its address is
	// allowed (cgo pointer rules do not apply).
	*addr = unsafe.Pointer(unsafe.SliceData(hb.Bytes()))
	*length = C.uint64_t(hb.Len())
	return finish(nil)
}

//export kvx_free_host
func kvx_free_host(buf C.kvx_hostbuf_t) (rc C.int) {
	const op = "kvx_free_host"
	defer guard(op, &rc)
	hb, ok := hostBufs.get(uint64(buf))
	if !ok {
		return finish(badHandle(op, "host buffer", uint64(buf)))
	}
	m := hb.Memory()
	if e, id, used := registeredAnywhere(m.Addr, m.Length); used {
		return finish(fail(stBusy, "%s: buffer is still registered as region %d of engine %d; call kvx_deregister_memory first", op, id, e))
	}
	if _, ok := hostBufs.take(uint64(buf)); !ok {
		return finish(badHandle(op, "host buffer", uint64(buf)))
	}
	return finish(hb.Close())
}

//export kvx_register_memory
func kvx_register_memory(eng C.kvx_engine_t, addr unsafe.Pointer, length C.uint64_t, location *C.char, out *C.kvx_region_t) (rc C.int) {
	const op = "kvx_register_memory"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	switch {
	case !ok:
		return finish(badHandle(op, "engine", uint64(eng)))
	case addr == nil:
		return finish(nullArg(op, "addr"))
	case length == 0:
		return finish(fail(stInvalidArgument, "%s: len is 0 bytes", op))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	id, err := e.register(uintptr(addr), uint64(length), goStr(location))
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_region_t(id)
	return finish(nil)
}

//export kvx_deregister_memory
func kvx_deregister_memory(eng C.kvx_engine_t, region C.kvx_region_t) (rc C.int) {
	const op = "kvx_deregister_memory"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	if !ok {
		return finish(badHandle(op, "engine", uint64(eng)))
	}
	return finish(e.deregister(engine.RegionID(region)))
}

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
	in := unsafe.Slice(reqs, int(n))
	rr := make([]engine.ReadRequest, len(in))
	var byAddr []engine.PeerRead
	var at []int
	for i, r := range in {
		if r.count > 1 {
			return finish(fail(stInvalidArgument, "%s: request %d has count %d; reads are contiguous (count 0 or 1)", op, i, r.count))
		}
		w := engine.WriteRequest{Local: uintptr(r.local_addr), Length: uint64(r.length)}
		if err := s.eng.checkLocal(op, i, w); err != nil {
			return finish(err)
		}
		rr[i] = engine.ReadRequest{Local: uintptr(r.local_addr), Remote: engine.RegionID(r.remote_region), RemoteOffset: uint64(r.remote_offset), Length: uint64(r.length)}
		if r.remote_region == C.KVX_REGION_PEER_ADDRESS {
			byAddr = append(byAddr, engine.PeerRead{Local: uintptr(r.local_addr), PeerAddr: uint64(r.remote_offset), Length: uint64(r.length)})
			at = append(at, i)
		}
	}
	timeout := s.eng.timeout
	if timeoutMS > 0 {
		timeout = time.Duration(timeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for k, pr := range byAddr {
		id, off, err := s.seg.Translate(ctx, pr.PeerAddr, pr.Length)
		if err != nil {
			return finish(failWrap(stOK, err, "%s: request %d", op, at[k]))
		}
		rr[at[k]].Remote, rr[at[k]].RemoteOffset = id, off
	}
	if err := s.seg.ReadRegions(ctx, rr); err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
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
	b, ok := batches.get(uint64(batch))
	switch {
	case !ok:
		return finish(badHandle(op, "batch", uint64(batch)))
	case reqs == nil:
		return finish(nullArg(op, "reqs"))
	case n == 0:
		return finish(fail(stInvalidArgument, "%s: n is 0 requests", op))
	case n > maxBatchCapacity:
		return finish(fail(stInvalidArgument, "%s: n %d is over the limit of %d requests", op, n, maxBatchCapacity))
	}
	in := unsafe.Slice(reqs, int(n))
	wr := make([]engine.WriteRequest, len(in))
	for i, r := range in {
		wr[i] = engine.WriteRequest{
			Local:        uintptr(r.local_addr),
			Remote:       engine.RegionID(r.remote_region),
			RemoteOffset: uint64(r.remote_offset),
			Length:       uint64(r.length),
			Count:        uint32(r.count),
			LocalStride:  uint64(r.local_stride),
			RemoteStride: uint64(r.remote_stride),
		}
	}
	return finish(b.submit(uint64(batch), wr))
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

//export kvx_kv_create
func kvx_kv_create(eng C.kvx_engine_t, cfg *C.kvx_kv_config, out *C.kvx_kv_t) (rc C.int) {
	const op = "kvx_kv_create"
	defer guard(op, &rc)
	e, ok := engines.get(uint64(eng))
	switch {
	case !ok:
		return finish(badHandle(op, "engine", uint64(eng)))
	case cfg == nil:
		return finish(nullArg(op, "cfg"))
	case out == nil:
		return finish(nullArg(op, "out"))
	case cfg.struct_size < C.KVX_KV_CONFIG_SIZE_V1 || uintptr(cfg.struct_size) > unsafe.Sizeof(*cfg):
		return finish(fail(stInvalidArgument, "%s: cfg->struct_size is %d, want sizeof(kvx_kv_config) = %d (or %d from a 0.1 header); zero-initialise the struct and set struct_size", op, cfg.struct_size, unsafe.Sizeof(*cfg), C.KVX_KV_CONFIG_SIZE_V1))
	}
	// Fields past the caller's struct_size (an older header) read as zero.
	var c C.kvx_kv_config
	n := uintptr(cfg.struct_size)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&c)), n), unsafe.Slice((*byte)(unsafe.Pointer(cfg)), n))
	kc := kvConfig{
		modelName: goStr(c.model),
		model: workload.ModelConfig{Name: "capi", NumLayers: int(c.num_layers), NumKVHeads: int(c.num_kv_heads),
			HeadDim: int(c.head_dim), DtypeBytes: int(c.dtype_bytes)},
		layout: workload.LayoutOptions{PageSize: int(c.page_size), TPSize: int(c.tp_size), TPRank: int(c.tp_rank),
			PPSize: int(c.pp_size), PPRank: int(c.pp_rank), NumPages: int(c.num_pages)},
		dpSize:           int(c.dp_size),
		dpRank:           int(c.dp_rank),
		checksum:         c.checksum != 0,
		kvCacheDtype:     goStr(c.kv_cache_dtype),
		controlHost:      goStr(c.control_host),
		controlPort:      int(c.control_port),
		bootstrapTimeout: time.Duration(c.bootstrap_timeout_ms) * time.Millisecond,
		waitingTimeout:   time.Duration(c.waiting_timeout_ms) * time.Millisecond,
		authToken:        goStr(c.bootstrap_auth_token),
		advertiseHost:    goStr(c.advertise_host),
	}
	if c.num_kv_buffers > 0 {
		args, err := kvArgsFromC(&c)
		if err != nil {
			return finish(failWrap(stInvalidArgument, err, "%s", op))
		}
		kc.args = args
	} else {
		switch {
		case c.num_aux_buffers > 0 || c.num_state_buffers > 0:
			return finish(fail(stInvalidArgument, "%s: aux or state buffers without KV buffers; set num_kv_buffers and kv_data_ptrs/kv_data_lens/kv_item_lens", op))
		case c.num_pages == 0:
			return finish(fail(stInvalidArgument, "%s: cfg->num_pages is 0 and no KV buffers are given: give the caller's buffers (num_kv_buffers, kv_data_ptrs, ...) or a model and a pool of at least one page", op))
		case c.num_pages > 1<<30:
			return finish(fail(stInvalidArgument, "%s: cfg->num_pages %d is over the limit of 2^30 pages", op, c.num_pages))
		}
	}
	k, err := newKV(e, kc)
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_kv_t(kvs.add(k))
	return finish(nil)
}

// kvArgsFromC reads the caller's buffer lists (kvx_kv_config 0.2 fields) into
// KVArgs; the arrays are copied. Errors name the field.
func kvArgsFromC(c *C.kvx_kv_config) (engine.KVArgs, error) {
	if c.model != nil || c.num_layers != 0 || c.num_kv_heads != 0 || c.head_dim != 0 || c.dtype_bytes != 0 || c.num_pages != 0 {
		return engine.KVArgs{}, errors.New("both caller buffers (num_kv_buffers > 0) and a model/pool size (model, num_layers, num_kv_heads, head_dim, dtype_bytes, num_pages) are set; the buffers define the geometry, leave the others 0/NULL")
	}
	kind, dev, err := engine.ParseLocation(goStr(c.kv_location))
	if err != nil {
		return engine.KVArgs{}, fmt.Errorf("kv_location: %w", err)
	}
	if kind == engine.MemoryHost {
		dev = -1
	}
	arrays := func(list string, n C.uint32_t, ptrs, lens, items *C.uint64_t) ([][]uint64, error) {
		if n == 0 {
			return [][]uint64{nil, nil, nil}, nil
		}
		if n > 1<<16 {
			return nil, fmt.Errorf("num_%s_buffers %d is over the limit of 65536", list, n)
		}
		out := make([][]uint64, 3)
		for i, p := range []*C.uint64_t{ptrs, lens, items} {
			if p == nil {
				return nil, fmt.Errorf("num_%s_buffers is %d but %s_data_%s is NULL", list, n, list, []string{"ptrs", "lens", "item_lens"}[i])
			}
			out[i] = append([]uint64(nil), unsafe.Slice((*uint64)(unsafe.Pointer(p)), int(n))...)
		}
		return out, nil
	}
	a := engine.KVArgs{PageSize: int(c.page_size), KVHeadNum: int(c.kv_head_num), TotalKVHeadNum: int(c.total_kv_head_num),
		EngineRank: int(c.tp_rank), TPSize: int(c.tp_size), SystemDPRank: int(c.system_dp_rank), PPRank: int(c.pp_rank), PPSize: int(c.pp_size),
		PrefillStartLayer: int(c.prefill_start_layer), MLA: c.is_mla != 0, GPUID: dev, IBDevice: goStr(c.ib_device)}
	if a.PageSize == 0 {
		a.PageSize = workload.DefaultPageSize
	}
	kv, err := arrays("kv", c.num_kv_buffers, c.kv_data_ptrs, c.kv_data_lens, c.kv_item_lens)
	if err != nil {
		return a, err
	}
	if a.KVBuffers, err = callerBuffers("kv", int(c.num_kv_buffers), kv[0], kv[1], kv[2], kind, dev); err != nil {
		return a, err
	}
	aux, err := arrays("aux", c.num_aux_buffers, c.aux_data_ptrs, c.aux_data_lens, c.aux_item_lens)
	if err != nil {
		return a, err
	}
	if a.AuxBuffers, err = callerBuffers("aux", int(c.num_aux_buffers), aux[0], aux[1], aux[2], engine.MemoryHost, -1); err != nil {
		return a, err
	}
	st, err := arrays("state", c.num_state_buffers, c.state_data_ptrs, c.state_data_lens, c.state_item_lens)
	if err != nil {
		return a, err
	}
	if a.StateBuffers, err = callerBuffers("state", int(c.num_state_buffers), st[0], st[1], st[2], kind, dev); err != nil {
		return a, err
	}
	if _, err := a.Geometry(); err != nil {
		return a, err
	}
	return a, nil
}

//export kvx_kv_destroy
func kvx_kv_destroy(kv C.kvx_kv_t) (rc C.int) {
	const op = "kvx_kv_destroy"
	defer guard(op, &rc)
	k, ok := kvs.take(uint64(kv))
	if !ok {
		return finish(badHandle(op, "KV manager", uint64(kv)))
	}
	if err := k.close(); err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_pool
func kvx_kv_pool(kv C.kvx_kv_t, addr *unsafe.Pointer, length *C.uint64_t) (rc C.int) {
	const op = "kvx_kv_pool"
	defer guard(op, &rc)
	k, ok := kvs.get(uint64(kv))
	switch {
	case !ok:
		return finish(badHandle(op, "KV manager", uint64(kv)))
	case addr == nil:
		return finish(nullArg(op, "addr"))
	case length == nil:
		return finish(nullArg(op, "len"))
	}
	if k.pool == nil {
		return finish(fail(stInvalidArgument, "%s: this KV manager runs on the caller's buffers (kv_data_ptrs); the library allocated no pool", op))
	}
	b := k.pool.Buffer(0).Memory // the contiguous block's first byte: mmap memory outside the Go heap
	*addr = unsafe.Pointer(unsafe.SliceData(b.Bytes()))
	*length = C.uint64_t(k.pool.Layout().PoolBytes())
	return finish(nil)
}

//export kvx_kv_layout_get
func kvx_kv_layout_get(kv C.kvx_kv_t, out *C.kvx_kv_layout) (rc C.int) {
	const op = "kvx_kv_layout_get"
	defer guard(op, &rc)
	k, ok := kvs.get(uint64(kv))
	switch {
	case !ok:
		return finish(badHandle(op, "KV manager", uint64(kv)))
	case out == nil:
		return finish(nullArg(op, "out"))
	}
	g := k.mgr.Geometry()
	out.item_len = C.uint64_t(g.KVItemLens[0])
	out.buffer_len = C.uint64_t(uint64(g.NumPages()) * g.KVItemLens[0])
	out.pool_len = 0
	if k.pool != nil {
		out.pool_len = C.uint64_t(k.pool.Layout().PoolBytes())
	}
	out.num_buffers = C.uint32_t(len(g.KVItemLens))
	out.num_pages = C.uint32_t(g.NumPages())
	out.page_size = C.uint32_t(g.PageSize)
	out.reserved = 0
	return finish(nil)
}

//export kvx_kv_sender_create
func kvx_kv_sender_create(kv C.kvx_kv_t, roomID C.uint64_t, out *C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_sender_create"
	defer guard(op, &rc)
	k, ok := kvs.get(uint64(kv))
	switch {
	case !ok:
		return finish(badHandle(op, "KV manager", uint64(kv)))
	case out == nil:
		return finish(nullArg(op, "out"))
	case k.mgr.Role() != engine.RolePrefill:
		return finish(fail(stInvalidArgument, "%s: the KV manager is on a decode engine; senders run on prefill (use kvx_kv_receiver_create)", op))
	case uint64(roomID) >= 1<<63:
		return finish(fail(stInvalidArgument, "%s: bootstrap_room %d is not below 2^63", op, roomID))
	}
	s, err := k.mgr.NewSender(uint64(roomID))
	if err != nil {
		return finish(failWrap(stOK, err, "%s: room %d", op, roomID))
	}
	h, err := k.addRoom(&roomObj{kv: k, r: s, sender: s})
	if err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	*out = C.kvx_room_t(h)
	return finish(nil)
}

//export kvx_kv_sender_init
func kvx_kv_sender_init(sender C.kvx_room_t, numPages C.uint32_t) (rc C.int) {
	const op = "kvx_kv_sender_init"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(sender))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(sender)))
	case r.sender == nil:
		return finish(fail(stInvalidArgument, "%s: handle %d is a receiver (use kvx_kv_receiver_init)", op, sender))
	case numPages > 1<<30:
		return finish(fail(stInvalidArgument, "%s: num_pages %d is over the limit of 2^30", op, numPages))
	}
	if err := r.sender.Init(int(numPages), -1); err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_sender_send
func kvx_kv_sender_send(sender C.kvx_room_t, pages *C.int32_t, n C.uint32_t, last C.int) (rc C.int) {
	const op = "kvx_kv_sender_send"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(sender))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(sender)))
	case r.sender == nil:
		return finish(fail(stInvalidArgument, "%s: handle %d is a receiver; only senders send", op, sender))
	case pages == nil && n > 0:
		return finish(nullArg(op, "pages"))
	case n == 0 && last == 0:
		return finish(fail(stInvalidArgument, "%s: n is 0 pages and last is 0 (nothing to do)", op))
	case n > 1<<30:
		return finish(fail(stInvalidArgument, "%s: n %d is over the limit of 2^30 pages", op, n))
	}
	var ps []int32
	if n > 0 {
		ps = append(ps, unsafe.Slice((*int32)(unsafe.Pointer(pages)), int(n))...)
	}
	if err := checkPageList(op, ps, r.kv.mgr.NumPages()); err != nil {
		return finish(err)
	}
	if err := r.sender.Send(ps, last != 0); err != nil {
		code := codeOf(err)
		if code == stTransferFailed {
			code = stInvalidArgument // Send only returns validation errors
		}
		return finish(failWrap(code, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_receiver_create
func kvx_kv_receiver_create(kv C.kvx_kv_t, bootstrapAddr *C.char, roomID C.uint64_t, out *C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_receiver_create"
	defer guard(op, &rc)
	return finish(createReceiver(op, kv, bootstrapAddr, roomID, -1, out))
}

// createReceiver is kvx_kv_receiver_create(_dp): dp < 0 resolves the prefill
// DP rank through the bootstrap server.
func createReceiver(op string, kv C.kvx_kv_t, bootstrapAddr *C.char, roomID C.uint64_t, dp int, out *C.kvx_room_t) error {
	k, ok := kvs.get(uint64(kv))
	switch {
	case !ok:
		return badHandle(op, "KV manager", uint64(kv))
	case out == nil:
		return nullArg(op, "out")
	case k.mgr.Role() != engine.RoleDecode:
		return fail(stInvalidArgument, "%s: the KV manager is on a prefill engine; receivers run on decode (use kvx_kv_sender_create)", op)
	case uint64(roomID) >= 1<<63:
		return fail(stInvalidArgument, "%s: bootstrap_room %d is not below 2^63", op, roomID)
	}
	addr := goStr(bootstrapAddr)
	if addr == "" {
		addr = k.eng.bootstrapAddr
	}
	if addr == "" {
		return fail(stInvalidArgument, "%s: no bootstrap address: pass bootstrap_addr or set kvx_engine_config.bootstrap_addr", op)
	}
	if _, _, err := splitHostPort(addr); err != nil {
		return failWrap(stInvalidArgument, err, "%s: bootstrap_addr", op)
	}
	rv, err := k.mgr.NewReceiverDP(addr, uint64(roomID), dp)
	if err != nil {
		return failWrap(stOK, err, "%s: room %d", op, roomID)
	}
	h, err := k.addRoom(&roomObj{kv: k, r: rv, recv: rv})
	if err != nil {
		return failWrap(stOK, err, "%s", op)
	}
	*out = C.kvx_room_t(h)
	return nil
}

//export kvx_kv_receiver_init
func kvx_kv_receiver_init(receiver C.kvx_room_t, pages *C.int32_t, n C.uint32_t) (rc C.int) {
	const op = "kvx_kv_receiver_init"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(receiver))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(receiver)))
	case r.recv == nil:
		return finish(fail(stInvalidArgument, "%s: handle %d is a sender (use kvx_kv_sender_init)", op, receiver))
	case pages == nil:
		return finish(nullArg(op, "pages"))
	case n == 0:
		return finish(fail(stInvalidArgument, "%s: n is 0 pages", op))
	case n > 1<<30:
		return finish(fail(stInvalidArgument, "%s: n %d is over the limit of 2^30 pages", op, n))
	}
	ps := append([]int32(nil), unsafe.Slice((*int32)(unsafe.Pointer(pages)), int(n))...)
	if err := checkPageList(op, ps, r.kv.mgr.NumPages()); err != nil {
		return finish(err)
	}
	if err := r.recv.Init(ps); err != nil {
		code := codeOf(err)
		if code == stTransferFailed {
			code = stInvalidArgument
		}
		return finish(failWrap(code, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_set_tokens
func kvx_kv_set_tokens(h C.kvx_room_t, tokens C.uint32_t) (rc C.int) {
	const op = "kvx_kv_set_tokens"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	if !ok {
		return finish(badHandle(op, "room", uint64(h)))
	}
	var err error
	if r.sender != nil {
		err = r.sender.SetTokens(int(tokens))
	} else {
		err = r.recv.SetTokens(int(tokens))
	}
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	return finish(nil)
}

// auxIndexArg converts a C aux index (< 0: none) for the engine (-1: none).
func auxIndexArg(op string, aux C.int64_t) (int, error) {
	switch {
	case aux < 0:
		return -1, nil
	case aux > 1<<31-1:
		return 0, fail(stInvalidArgument, "%s: aux_index %d is over the limit of 2^31-1", op, aux)
	}
	return int(aux), nil
}

// int32List copies n int32s from p (nil with n > 0 is an error naming arg).
func int32List(op, arg string, p *C.int32_t, n C.uint32_t) ([]int32, error) {
	switch {
	case n == 0:
		return nil, nil
	case p == nil:
		return nil, nullArg(op, arg)
	case n > 1<<30:
		return nil, fail(stInvalidArgument, "%s: %d entries of %s, over the limit of 2^30", op, n, arg)
	}
	return append([]int32(nil), unsafe.Slice((*int32)(unsafe.Pointer(p)), int(n))...), nil
}

// senderRoom and receiverRoom look a room handle up and check its side.
func senderRoom(op string, h C.kvx_room_t) (*roomObj, error) {
	r, ok := rooms.get(uint64(h))
	switch {
	case !ok:
		return nil, badHandle(op, "room", uint64(h))
	case r.sender == nil:
		return nil, fail(stInvalidArgument, "%s: handle %d is a receiver; this is a sender (prefill) call", op, h)
	}
	return r, nil
}

func receiverRoom(op string, h C.kvx_room_t) (*roomObj, error) {
	r, ok := rooms.get(uint64(h))
	switch {
	case !ok:
		return nil, badHandle(op, "room", uint64(h))
	case r.recv == nil:
		return nil, fail(stInvalidArgument, "%s: handle %d is a sender; this is a receiver (decode) call", op, h)
	}
	return r, nil
}

// inputCode keeps a room's own failure codes and calls the rest invalid
// arguments (these calls only validate input).
func inputCode(err error) status {
	code := codeOf(err)
	if code == stTransferFailed {
		code = stInvalidArgument
	}
	return code
}

//export kvx_kv_sender_init_aux
func kvx_kv_sender_init_aux(sender C.kvx_room_t, numPages C.uint32_t, auxIndex C.int64_t) (rc C.int) {
	const op = "kvx_kv_sender_init_aux"
	defer guard(op, &rc)
	r, err := senderRoom(op, sender)
	if err != nil {
		return finish(err)
	}
	aux, err := auxIndexArg(op, auxIndex)
	if err != nil {
		return finish(err)
	}
	if numPages > 1<<30 {
		return finish(fail(stInvalidArgument, "%s: num_pages %d is over the limit of 2^30", op, numPages))
	}
	if err := r.sender.Init(int(numPages), aux); err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_sender_init_tokens
func kvx_kv_sender_init_tokens(sender C.kvx_room_t, promptTokens C.uint32_t, auxIndex C.int64_t, numPages *C.uint32_t) (rc C.int) {
	const op = "kvx_kv_sender_init_tokens"
	defer guard(op, &rc)
	r, err := senderRoom(op, sender)
	if err != nil {
		return finish(err)
	}
	aux, err := auxIndexArg(op, auxIndex)
	if err != nil {
		return finish(err)
	}
	if promptTokens > 1<<31-1 {
		return finish(fail(stInvalidArgument, "%s: prompt_tokens %d is over the limit of 2^31-1", op, promptTokens))
	}
	n, err := r.sender.InitTokens(int(promptTokens), aux)
	if err != nil {
		return finish(failWrap(inputCode(err), err, "%s", op))
	}
	if numPages != nil {
		*numPages = C.uint32_t(n)
	}
	return finish(nil)
}

//export kvx_kv_sender_prefix_len
func kvx_kv_sender_prefix_len(sender C.kvx_room_t, tokens *C.uint32_t) (rc C.int) {
	const op = "kvx_kv_sender_prefix_len"
	defer guard(op, &rc)
	r, err := senderRoom(op, sender)
	if err != nil {
		return finish(err)
	}
	if tokens == nil {
		return finish(nullArg(op, "tokens"))
	}
	*tokens = C.uint32_t(r.sender.PopDecodePrefixLen())
	return finish(nil)
}

//export kvx_kv_sender_state
func kvx_kv_sender_state(sender C.kvx_room_t, stateIndices *C.int32_t, n C.uint32_t) (rc C.int) {
	const op = "kvx_kv_sender_state"
	defer guard(op, &rc)
	r, err := senderRoom(op, sender)
	if err != nil {
		return finish(err)
	}
	idx, err := int32List(op, "state_indices", stateIndices, n)
	if err != nil {
		return finish(err)
	}
	if err := r.sender.SetStateIndices(idx); err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_receiver_create_dp
func kvx_kv_receiver_create_dp(kv C.kvx_kv_t, bootstrapAddr *C.char, roomID C.uint64_t, prefillDPRank C.int32_t, out *C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_receiver_create_dp"
	defer guard(op, &rc)
	return finish(createReceiver(op, kv, bootstrapAddr, roomID, int(prefillDPRank), out))
}

//export kvx_kv_receiver_send_metadata
func kvx_kv_receiver_send_metadata(receiver C.kvx_room_t, pages *C.int32_t, n C.uint32_t, auxIndex C.int64_t, stateIndices *C.int32_t, nState C.uint32_t, prefixTokens C.uint32_t) (rc C.int) {
	const op = "kvx_kv_receiver_send_metadata"
	defer guard(op, &rc)
	r, err := receiverRoom(op, receiver)
	if err != nil {
		return finish(err)
	}
	ps, err := int32List(op, "pages", pages, n)
	if err != nil {
		return finish(err)
	}
	st, err := int32List(op, "state_indices", stateIndices, nState)
	if err != nil {
		return finish(err)
	}
	aux, err := auxIndexArg(op, auxIndex)
	if err != nil {
		return finish(err)
	}
	if prefixTokens > 1<<31-1 {
		return finish(fail(stInvalidArgument, "%s: prefix_tokens %d is over the limit of 2^31-1", op, prefixTokens))
	}
	if err := r.recv.SendMetadata(ps, aux, st, int(prefixTokens)); err != nil {
		return finish(failWrap(inputCode(err), err, "%s", op))
	}
	return finish(nil)
}

//export kvx_kv_receiver_aux_row
func kvx_kv_receiver_aux_row(receiver C.kvx_room_t, buffer C.uint32_t, buf unsafe.Pointer, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_kv_receiver_aux_row"
	defer guard(op, &rc)
	r, err := receiverRoom(op, receiver)
	if err != nil {
		return finish(err)
	}
	row, err := r.recv.AuxRow(int(buffer))
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	return finish(writeOut(op, row, false, buf, capacity, needed))
}

//export kvx_kv_metric
func kvx_kv_metric(h C.kvx_room_t, out *C.kvx_transfer_metric) (rc C.int) {
	const op = "kvx_kv_metric"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(h)))
	case out == nil:
		return finish(nullArg(op, "out"))
	case uintptr(out.struct_size) < unsafe.Sizeof(*out):
		return finish(fail(stInvalidArgument, "%s: out->struct_size is %d, want sizeof(kvx_transfer_metric) = %d", op, out.struct_size, unsafe.Sizeof(*out)))
	}
	var mt engine.TransferMetric
	if r.sender != nil {
		mt = r.sender.TransferMetric()
	} else {
		mt = r.recv.TransferMetric()
	}
	out.prefix_tokens = C.uint32_t(mt.PrefixTokens)
	out.latency_us = C.uint64_t(mt.Latency.Microseconds())
	out.bytes = C.uint64_t(mt.Bytes)
	out.aux_bytes = C.uint64_t(mt.AuxBytes)
	out.skipped_bytes = C.uint64_t(mt.SkippedBytes)
	out.pages = C.uint32_t(mt.Pages)
	out.reserved = 0
	return finish(nil)
}

//export kvx_kv_poll
func kvx_kv_poll(h C.kvx_room_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_kv_poll"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(h)))
	case state == nil:
		return finish(nullArg(op, "state"))
	}
	*state = C.int32_t(r.r.Poll())
	return finish(nil)
}

//export kvx_kv_wait
func kvx_kv_wait(h C.kvx_room_t, want C.int32_t, timeoutMS C.uint32_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_kv_wait"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	switch {
	case !ok:
		return finish(badHandle(op, "room", uint64(h)))
	case state == nil:
		return finish(nullArg(op, "state"))
	case !engine.KVPoll(want).Valid():
		return finish(fail(stInvalidArgument, "%s: want %d is not a KVPoll state (0..4)", op, want))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMS)*time.Millisecond)
	defer cancel()
	got := r.r.Wait(ctx, engine.KVPoll(want))
	*state = C.int32_t(got)
	if got != engine.KVFailed && got < engine.KVPoll(want) {
		return finish(fail(stTimeout, "%s: room %d still %s after %d ms (want %s)", op, r.r.Room(), got, timeoutMS, engine.KVPoll(want)))
	}
	return finish(nil)
}

//export kvx_kv_failure
func kvx_kv_failure(h C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_failure"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	if !ok {
		return finish(badHandle(op, "room", uint64(h)))
	}
	return finish(r.failure())
}

//export kvx_kv_abort
func kvx_kv_abort(h C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_abort"
	defer guard(op, &rc)
	r, ok := rooms.get(uint64(h))
	if !ok {
		return finish(badHandle(op, "room", uint64(h)))
	}
	r.r.Abort()
	return finish(nil)
}

//export kvx_kv_close
func kvx_kv_close(h C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_close"
	defer guard(op, &rc)
	r, ok := rooms.take(uint64(h))
	if !ok {
		return finish(badHandle(op, "room", uint64(h)))
	}
	r.kv.mu.Lock()
	delete(r.kv.rooms, uint64(h))
	r.kv.mu.Unlock()
	r.close()
	return finish(nil)
}

//export kvx_metrics_text
func kvx_metrics_text(buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_metrics_text"
	defer guard(op, &rc)
	b, err := metricsText()
	if err != nil {
		return finish(err)
	}
	return finish(writeOut(op, b, true, unsafe.Pointer(buf), capacity, needed))
}

//export kvx_metrics_serve
func kvx_metrics_serve(addr *C.char, port *C.uint16_t) (rc C.int) {
	const op = "kvx_metrics_serve"
	defer guard(op, &rc)
	bound, err := serveMetrics(goStr(addr))
	if err != nil {
		return finish(err)
	}
	if port != nil {
		_, p, _ := net.SplitHostPort(bound)
		n, _ := strconv.Atoi(p)
		*port = C.uint16_t(n)
	}
	return finish(nil)
}

//export kvx_room_timeline
func kvx_room_timeline(room C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_room_timeline"
	defer guard(op, &rc)
	b, err := roomTimelineJSON(uint64(room))
	if err != nil {
		return finish(err)
	}
	return finish(writeOut(op, b, true, unsafe.Pointer(buf), capacity, needed))
}
