//go:build cgo

package main

// The //exports of KV managers (SGLang's KVManager, KVSender, KVReceiver)
// and their observability (metrics, room timelines), with the argument
// conversions they share.

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
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

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
		controlAuth:      uint32(c.control_auth),
		maxPeers:         uint32(c.max_peers),
		allocPolicy:      goStr(c.decode_allocation_policy),
		specLayout:       goStr(c.dsv41_spec_layout),
		httpPort:         uint32(c.prefill_http_port),
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
func kvArgsFromC(c *C.kvx_kv_config) (kvargs.KVArgs, error) {
	if c.model != nil || c.num_layers != 0 || c.num_kv_heads != 0 || c.head_dim != 0 || c.dtype_bytes != 0 || c.num_pages != 0 {
		return kvargs.KVArgs{}, errors.New("both caller buffers (num_kv_buffers > 0) and a model/pool size (model, num_layers, num_kv_heads, head_dim, dtype_bytes, num_pages) are set; the buffers define the geometry, leave the others 0/NULL")
	}
	kind, dev, err := transport.ParseLocation(goStr(c.kv_location))
	if err != nil {
		return kvargs.KVArgs{}, fmt.Errorf("kv_location: %w", err)
	}
	if kind == transport.MemoryHost {
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
	a := kvargs.KVArgs{PageSize: int(c.page_size), KVHeadNum: int(c.kv_head_num), TotalKVHeadNum: int(c.total_kv_head_num),
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
	if a.AuxBuffers, err = callerBuffers("aux", int(c.num_aux_buffers), aux[0], aux[1], aux[2], transport.MemoryHost, -1); err != nil {
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

//export kvx_kv_transports
func kvx_kv_transports(kv C.kvx_kv_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_kv_transports"
	defer guard(op, &rc)
	k, ok := kvs.get(uint64(kv))
	if !ok {
		return finish(badHandle(op, "KV manager", uint64(kv)))
	}
	return finish(writeOut(op, []byte(strings.Join(k.mgr.TransportNames(), ",")), true, unsafe.Pointer(buf), capacity, needed))
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
	r, ps, err := senderPages(op, sender, pages, n, last != 0)
	if err != nil {
		return finish(err)
	}
	if err := r.sender.Send(ps, last != 0); err != nil {
		return finish(sendErr(op, err))
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
	case int64(n) > int64(r.kv.mgr.NumPages()):
		return finish(fail(stInvalidArgument, "%s: n %d is more pages than the KV buffers hold (%d); nothing was read", op, n, r.kv.mgr.NumPages()))
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

//export kvx_kv_sender_mark_prefill_complete
func kvx_kv_sender_mark_prefill_complete(sender C.kvx_room_t) (rc C.int) {
	const op = "kvx_kv_sender_mark_prefill_complete"
	defer guard(op, &rc)
	r, err := senderRoom(op, sender)
	if err != nil {
		return finish(err)
	}
	if err := r.sender.MarkPrefillComplete(); err != nil {
		return finish(failWrap(inputCode(err), err, "%s", op))
	}
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
