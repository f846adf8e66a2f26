package transport

import (
	"context"
	"errors"
	"fmt"
)

// MemoryKind says where a memory range lives.
type MemoryKind uint8

//go:generate go run golang.org/x/tools/cmd/stringer@v0.51.0 -type MemoryKind,BatchState,Op -linecomment -output transport_string.go

const (
	// MemoryHost is CPU memory (mmap, memfd, malloc or CUDA pinned host memory).
	MemoryHost MemoryKind = 0 // host
	// MemoryCUDA is device memory on the GPU named by Memory.Device.
	MemoryCUDA MemoryKind = 1 // cuda
)

// Memory describes a range of memory a transport may register.
//
// The memory must not be Go heap: use AllocHost (memfd + mmap), C memory or
// CUDA memory. The caller keeps ownership and must keep the range mapped until
// it is deregistered from every transport it was registered with.
type Memory struct {
	// Addr is the first byte of the range in this process's address space
	// (a device pointer for MemoryCUDA).
	Addr uintptr
	// Length is the size of the range in bytes (> 0).
	Length uint64
	// Kind says whether Addr is host or device memory.
	Kind MemoryKind
	// Device is the CUDA device ordinal for MemoryCUDA; ignored for host memory.
	Device int
	// FD is a file descriptor backing the range from offset FDOffset (a memfd from
	// AllocHost), or -1 if the range has no backing file. The same-host shm
	// transport needs it to share the range with another process.
	FD int
	// FDOffset is the offset of Addr inside FD, in bytes.
	FDOffset uint64
}

// RegionID names a region registered with one transport on one node. IDs are
// assigned by the registering transport and are unique for its lifetime.
type RegionID uint32

// RegionDesc is what a receiver tells a sender about one of its registered
// regions: it travels in the REGISTER control frame. Writes name the region by
// ID and an offset inside it; the receiving side (or its NIC, for RDMA) refuses
// anything outside [0, Length).
type RegionDesc struct {
	// ID is the owner's region ID.
	ID RegionID
	// Addr is the region's first byte in the owner's address space (used by
	// RDMA as the remote address base; informational for TCP and shm).
	Addr uint64
	// Length is the region size in bytes.
	Length uint64
	// Kind is host or device memory on the owner.
	Kind MemoryKind
	// Key is transport-specific and opaque to the engine: RDMA rkeys, the shm
	// object name, nothing for TCP.
	Key []byte
}

// WriteRequest is one one-sided WRITE in a transfer batch: Length bytes from
// local address Local (inside a region the sender registered with the same
// transport) to byte RemoteOffset of remote region Remote.
//
// When Count > 1 the request is strided: Count blocks of Length bytes each,
// block i read from Local+i*LocalStride and written at
// RemoteOffset+i*RemoteStride. This carries TP-mismatch head slicing as one
// descriptor per page run instead of one request per token slot.
//
// In a read batch (TransferBatch.Op == OpRead) the same fields describe the
// reverse direction: block i is copied FROM byte RemoteOffset+i*RemoteStride
// of remote region Remote INTO local address Local+i*LocalStride (inside
// memory registered with the reading side's transport).
type WriteRequest struct {
	Local        uintptr
	Remote       RegionID
	RemoteOffset uint64
	Length       uint64
	Count        uint32
	LocalStride  uint64
	RemoteStride uint64
}

// Blocks returns the number of Length-byte blocks the request moves (Count, or
// 1 when Count is 0).
func (r WriteRequest) Blocks() uint64 {
	if r.Count == 0 {
		return 1
	}
	return uint64(r.Count)
}

// Bytes returns the total payload of the request in bytes.
func (r WriteRequest) Bytes() uint64 { return r.Blocks() * r.Length }

// Op is the direction of a transfer batch.
type Op uint8

const (
	// OpWrite (the zero value): one-sided WRITEs from local memory into the
	// remote node's registered regions.
	OpWrite Op = 0 // write
	// OpRead: one-sided READs from the remote node's registered regions
	// into local registered memory. It needs CapRead; a transport without
	// it fails Submit with an error wrapping ErrReadUnsupported.
	OpRead Op = 1 // read
)

