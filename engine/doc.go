// Package engine is kvxfer's KV room manager: per rank, a Manager built from
// the caller's KV buffers; per request, a Sender (prefill) or Receiver
// (decode) state machine reporting KVPoll states; the ZeroMQ control channel
// between ranks, the metadata ring whose room-tagged record a decode
// verifies before it accepts the KV, fencing of a failed room's producers,
// liveness (PING, bootstrap heartbeats), metrics, room timelines and
// optional OpenTelemetry spans, and the doctor's probes (Prober).
//
// The KV memory belongs to the caller (a serving engine): a Manager is built
// from kvargs.KVArgs, SGLang's per-rank list of KV, aux and state buffers
// with their item lengths and the rank's placement, and derives every size
// it needs from them (kvargs.Geometry); it knows no model. It registers each
// buffer with each transport, exchanges the geometry with its peers
// (REGISTER, REGISTER_ACK) and pairs buffers and head slices per buffer
// (kvargs.PairBuffers). The package example runs one room end to end.
//
// The rest of the transfer engine lives beside it, each in its own package:
//   - engine/transport: the transport SPI (Transport, Segment, Memory,
//     transfer batches, Fencer, the registry, segment descriptors and the
//     SegmentDirectory interface, AllocHost); a leaf the transports
//     (engine/tcp, engine/shm, rdma) implement;
//   - engine/kvargs: the KV argument types, their validation and pairing;
//   - engine/internal/control: the control frames' codec (the envelope,
//     replay protection), used only by this package and the segment engine;
//   - engine/segengine: the Mooncake-style TransferEngine over named
//     segments, which the C ABI and the Python TransferEngine drive.
//
// Memory that a transport keeps (KV buffers, metadata rings) is never Go heap:
// use transport.AllocHost (memfd + mmap), C memory or CUDA memory. Every
// resource has an idempotent Close. The package reads no environment
// variable: cmd/, capi/ and python/ turn flags and env into ManagerConfig.
package engine
