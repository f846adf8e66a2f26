//go:build cgo

package main

// The //exports of the NIXL-shaped agent (kvx_agent_*).

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/agent"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// maxAgentDescs bounds one call's descriptor or index array.
const maxAgentDescs = 1 << 24

//export kvx_agent_create
func kvx_agent_create(cfg *C.kvx_agent_config, out *C.kvx_agent_t) (rc C.int) {
	const op = "kvx_agent_create"
	defer guard(op, &rc)
	switch {
	case cfg == nil:
		return finish(nullArg(op, "cfg"))
	case out == nil:
		return finish(nullArg(op, "out"))
	case cfg.struct_size < C.uint32_t(unsafe.Sizeof(*cfg)):
		return finish(fail(stInvalidArgument, "%s: cfg->struct_size is %d, want sizeof(kvx_agent_config) = %d; zero-initialise the struct and set struct_size", op, cfg.struct_size, unsafe.Sizeof(*cfg)))
	}
	name := goStr(cfg.name)
	if name == "" {
		return finish(fail(stInvalidArgument, "%s: cfg->name is empty (give the agent a unique name)", op))
	}
	trName := goStr(cfg.transport)
	if trName == "" {
		trName = "tcp"
	}
	local := goStr(cfg.local_hostname)
	bindLocal, named, err := resolveLocalHostname(local)
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s: local_hostname %q", op, local))
	}
	opts, err := transportOptions(getenv)
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	if h := bindHostOf(bindLocal); h != "" {
		opts.ListenHost = h
	}
	tr, err := openAgentTransport(trName, opts)
	if err != nil {
		code := stUnavailable
		if errors.Is(err, transport.ErrUnknownTransport) {
			code = stInvalidArgument
		}
		return finish(failWrap(code, err, "%s: transport %q (one of tcp, shm, rdma, or auto)", op, trName))
	}
	advertise := getenv("KVXFER_ADVERTISE_HOST")
	if advertise == "" {
		advertise = named
	}
	ms := func(v C.uint32_t) time.Duration { return time.Duration(v) * time.Millisecond }
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	a, err := agent.New(ctx, agent.Config{Name: name, Transport: tr, LocalHostname: bindLocal, AdvertiseHost: advertise,
		ControlPort: int(cfg.control_port), Timeout: ms(cfg.timeout_ms), DrainTimeout: ms(cfg.drain_timeout_ms),
		TransferTimeout: ms(cfg.transfer_timeout_ms), MaxNotifs: int(cfg.max_notifs)})
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, "%s", op))
	}
	*out = C.kvx_agent_t(agents.add(&agentObj{a: a}))
	return finish(nil)
}

// openAgentTransport opens the agent's one transport. "auto" (the
// KV manager's meaning of KVXFER_TRANSPORT) picks the highest-priority
// transport usable here that reaches other hosts (rdma, else tcp): an agent
// does not know its peers when it starts.
func openAgentTransport(name string, opts transport.Options) (transport.Transport, error) {
	if name != "auto" {
		return transport.OpenTransport(name, opts)
	}
	trs, err := transport.OpenTransports("auto", opts)
	if err != nil {
		return nil, err
	}
	pick := transport.FirstCrossHost(trs)
	for _, t := range trs {
		if t != pick {
			_ = t.Close()
		}
	}
	if pick == nil {
		return nil, fmt.Errorf("auto: no transport usable here reaches other hosts (opened %d): %w", len(trs), transport.ErrUnavailable)
	}
	return pick, nil
}

// bindHostOf is the host of "host" or "host:port".
func bindHostOf(s string) string {
	if h, _, err := splitHostPort(s); err == nil {
		return h
	}
	return s
}

//export kvx_agent_destroy
func kvx_agent_destroy(ag C.kvx_agent_t) (rc C.int) {
	const op = "kvx_agent_destroy"
	defer guard(op, &rc)
	o, ok := agents.take(uint64(ag))
	if !ok {
		return finish(badHandle(op, "agent", uint64(ag)))
	}
	if err := o.a.Close(); err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(nil)
}

func getAgent(op string, ag C.kvx_agent_t) (*agentObj, error) {
	o, ok := agents.get(uint64(ag))
	if !ok {
		return nil, badHandle(op, "agent", uint64(ag))
	}
	return o, nil
}

//export kvx_agent_metadata
func kvx_agent_metadata(ag C.kvx_agent_t, buf unsafe.Pointer, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_agent_metadata"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	return finish(writeOut(op, o.a.Metadata(), false, buf, capacity, needed))
}