// TransferBatch is an ordered list of one-sided requests submitted together
// to one segment, all in the direction Op (OpWrite, the zero value, for
// every batch that does not say otherwise). Requests inside a batch may
// complete in any order; the batch completes when all of them have landed:
// in the receiver's memory for a write, in local memory for a read.
//
// A read batch obeys the same rules as a write batch: the same validation
// (unknown region → ErrUnknownRegion, a range outside the remote region or
// a local range outside registered memory → ErrOutOfBounds, and then
// nothing is moved), the same batch table (Poll, Wait, Cancel, Release),
// the same epochs and fencing (the memory's owner serves no read of an
// epoch it fenced or never admitted), and the same ErrPeerLost when the
// remote node goes away: local memory named by a read that did not
// complete holds unspecified bytes.
//
// LastAfterAll (a write batch, on a transport with CapOrderedLast) orders
// the batch's last request after all the others: it is written only once
// every other request of the batch has landed in the receiver's memory,
// and a reader that sees its bytes sees every byte of the batch (a
// metadata record's commit word in the batch of the record and its pages,
// so the commit needs no batch of its own). The last request must be one
// block of 8 bytes at an 8-byte aligned remote offset; the batch completes
// once it landed too. A transport without CapOrderedLast refuses such a
// batch (CheckBatch).
type TransferBatch struct {
	Op           Op
	Requests     []WriteRequest
	LastAfterAll bool
}

// Bytes returns the total payload of the batch in bytes.
func (b *TransferBatch) Bytes() uint64 {
	var n uint64
	for _, r := range b.Requests {
		n += r.Bytes()
	}
	return n
}

// BatchID is an opaque key into a segment's batch table (never a pointer).
type BatchID uint64

// BatchState is the life of a submitted batch.
type BatchState uint8

const (
	// BatchPending: submitted, not all requests have completed.
	BatchPending BatchState = iota // pending
	// BatchCompleted: every byte landed in the receiver's memory (terminal).
	BatchCompleted // completed
	// BatchFailed: at least one request failed; Err says why (terminal).
	BatchFailed // failed
	// BatchCanceled: Cancel took effect before completion (terminal).
	BatchCanceled // canceled
)

// Terminal reports whether the state never changes again.
func (s BatchState) Terminal() bool { return s != BatchPending }

// BatchStatus is a snapshot of a batch.
type BatchStatus struct {
	State BatchState
	// BytesDone is the payload known to have landed, in bytes.
	BytesDone uint64
	// Err is set when State is BatchFailed or BatchCanceled.
	Err error
}

// Caps are a transport's capability flags.
type Caps uint32

const (
	// CapHostMemory: can register and move host memory.
	CapHostMemory Caps = 1 << iota
	// CapDeviceMemory: can register CUDA device memory (natively or by bounce).
	CapDeviceMemory
	// CapCrossHost: can reach a peer on another host.
	CapCrossHost
	// CapZeroCopy: moves bytes with no staging copy on the host.
	CapZeroCopy
	// CapStrided: executes strided WriteRequests natively (no expansion).
	CapStrided
	// CapHandshake: OpenSegment returns a reply that the receiver must Accept
	// (the transport implements Acceptor), e.g. RDMA QP exchange.
	CapHandshake
	// CapRead: Submit executes read batches (TransferBatch.Op == OpRead):
	// one-sided READs of the remote node's registered regions, served by
	// the remote transport (tcp), its NIC (rdma READ work requests) or a
	// mapping of its memory (shm).
	CapRead
	// CapOrderedLast: Submit honours TransferBatch.LastAfterAll: the
	// batch's last request (an 8-byte commit word) is written only after
	// every other request of the batch landed (shm: the sender's copies
	// end, then one atomic store, a release on every architecture Go
	// supports; tcp: the last frame is sent once every other frame of the
	// batch was acknowledged, each acknowledgement coming after its bytes
	// landed).
	CapOrderedLast
)

// Has reports whether all flags in want are set.
func (c Caps) Has(want Caps) bool { return c&want == want }

// SegmentInfo is what a sender needs to open a segment on a receiver: the
// receiver's endpoint blob from Transport.Endpoint and its region table.
type SegmentInfo struct {
	// Endpoint is the receiver's opaque endpoint blob for this transport.
	Endpoint []byte
	// Regions are the receiver's registered regions this segment may write.
	Regions []RegionDesc
	// Epoch is the segment epoch the receiver chose for this data path (the
	// KV manager's REGISTER epoch; see NewEpoch). A transport that fences
	// (Fencer) carries it on the data path, and its receiving side refuses
	// writes of an epoch it has fenced or never admitted. 0 means no epoch:
	// raw transport users that never fence.
	Epoch uint64
}

