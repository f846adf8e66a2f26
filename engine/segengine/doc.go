// Package segengine is kvxfer's Mooncake-style segment engine: a
// TransferEngine is one node on top of one transport, with named segments
// ("host:rpc_port" by default, Mooncake's P2P handshake naming), a ZeroMQ
// segment RPC listener that hands peers its transport.SegmentDescriptor (and,
// for transports with a handshake, an endpoint prepared for the asking
// peer), and writes addressed by the peer's virtual addresses
// (RemoteSegment translates a PeerWrite to region and offset, refreshing the
// peer's descriptor once when an address misses). With a
// transport.SegmentDirectory (etcd, package metadata) it publishes its
// descriptor there and resolves peers by name; a peer that restarts (new
// epoch) or leaves the directory makes its open segments fail with
// ErrSegmentStale.
//
// Every batch is coalesced before the transport sees it
// (transport.Coalescer): requests adjacent on both sides merge, and on a
// CapStrided transport equal-stride runs become one strided request
// (a SubmitObserver and CoalesceStats count both). Entries and
// SubmitEntries take a batch as three arrays (struct of arrays), the shape
// Mooncake's callers hold, and coalesce it while translating it.
//
// It is what the C ABI's kvx_engine_* / kvx_segment_* functions and the
// Python TransferEngine (Mooncake's API) drive. It is independent of the KV
// room manager (package engine): the two share only the transport SPI
// (engine/transport) and the control codec's frame reader.
//
// The package name says what it is (an engine of named segments) without
// claiming Mooncake's wire protocol, which it does not speak; the type keeps
// Mooncake's name, TransferEngine, as its callers know it.
package segengine