func memKind(op string, k C.uint32_t) (transport.MemoryKind, error) {
	switch k {
	case C.KVX_AGENT_MEM_DRAM:
		return transport.MemoryHost, nil
	case C.KVX_AGENT_MEM_VRAM:
		return transport.MemoryCUDA, nil
	}
	return 0, fail(stInvalidArgument, "%s: mem_kind %d is not KVX_AGENT_MEM_DRAM (0) or KVX_AGENT_MEM_VRAM (1)", op, k)
}

func agentDescs(op string, p *C.kvx_agent_desc, n C.uint32_t) ([]agent.Desc, error) {
	switch {
	case n == 0:
		return nil, fail(stInvalidArgument, "%s: n is 0 descriptors", op)
	case n > maxAgentDescs:
		return nil, fail(stInvalidArgument, "%s: n %d is over the limit of %d descriptors", op, n, maxAgentDescs)
	case p == nil:
		return nil, nullArg(op, "descs")
	}
	in := unsafe.Slice(p, int(n))
	out := make([]agent.Desc, len(in))
	for i, d := range in {
		out[i] = agent.Desc{Addr: uint64(d.addr), Len: uint64(d.len), Device: int(d.device)}
	}
	return out, nil
}

// agentDescArgs checks the arguments kvx_agent_register and
// kvx_agent_prep_dlist share, in this order: the agent handle, out (outNil:
// the caller's out is NULL), mem_kind, then descs and n. Errors name op and
// the argument.
func agentDescArgs(op string, ag C.kvx_agent_t, outNil bool, kind C.uint32_t, descs *C.kvx_agent_desc, n C.uint32_t) (*agentObj, transport.MemoryKind, []agent.Desc, error) {
	o, err := getAgent(op, ag)
	if err != nil {
		return nil, 0, nil, err
	}
	if outNil {
		return nil, 0, nil, nullArg(op, "out")
	}
	k, err := memKind(op, kind)
	if err != nil {
		return nil, 0, nil, err
	}
	ds, err := agentDescs(op, descs, n)
	if err != nil {
		return nil, 0, nil, err
	}
	return o, k, ds, nil
}

// notifTooLong is the error for a notification of length bytes, over
// agent.MaxNotifBytes.
func notifTooLong(op string, length C.size_t) error {
	return fail(stInvalidArgument, "%s: notification of %d bytes, longer than %d", op, length, agent.MaxNotifBytes)
}

//export kvx_agent_register
func kvx_agent_register(ag C.kvx_agent_t, kind C.uint32_t, descs *C.kvx_agent_desc, n C.uint32_t, out *C.kvx_agent_reg_t) (rc C.int) {
	const op = "kvx_agent_register"
	defer guard(op, &rc)
	o, k, ds, err := agentDescArgs(op, ag, out == nil, kind, descs, n)
	if err != nil {
		return finish(err)
	}
	mems := make([]transport.Memory, len(ds))
	for i, d := range ds {
		if d.Len == 0 {
			return finish(fail(stInvalidArgument, "%s: descriptor %d has length 0 bytes", op, i))
		}
		m := transport.Memory{Addr: uintptr(d.Addr), Length: d.Len, Kind: k, Device: d.Device, FD: -1}
		if k == transport.MemoryHost {
			if fd, off, ok := hostBufferFor(m.Addr, m.Length); ok {
				m.FD, m.FDOffset = fd, off
			}
		}
		mems[i] = m
	}
	h, err := o.a.RegisterMemory(mems)
	if err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	*out = C.kvx_agent_reg_t(h)
	return finish(nil)
}

//export kvx_agent_deregister
func kvx_agent_deregister(ag C.kvx_agent_t, reg C.kvx_agent_reg_t) (rc C.int) {
	const op = "kvx_agent_deregister"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	return finish(wrapOp(op, o.a.DeregisterMemory(agent.RegHandle(reg))))
}

func wrapOp(op string, err error) error {
	if err == nil {
		return nil
	}
	return failWrap(stOK, err, "%s", op)
}

//export kvx_agent_add_remote
func kvx_agent_add_remote(ag C.kvx_agent_t, md unsafe.Pointer, length C.size_t, name *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_agent_add_remote"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	switch {
	case md == nil:
		return finish(nullArg(op, "metadata"))
	case length == 0 || length > agent.MaxMetadataBytes:
		return finish(fail(stInvalidArgument, "%s: len %d bytes: want 1..%d (the bytes of the peer's kvx_agent_metadata)", op, length, agent.MaxMetadataBytes))
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	n, err := o.a.AddRemoteAgent(ctx, C.GoBytes(md, C.int(length)))
	if err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	return finish(writeOut(op, []byte(n), true, unsafe.Pointer(name), capacity, needed))
}

