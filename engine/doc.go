// Package engine is kvxfer's transfer engine: registered memory regions, the
// Transport interface and its registry (transports plug in from their own
// packages, the database/sql driver pattern), transfer batches, the ZeroMQ
// control channel, the metadata ring, and the per-request Sender/Receiver
// state machines that report KVPoll states.
//
// The KV memory belongs to the caller (a serving engine): a Manager is built
// from KVArgs, SGLang's per-rank list of KV, aux and state buffers with their
// item lengths and the rank's placement, and derives every size it needs
// from them (Geometry); it knows no model. It registers each buffer with
// each transport, exchanges the geometry with its peers (REGISTER,
// REGISTER_ACK) and pairs buffers and head slices per buffer (PairBuffers).
//
// TransferEngine is the Mooncake-style node on top of one transport: named
// segments ("host:rpc_port" by default), a ZeroMQ segment RPC listener that
// hands peers its SegmentDescriptor, writes addressed by the peer's virtual
// addresses (RemoteSegment translates them to region and offset), and an
// optional SegmentDirectory (etcd, package metadata) to publish to.
//
// Memory that a transport keeps (KV buffers, metadata rings) is never Go heap:
// use AllocHost (memfd + mmap), C memory or CUDA memory. Every resource has an
// idempotent Close.
package engine
