package transport

import (
	"context"
	"errors"
)

// SegmentDirectory is a metadata backend that stores segment descriptors by
// segment name, so that a sender can open a segment by name without asking
// the peer first (Mooncake's metadata server). Package metadata implements
// it for etcd; engine never imports a backend. A TransferEngine without a
// directory uses the P2P handshake: the segment name is "host:rpc_port" and
// the descriptor comes from the peer's RPC listener.
//
// Implementations are safe for concurrent use. The engine does not close
// the directory: whoever created it does, after closing the engine.
type SegmentDirectory interface {
	// Publish stores desc under desc.Name, bound to the backend's lease, so
	// that it disappears within the lease TTL when this process stops
	// keeping the lease alive (crash, partition, SIGSTOP). A later Publish of
	// the same name replaces it. When the lease is lost while the process
	// lives, the backend publishes the latest descriptors again under a new
	// lease as soon as the store is reachable. Errors wrap
	// ErrMetadataUnavailable when the store cannot be reached.
	Publish(ctx context.Context, desc SegmentDescriptor) error
	// Unpublish removes name (orderly shutdown) and stops re-publishing it.
	Unpublish(ctx context.Context, name string) error
	// Resolve returns the descriptor published under name and an ordering
	// token (the store's revision) to pass to Watch. Errors wrap
	// ErrSegmentNotFound or ErrMetadataUnavailable and name the store.
	Resolve(ctx context.Context, name string) (SegmentDescriptor, int64, error)
	// Watch calls fn, from one goroutine and in order, for every change of
	// name's descriptor after revision rev (from Resolve): a new descriptor
	// (Deleted false; its Epoch tells a restart from a refresh) or its
	// disappearance (Deleted true: lease expired or unpublished). The watch
	// survives store outages (events are delivered when it returns); stop
	// ends it and returns once fn is no longer running. fn must not call
	// stop.
	Watch(name string, rev int64, fn func(SegmentEvent)) (stop func())
	// String names the backend and its endpoints for error messages, e.g.
	// "etcd://127.0.0.1:2379/kvxfer".
	String() string
}

// SegmentEvent is a change of a watched segment's descriptor.
type SegmentEvent struct {
	// Name is the segment name.
	Name string
	// Deleted is set when the descriptor vanished from the directory.
	Deleted bool
	// Desc is the new descriptor when Deleted is false.
	Desc SegmentDescriptor
	// Rev is the store revision of the change.
	Rev int64
}

// Errors of named segments. The wrapping errors name the segment, the peer
// and the directory.
var (
	// ErrSegmentNotFound: no engine publishes a segment under this name.
	ErrSegmentNotFound = errors.New("segment not found")
	// ErrMetadataUnavailable: the metadata store (etcd) cannot be reached or
	// did not answer in time; established segments keep working.
	ErrMetadataUnavailable = errors.New("metadata store unavailable")
)