// Transport moves bytes by one-sided WRITEs from registered local memory into a
// remote node's registered regions and, with CapRead, by one-sided READs the
// other way. A Transport is one node's instance: it both serves (listener,
// registered regions) and initiates (segments).
//
// Implementations are safe for concurrent use.
type Transport interface {
	// Name is the registry name ("tcp", "shm", "rdma").
	Name() string
	// Capabilities returns the transport's flags.
	Capabilities() Caps
	// RegisterMemory registers m for local use (the source of writes and the
	// destination of reads this node submits) and remote use (the
	// destination of peers' writes, the source of peers' reads) and returns
	// its descriptor. Errors name the range and cause.
	RegisterMemory(m Memory) (RegionDesc, error)
	// DeregisterMemory removes a region; later writes to it and reads of it
	// are refused.
	DeregisterMemory(id RegionID) error
	// Endpoint returns the blob a sender needs to reach this node, prepared
	// for the named peer (a transport with per-peer state, such as an RDMA QP,
	// creates it here; others return the same blob every time).
	Endpoint(ctx context.Context, peer string) ([]byte, error)
	// OpenSegment connects the sending side to a receiver.
	OpenSegment(ctx context.Context, info SegmentInfo) (Segment, error)
	// Close releases everything; idempotent. Pending batches fail.
	Close() error
}

// Acceptor is implemented by transports with CapHandshake: the receiver feeds
// the sender's Segment.HandshakeReply for the peer it prepared in Endpoint.
type Acceptor interface {
	Accept(ctx context.Context, peer string, reply []byte) error
}

// Fencer is implemented by transports whose receiving side can fence a data
// path: cut one sender's segment so that nothing it writes lands any more,
// even a write the sender (stalled, or unaware) posts later. The KV manager
// of a decode admits the epoch of every registration (NewEpoch) before it
// sends REGISTER, and fences it when a producer of a failed room does not
// acknowledge the abort in time, reports an unclean abort, or is lost; the
// room's destination pages and metadata slot are reused only after that.
//
// How each transport fences: tcp closes the epoch's inbound connections and
// waits until no receive into memory is in progress, then refuses the epoch;
// rdma moves the peer's QPs to the error state and destroys them (the next
// registration creates new ones); shm, which cannot revoke a sender's
// mapping, raises a flag the sender checks before every copy and waits until
// the sender has no copy in progress or its process has exited.
type Fencer interface {
	// AdmitEpoch lets segments that the sender named peer (the peer string
	// given to Endpoint) opens with SegmentInfo.Epoch == epoch (>= 1) write
	// into this node's regions until FenceEpoch. Errors: epoch 0, a closed
	// transport, no room for another admitted epoch.
	AdmitEpoch(peer string, epoch uint64) error
	// FenceEpoch cuts the data path of epoch: when it returns nil, no byte
	// written through a segment of that epoch lands in this node's memory
	// any more, now or later, and segments opened with it are refused. It
	// blocks until that holds or ctx ends; then it returns an error wrapping
	// ctx's error (for shm: a sender stopped in the middle of a copy), and
	// the caller keeps the memory quarantined and calls it again. Fencing an
	// epoch never admitted, or already fenced, returns nil.
	FenceEpoch(ctx context.Context, peer string, epoch uint64) error
}

// Segment is a sender's connection to one receiver's regions.
//
// Cancel is best effort: after Cancel, keep polling until the batch reaches a
// terminal state; bytes already written stay written.
type Segment interface {
	// HandshakeReply returns the blob the receiver must Accept (nil if the
	// transport needs no second handshake step).
	HandshakeReply() []byte
	// Submit starts a batch (a write, or with CapRead a read: see
	// TransferBatch.Op). The local memory must stay valid (and, for a
	// write, unchanged) until the batch is terminal. Validation errors
	// (unknown region, out of bounds, a read on a transport without
	// CapRead) are returned at once and nothing is moved.
	Submit(ctx context.Context, b *TransferBatch) (BatchID, error)
	// Poll returns the batch's state without blocking. A terminal status is
	// returned until Release.
	Poll(id BatchID) (BatchStatus, error)
	// Wait blocks until the batch is terminal or ctx ends.
	Wait(ctx context.Context, id BatchID) (BatchStatus, error)
	// Cancel asks for the batch to stop.
	Cancel(id BatchID) error
	// Release forgets a terminal batch.
	Release(id BatchID)
	// Close tears down the connection; idempotent. Pending batches fail.
	Close() error
}

