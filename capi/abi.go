//go:build cgo

package main

// Compile-time checks that the C header's ABI structs and constants agree
// with the engine: a mismatch makes `go build` fail with "index out of
// bounds" on the line that names the drifted field.

/*
#define KVX_TYPES_ONLY 1
#include "capi.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/agent"
)

// same is a zero-size array indexed by the difference of two constants.
type same [1]struct{}

var (
	_ = same{}[unsafe.Sizeof(C.kvx_meta_record{})-engine.RecordSize]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.commit)-engine.RecordCommitOffset]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.checksum)-32]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.byte_count)-24]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.token_count)-engine.RecordTokenCountOffset]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.layer_count)-engine.RecordLayerCountOffset]
	_ = same{}[unsafe.Offsetof(C.kvx_meta_record{}.epoch)-engine.RecordEpochOffset]
	_ = same{}[C.KVX_RECORD_SIZE-engine.RecordSize]
	_ = same{}[C.KVX_RECORD_COMMIT_MAGIC^engine.RecordCommitMagic]
	_ = same{}[C.KVX_RECORD_FLAG_CHECKSUM^engine.RecordFlagChecksum]
	_ = same{}[C.KVX_RECORD_FLAG_LAYERWISE^engine.RecordFlagLayerwise]
	_ = same{}[C.KVX_KVPOLL_FAILED-int(engine.KVFailed)]
	_ = same{}[C.KVX_KVPOLL_BOOTSTRAPPING-int(engine.KVBootstrapping)]
	_ = same{}[C.KVX_KVPOLL_WAITING_FOR_INPUT-int(engine.KVWaitingForInput)]
	_ = same{}[C.KVX_KVPOLL_TRANSFERRING-int(engine.KVTransferring)]
	_ = same{}[C.KVX_KVPOLL_SUCCESS-int(engine.KVSuccess)]
	_ = same{}[unsafe.Sizeof(C.kvx_write_request{})-48]
	_ = same{}[C.KVX_REGION_PEER_ADDRESS-uint32(peerAddressRegion)]
	_ = same{}[unsafe.Offsetof(C.kvx_engine_config{}.local_hostname)-C.KVX_ENGINE_CONFIG_SIZE_V1]
	_ = same{}[unsafe.Sizeof(C.kvx_region_info{})-24]
	_ = same{}[unsafe.Offsetof(C.kvx_kv_config{}.num_kv_buffers)-C.KVX_KV_CONFIG_SIZE_V1]
	_ = same{}[unsafe.Offsetof(C.kvx_kv_config{}.bootstrap_auth_token)-C.KVX_KV_CONFIG_SIZE_V2]
	_ = same{}[unsafe.Offsetof(C.kvx_kv_config{}.control_auth)-C.KVX_KV_CONFIG_SIZE_V3]
	_ = same{}[unsafe.Offsetof(C.kvx_kv_config{}.decode_allocation_policy)-C.KVX_KV_CONFIG_SIZE_V4]
	_ = same{}[unsafe.Offsetof(C.kvx_kv_config{}.prefill_http_port)-C.KVX_KV_CONFIG_SIZE_V5]
	_ = same{}[C.KVX_CONTROL_AUTH_ENV-controlAuthEnv]
	_ = same{}[C.KVX_CONTROL_AUTH_ON-controlAuthOn]
	_ = same{}[C.KVX_CONTROL_AUTH_OFF-controlAuthOff]
	_ = same{}[unsafe.Sizeof(C.kvx_transfer_metric{})-48]
	_ = same{}[C.KVX_XFER_NOT_POSTED-int(agent.XferNotPosted)]
	_ = same{}[C.KVX_XFER_PROC-int(agent.XferProc)]
	_ = same{}[C.KVX_XFER_DONE-int(agent.XferDone)]
	_ = same{}[C.KVX_XFER_ERR-int(agent.XferErr)]
	_ = same{}[C.KVX_XFER_CANCELED-int(agent.XferCanceled)]
	_ = same{}[C.KVX_XFER_READ-uint32(agent.OpRead)]
	_ = same{}[C.KVX_XFER_WRITE-uint32(agent.OpWrite)]
	_ = same{}[unsafe.Sizeof(C.kvx_agent_desc{})-24]
	_ = same{}[unsafe.Sizeof(C.kvx_xfer_telemetry{})-40]
	_ = same{}[unsafe.Sizeof(C.kvx_agent_config{})-48]
)
