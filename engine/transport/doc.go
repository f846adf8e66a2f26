// Package transport is kvxfer's transport SPI: what a transport implements
// and what every user of a transport (the KV manager in package engine, the
// segment engine in engine/segengine, the bench, the C ABI) programs against.
// It is a leaf: it imports only the standard library and golang.org/x/sys,
// so a transport package (engine/tcp, engine/shm, rdma) links nothing of
// the control plane (no ZeroMQ, Prometheus, OpenTelemetry or bootstrap
// client); internal/layers keeps it so.
//
// What it holds:
//   - the interfaces: Transport (one node's instance: registered regions,
//     endpoint, segments), Segment (a sender's connection to one receiver:
//     Submit/Poll/Wait/Cancel/Release of TransferBatches of one-sided
//     requests, WRITEs or, with CapRead, READs: TransferBatch.Op), and the
//     optional ones a transport or segment may implement, each asserted at compile time by the transports: Acceptor
//     (CapHandshake: the receiver accepts the sender's handshake reply),
//     Fencer (admit and fence segment epochs; the KV manager's stale-writer
//     protection, required by the conformance suite engine/transporttest),
//     and RegionAdder (grow an open segment's region table);
//   - the data they move: Memory and MemoryKind, RegionID and RegionDesc,
//     WriteRequest, Op, TransferBatch, BatchID/BatchState/BatchStatus, Caps
//     (CheckOp: whether a transport executes a batch's op), SegmentInfo,
//     and the errors every transport wraps (ErrOutOfBounds,
//     ErrUnknownRegion, ErrPeerLost, ErrFenced, ErrReadUnsupported, ...);
//   - the registry (the database/sql driver pattern): RegisterTransport from
//     a transport's init, ProbeTransport, OpenTransport and OpenTransports
//     (the one meaning of a --transport value), Options and the
//     per-transport TCPOptions, SHMOptions and RDMAOptions;
//   - segment epochs (NewEpoch) and segment descriptors (SegmentDescriptor,
//     its versioned wire form, FindRegion) with the SegmentDirectory
//     interface a metadata backend (package metadata: etcd) implements;
//   - memory a transport may keep pointers into: AllocHost (memfd + mmap,
//     never Go heap), Prefault, ParseLocation ("host", "cuda:N"), and
//     BatchTable, the batch table the transports share so that Poll, Wait
//     and Release behave the same everywhere.
//
// Error texts keep the "engine:" prefix they had when this was part of
// package engine, so logs and matching callers see the same words.
package transport