//export kvx_agent_remove_remote
func kvx_agent_remove_remote(ag C.kvx_agent_t, name *C.char) (rc C.int) {
	const op = "kvx_agent_remove_remote"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	if name == nil {
		return finish(nullArg(op, "name"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	return finish(wrapOp(op, o.a.RemoveRemoteAgent(ctx, C.GoString(name))))
}

//export kvx_agent_prep_dlist
func kvx_agent_prep_dlist(ag C.kvx_agent_t, remote *C.char, kind C.uint32_t, descs *C.kvx_agent_desc, n C.uint32_t, out *C.kvx_dlist_t) (rc C.int) {
	const op = "kvx_agent_prep_dlist"
	defer guard(op, &rc)
	o, k, ds, err := agentDescArgs(op, ag, out == nil, kind, descs, n)
	if err != nil {
		return finish(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	h, err := o.a.PrepDlist(ctx, goStr(remote), k, ds)
	if err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	*out = C.kvx_dlist_t(h)
	return finish(nil)
}

//export kvx_agent_release_dlist
func kvx_agent_release_dlist(ag C.kvx_agent_t, dl C.kvx_dlist_t) (rc C.int) {
	const op = "kvx_agent_release_dlist"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	return finish(wrapOp(op, o.a.ReleaseDlist(agent.DlistHandle(dl))))
}

func indices(p *C.int64_t, n C.uint32_t) []int {
	in := unsafe.Slice(p, int(n))
	out := make([]int, len(in))
	for i, v := range in {
		out[i] = int(v)
		if int64(out[i]) != int64(v) {
			out[i] = -1
		}
	}
	return out
}

func optBytes(p unsafe.Pointer, n C.size_t) []byte {
	if p == nil {
		return nil
	}
	return C.GoBytes(p, C.int(n))
}

//export kvx_agent_make_xfer
func kvx_agent_make_xfer(ag C.kvx_agent_t, opc C.uint32_t, local C.kvx_dlist_t, li *C.int64_t, remote C.kvx_dlist_t, ri *C.int64_t, n C.uint32_t, notif unsafe.Pointer, length C.size_t, out *C.kvx_xfer_t) (rc C.int) {
	const op = "kvx_agent_make_xfer"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	var xop agent.Op
	switch {
	case out == nil:
		return finish(nullArg(op, "out"))
	case opc == C.KVX_XFER_READ:
		xop = agent.OpRead
	case opc == C.KVX_XFER_WRITE:
		xop = agent.OpWrite
	default:
		return finish(fail(stInvalidArgument, "%s: op %d is not KVX_XFER_READ (1) or KVX_XFER_WRITE (0)", op, opc))
	}
	switch {
	case n == 0:
		return finish(fail(stInvalidArgument, "%s: n is 0 descriptor pairs", op))
	case n > maxAgentDescs:
		return finish(fail(stInvalidArgument, "%s: n %d is over the limit of %d pairs", op, n, maxAgentDescs))
	case li == nil:
		return finish(nullArg(op, "local_idx"))
	case ri == nil:
		return finish(nullArg(op, "remote_idx"))
	case notif != nil && length > agent.MaxNotifBytes:
		return finish(notifTooLong(op, length))
	}
	h, err := o.a.MakeXfer(xop, agent.DlistHandle(local), indices(li, n), agent.DlistHandle(remote), indices(ri, n), optBytes(notif, length))
	if err != nil {
		return finish(failWrap(stOK, err, "%s", op))
	}
	*out = C.kvx_xfer_t(h)
	return finish(nil)
}

//export kvx_agent_post
func kvx_agent_post(ag C.kvx_agent_t, x C.kvx_xfer_t, notif unsafe.Pointer, length C.size_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_agent_post"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	if notif != nil && length > agent.MaxNotifBytes {
		return finish(notifTooLong(op, length))
	}
	var msg []byte
	if notif != nil {
		msg = C.GoBytes(notif, C.int(length))
	}
	st, err := o.a.Post(agent.XferHandle(x), msg)
	if state != nil {
		*state = C.int32_t(st)
	}
	return finish(wrapOp(op, err))
}

// stateResult reports a state and its reason the way kvx_agent_xfer_state
// documents.
func stateResult(op string, st agent.XferState, why error, state *C.int32_t) C.int {
	if state != nil {
		*state = C.int32_t(st)
	}
	if st == agent.XferProc || st == agent.XferDone {
		return finish(nil)
	}
	if why == nil {
		why = errors.New("no reason recorded")
	}
	if st == agent.XferNotPosted {
		return finish(failWrap(stInvalidArgument, why, "%s", op))
	}
	return finish(failWrap(stOK, why, "%s", op))
}

//export kvx_agent_xfer_state
func kvx_agent_xfer_state(ag C.kvx_agent_t, x C.kvx_xfer_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_agent_xfer_state"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	st, why := o.a.State(agent.XferHandle(x))
	return stateResult(op, st, why, state)
}

//export kvx_agent_xfer_wait
func kvx_agent_xfer_wait(ag C.kvx_agent_t, x C.kvx_xfer_t, timeoutMS C.uint32_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_agent_xfer_wait"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	timeout := agent.DefaultTransferTimeout + agent.DefaultDrainTimeout
	if timeoutMS > 0 {
		timeout = time.Duration(timeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	st, why := o.a.Wait(ctx, agent.XferHandle(x))
	if st == agent.XferProc && why != nil {
		if state != nil {
			*state = C.int32_t(st)
		}
		return finish(failWrap(stTimeout, why, "%s: transfer %d still in progress after %v", op, x, timeout))
	}
	return stateResult(op, st, why, state)
}

//export kvx_agent_xfer_cancel
func kvx_agent_xfer_cancel(ag C.kvx_agent_t, x C.kvx_xfer_t, state *C.int32_t) (rc C.int) {
	const op = "kvx_agent_xfer_cancel"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	st, err := o.a.Cancel(agent.XferHandle(x))
	if state != nil {
		*state = C.int32_t(st)
	}
	return finish(wrapOp(op, err))
}

//export kvx_agent_xfer_release
func kvx_agent_xfer_release(ag C.kvx_agent_t, x C.kvx_xfer_t) (rc C.int) {
	const op = "kvx_agent_xfer_release"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	return finish(wrapOp(op, o.a.Release(agent.XferHandle(x))))
}

//export kvx_agent_xfer_telemetry
func kvx_agent_xfer_telemetry(ag C.kvx_agent_t, x C.kvx_xfer_t, out *C.kvx_xfer_telemetry) (rc C.int) {
	const op = "kvx_agent_xfer_telemetry"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	if out == nil {
		return finish(nullArg(op, "out"))
	}
	t, err := o.a.Telemetry(agent.XferHandle(x))
	if err != nil {
		code := stInvalidArgument
		if errors.Is(err, agent.ErrBadHandle) {
			code = stBadHandle
		}
		return finish(failWrap(code, err, "%s", op))
	}
	*out = C.kvx_xfer_telemetry{start_us: C.int64_t(t.Start.UnixMicro()), post_us: C.int64_t(t.Post.Microseconds()),
		xfer_us: C.int64_t(t.Xfer.Microseconds()), total_bytes: C.uint64_t(t.Bytes), desc_count: C.uint64_t(t.Descs)}
	return finish(nil)
}

//export kvx_agent_send_notif
func kvx_agent_send_notif(ag C.kvx_agent_t, remote *C.char, msg unsafe.Pointer, length C.size_t) (rc C.int) {
	const op = "kvx_agent_send_notif"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	switch {
	case remote == nil:
		return finish(nullArg(op, "remote_agent"))
	case msg == nil && length > 0:
		return finish(nullArg(op, "msg"))
	case length > agent.MaxNotifBytes:
		return finish(notifTooLong(op, length))
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	return finish(wrapOp(op, o.a.SendNotif(ctx, C.GoString(remote), optBytes(msg, length))))
}

//export kvx_agent_get_notifs
func kvx_agent_get_notifs(ag C.kvx_agent_t, buf unsafe.Pointer, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_agent_get_notifs"
	defer guard(op, &rc)
	o, err := getAgent(op, ag)
	if err != nil {
		return finish(err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	b := o.takeNotifs()
	if needed != nil {
		*needed = C.size_t(len(b))
	}
	if len(b) == 0 {
		return finish(nil)
	}
	if err := writeOut(op, b, false, buf, capacity, needed); err != nil {
		return finish(err)
	}
	o.pending = nil
	return finish(nil)
}
