//go:build cgo

package main

// The //exports of the C ABI for the bootstrap server, engines and
// registered memory; exports_segment.go (segments, batches) and
// exports_kv.go (KV managers, metrics) hold the rest. The preambles only
// include the header's types (KVX_TYPES_ONLY): cgo writes its own
// prototypes, which drop `const`. header_test.go checks every //export
// against include/kvxfer.h.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/transport"
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

//export kvx_metadata_server_start
func kvx_metadata_server_start(host *C.char, port C.uint16_t, out *C.kvx_metadata_server_t) (rc C.int) {
	const op = "kvx_metadata_server_start"
	defer guard(op, &rc)
	if out == nil {
		return finish(nullArg(op, "out"))
	}
	m, err := startMetaServer(goStr(host), int(port))
	if err != nil {
		return finish(err)
	}
	*out = C.kvx_metadata_server_t(metaSrvs.add(m))
	return finish(nil)
}

//export kvx_metadata_server_addr
func kvx_metadata_server_addr(server C.kvx_metadata_server_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	const op = "kvx_metadata_server_addr"
	defer guard(op, &rc)
	m, ok := metaSrvs.get(uint64(server))
	if !ok {
		return finish(badHandle(op, "metadata server", uint64(server)))
	}
	return finish(writeOut(op, []byte(m.srv.Addr()), true, unsafe.Pointer(buf), capacity, needed))
}

//export kvx_metadata_server_stop
func kvx_metadata_server_stop(server C.kvx_metadata_server_t) (rc C.int) {
	const op = "kvx_metadata_server_stop"
	defer guard(op, &rc)
	m, ok := metaSrvs.take(uint64(server))
	if !ok {
		return finish(badHandle(op, "metadata server", uint64(server)))
	}
	return finish(m.stop())
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
	hb, err := transport.AllocHost(n, int64(size))
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

//export kvx_pointer_device
func kvx_pointer_device(addr unsafe.Pointer, device *C.int) (rc C.int) {
	const op = "kvx_pointer_device"
	defer guard(op, &rc)
	switch {
	case addr == nil:
		return finish(nullArg(op, "addr"))
	case device == nil:
		return finish(nullArg(op, "device"))
	}
	kind, dev, err := detectLocation(uintptr(addr))
	if err != nil {
		return finish(failWrap(stInvalidArgument, err, op))
	}
	*device = -1
	if kind == transport.MemoryCUDA {
		*device = C.int(dev)
	}
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
	return finish(e.deregister(transport.RegionID(region)))
}
