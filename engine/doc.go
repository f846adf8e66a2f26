// Package engine is kvxfer's transfer engine: registered memory regions, the
// Transport interface and its registry (transports plug in from their own
// packages, the database/sql driver pattern), transfer batches, the ZeroMQ
// control channel, the metadata ring, and the per-request Sender/Receiver
// state machines that report KVPoll states.
//
// Memory that a transport keeps (KV pools, metadata rings) is never Go heap:
// use AllocHost (memfd + mmap), C memory or CUDA memory. Every resource has an
// idempotent Close.
package engine