// RegionAdder is implemented by transport Segments whose region table can
// grow after OpenSegment: AddRegions makes writes to the given regions of the
// receiver valid on this segment (regions already known are ignored). The
// receiver still checks every write. TransferEngine calls it when a refresh
// of the peer's descriptor finds regions registered after the open.
type RegionAdder interface {
	AddRegions(regions []RegionDesc) error
}

// ErrReadUnsupported: the transport has no CapRead (it moves bytes by
// one-sided WRITE only), so Submit refuses a read batch.
var ErrReadUnsupported = errors.New("transport cannot read: one-sided WRITE only")

// Errors shared by every transport. Transports wrap them with context
// ("tcp: write to region 3 at offset 4096+8192: ...").
var (
	// ErrOutOfBounds: a write falls outside its remote region, or a local
	// address is not inside a registered local region.
	ErrOutOfBounds = errors.New("out of bounds of the registered region")
	// ErrUnknownRegion: the region ID is not registered (or was deregistered).
	ErrUnknownRegion = errors.New("unknown region")
	// ErrClosed: the transport or segment is closed.
	ErrClosed = errors.New("closed")
	// ErrPeerLost: the peer closed the connection or vanished mid-batch.
	ErrPeerLost = errors.New("peer lost")
	// ErrCanceled: the batch was canceled.
	ErrCanceled = errors.New("canceled")
	// ErrUnknownBatch: the batch ID is unknown or already released.
	ErrUnknownBatch = errors.New("unknown batch")
	// ErrUnsupportedMemory: the transport cannot register this kind of memory.
	ErrUnsupportedMemory = errors.New("memory kind not supported by this transport")
	// ErrUnavailable: the transport cannot run on this host (no device, ...).
	ErrUnavailable = errors.New("transport unavailable on this host")
	// ErrFenced: the receiver fenced this data path (Fencer.FenceEpoch), or
	// never admitted its epoch; the segment cannot write any more. Errors
	// wrapping it also wrap ErrPeerLost, so callers that only know ErrPeerLost
	// treat it as a lost peer.
	ErrFenced = errors.New("data path fenced by the receiver")
)

// CheckBatch returns nil when a transport with capabilities caps executes
// b as given (CheckOp for its direction; LastAfterAll needs
// CapOrderedLast, a write batch and a last request of one 8-byte block at
// an 8-byte aligned remote offset), else the error its Submit returns
// (prefixed with owner).
func CheckBatch(owner string, caps Caps, b *TransferBatch) error {
	if err := CheckOp(owner, caps, b.Op); err != nil {
		return err
	}
	if !b.LastAfterAll {
		return nil
	}
	switch {
	case !caps.Has(CapOrderedLast):
		return fmt.Errorf("%s: submit: LastAfterAll: this transport cannot order a batch's last write after the others (no CapOrderedLast); submit the last write in a batch of its own once the others completed", owner)
	case b.Op != OpWrite:
		return fmt.Errorf("%s: submit: LastAfterAll is for write batches, not %s", owner, b.Op)
	case len(b.Requests) == 0:
		return fmt.Errorf("%s: submit: LastAfterAll on an empty batch", owner)
	}
	if r := b.Requests[len(b.Requests)-1]; r.Blocks() != 1 || r.Length != 8 || r.RemoteOffset%8 != 0 {
		return fmt.Errorf("%s: submit: LastAfterAll: the last request is %d×%d bytes at remote offset %d; it must be one block of 8 bytes at an 8-byte aligned offset (a commit word)", owner, r.Blocks(), r.Length, r.RemoteOffset)
	}
	return nil
}

// CheckOp returns nil when a transport with capabilities caps executes
// batches of op, else the error its Submit returns (prefixed with owner, the
// transport's name): an op that is neither OpWrite nor OpRead, or OpRead
// without CapRead (wrapping ErrReadUnsupported).
func CheckOp(owner string, caps Caps, op Op) error {
	switch {
	case op == OpWrite:
		return nil
	case op == OpRead && caps.Has(CapRead):
		return nil
	case op == OpRead:
		return fmt.Errorf("%s: submit read batch: %w", owner, ErrReadUnsupported)
	}
	return fmt.Errorf("%s: submit: unknown batch op %d (want OpWrite or OpRead)", owner, op)
}
