package segengine

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Errors of the segment engine.
var (
	// ErrRegionOverlap: a registration overlaps memory already registered
	// with the engine (a peer virtual address must name one region).
	ErrRegionOverlap = errors.New("overlaps a registered region")
	// ErrSegmentStale: the peer behind an open segment restarted (new epoch)
	// or vanished (its descriptor left the directory: crashed or
	// partitioned); reopen the segment by name. Errors wrapping it also wrap
	// ErrPeerLost.
	ErrSegmentStale = errors.New("segment stale")
	// ErrTransportMismatch: the peer engine does not run this engine's
	// transport (found in its descriptor, or refused by its RPC listener);
	// create both engines with the same transport. A caller's argument
	// error (KVX_ERR_INVALID_ARGUMENT in the C ABI).
	ErrTransportMismatch = errors.New("peer runs another transport")
	// ErrBadSegmentName: the segment name cannot name a peer: empty, or in
	// P2P mode (no directory) not the peer's "host:rpc_port". A caller's
	// argument error (KVX_ERR_INVALID_ARGUMENT in the C ABI).
	ErrBadSegmentName = errors.New("bad segment name")
)

// PeerRead is one READ addressed by the peer's virtual address (Mooncake's
// peer_buffer_address): Length bytes from PeerAddr in the peer process into
// local address Local (inside memory registered with the reading engine).
// When Count > 1 it is strided like PeerWrite: block i is read at
// PeerAddr+i*PeerStride and copied to Local+i*LocalStride; every block must
// lie in the same peer region.
type PeerRead struct {
	Local       uintptr
	PeerAddr    uint64
	Length      uint64
	Count       uint32
	LocalStride uint64
	PeerStride  uint64
}

// PeerWrite is one WRITE addressed by the peer's virtual address (Mooncake's
// peer_buffer_address): Length bytes from local address Local (inside memory
// registered with the sending engine) to PeerAddr in the peer process. When
// Count > 1 it is strided like WriteRequest: block i is read at
// Local+i*LocalStride and written at PeerAddr+i*PeerStride; every block must
// lie in the same peer region.
type PeerWrite struct {
	Local       uintptr
	PeerAddr    uint64
	Length      uint64
	Count       uint32
	LocalStride uint64
	PeerStride  uint64
}

// RemoteSegment is a sender's open segment to a named peer engine: the
// transport Segment plus the peer's descriptor, which translates peer
// virtual addresses to (region, offset). A write that misses every known
// region (or names an unknown region ID) refreshes the descriptor once over
// the peer's RPC listener, so regions the peer registered after the open are
// found.
//
// A RemoteSegment is safe for concurrent use. Close it when done
// (idempotent); TransferEngine.Close closes it too.
type RemoteSegment struct {
	te   *TransferEngine
	name string
	seg  transport.Segment

	mu      sync.Mutex
	desc    transport.SegmentDescriptor
	byID    map[transport.RegionID]transport.RegionDesc
	stale   error
	closed  bool
	refresh sync.Mutex // one refresh at a time
	gen     uint64     // bumped by every completed refresh (under mu)
}

var _ transport.Segment = (*RemoteSegment)(nil)

func (s *RemoteSegment) setDesc(d transport.SegmentDescriptor) {
	d.Regions = transport.SortedRegions(d.Regions)
	s.desc = d
	s.byID = make(map[transport.RegionID]transport.RegionDesc, len(d.Regions))
	for _, r := range d.Regions {
		s.byID[r.ID] = r
	}
}

// Name returns the segment name it was opened by.
func (s *RemoteSegment) Name() string { return s.name }

// Epoch returns the peer's epoch at open.
func (s *RemoteSegment) Epoch() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.desc.Epoch
}

// Descriptor returns a copy of the peer's descriptor as last fetched.
func (s *RemoteSegment) Descriptor() transport.SegmentDescriptor {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.desc
	d.Regions = append([]transport.RegionDesc(nil), d.Regions...)
	return d
}

// Err returns why the segment is stale (wrapping ErrSegmentStale), or nil.
func (s *RemoteSegment) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stale
}

// usable returns the error a submit gets on a stale or closed segment.
func (s *RemoteSegment) usable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("engine: segment %q: %w", s.name, transport.ErrClosed)
	}
	return s.stale
}

// invalidate marks the segment stale and closes its transport connection
// (pending batches fail; the reason is reported with them).
func (s *RemoteSegment) invalidate(reason error) {
	s.mu.Lock()
	if s.stale != nil || s.closed {
		s.mu.Unlock()
		return
	}
	s.stale = reason
	s.mu.Unlock()
	s.te.log.Warn("segment invalidated", "peer", s.name, "reason", reason)
	_ = s.seg.Close()
}

// Refresh fetches the peer's descriptor again over its RPC listener and
// adds the regions registered since (RegionAdder). A different epoch means
// the peer restarted: the segment becomes stale and the error wraps
// ErrSegmentStale. Errors also: the RPC errors, a transport that cannot add
// regions to an open segment.
func (s *RemoteSegment) Refresh(ctx context.Context) error {
	s.mu.Lock()
	gen := s.gen
	s.mu.Unlock()
	return s.refreshAfter(ctx, gen)
}

// refreshAfter refreshes unless a refresh completed since generation gen
// (then the caller just retries with the newer table).
func (s *RemoteSegment) refreshAfter(ctx context.Context, gen uint64) error {
	s.refresh.Lock()
	defer s.refresh.Unlock()
	s.mu.Lock()
	if s.gen != gen {
		s.mu.Unlock()
		return nil
	}
	rpc, epoch := s.desc.RPC, s.desc.Epoch
	s.mu.Unlock()
	if err := s.usable(); err != nil {
		return err
	}
	if rpc == "" {
		return fmt.Errorf("engine: segment %q: the peer publishes no segment RPC address; its descriptor cannot be refreshed", s.name)
	}
	d, err := s.te.describePeer(ctx, rpc, "")
	if err != nil {
		return fmt.Errorf("engine: segment %q: refresh descriptor: %w", s.name, err)
	}
	if d.Epoch != epoch {
		reason := fmt.Errorf("engine: segment %q: the peer at %s restarted (epoch %#x → %#x); reopen the segment: %w: %w", s.name, rpc, epoch, d.Epoch, ErrSegmentStale, transport.ErrPeerLost)
		s.invalidate(reason)
		return reason
	}
	s.mu.Lock()
	var added []transport.RegionDesc
	for _, r := range d.Regions {
		if _, ok := s.byID[r.ID]; !ok {
			added = append(added, r)
		}
	}
	s.mu.Unlock()
	if len(added) > 0 {
		ra, ok := s.seg.(transport.RegionAdder)
		if !ok {
			return fmt.Errorf("engine: segment %q: the peer registered %d new regions but transport %s cannot add regions to an open segment; reopen the segment", s.name, len(added), s.te.tr.Name())
		}
		if err := ra.AddRegions(added); err != nil {
			return fmt.Errorf("engine: segment %q: add %d new regions: %w", s.name, len(added), err)
		}
	}
	s.mu.Lock()
	s.setDesc(d)
	s.gen++
	s.mu.Unlock()
	return nil
}

// lookupAddr translates [addr, addr+span) with the current table.
func (s *RemoteSegment) lookupAddr(addr, span uint64) (transport.RegionDesc, uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := transport.FindRegion(s.desc.Regions, addr, span)
	return r, s.gen, ok
}

// Translate maps the peer virtual address range [addr, addr+length) to the
// region holding it and the offset inside it, refreshing the descriptor
// once when no known region holds it. The error for a range outside every
// registered region wraps ErrOutOfBounds and names the peer, the address,
// the length and the peer's regions.
func (s *RemoteSegment) Translate(ctx context.Context, addr, length uint64) (transport.RegionID, uint64, error) {
	if length == 0 {
		return 0, 0, fmt.Errorf("engine: segment %q: peer address %#x: length is 0 bytes", s.name, addr)
	}
	r, gen, ok := s.lookupAddr(addr, length)
	if !ok {
		if err := s.refreshAfter(ctx, gen); err != nil {
			return 0, 0, fmt.Errorf("engine: segment %q: peer address range [%#x, +%d bytes) is in no known region, and the refresh failed: %w", s.name, addr, length, err)
		}
		if r, _, ok = s.lookupAddr(addr, length); !ok {
			return 0, 0, s.outside(addr, length)
		}
	}
	return r.ID, addr - r.Addr, nil
}

// outside builds the error for a peer range in no registered region.
func (s *RemoteSegment) outside(addr, length uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	for i, r := range s.desc.Regions {
		if i == 8 {
			fmt.Fprintf(&b, " …(%d more)", len(s.desc.Regions)-8)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d:[%#x, +%d)", r.ID, r.Addr, r.Length)
	}
	if b.Len() == 0 {
		b.WriteString("none")
	}
	return fmt.Errorf("engine: segment %q (peer %s, epoch %#x): peer address range [%#x, +%d bytes) is not inside any region the peer registered (regions: %s); register that memory on the peer first: %w",
		s.name, s.desc.RPC, s.desc.Epoch, addr, length, b.String(), transport.ErrOutOfBounds)
}

// span returns the bytes from the first block's start to the last block's
// end of a strided access, and false on overflow.
func span(length uint64, count uint32, stride uint64) (uint64, bool) {
	if count <= 1 {
		return length, true
	}
	hi, lo := bits.Mul64(uint64(count-1), stride)
	if hi != 0 {
		return 0, false
	}
	n, c := bits.Add64(lo, length, 0)
	return n, c == 0
}

// Resolve translates peer-addressed writes into region WriteRequests
// (refreshing the descriptor once when a range misses).
func (s *RemoteSegment) Resolve(ctx context.Context, ws []PeerWrite) ([]transport.WriteRequest, error) {
	out := make([]transport.WriteRequest, len(ws))
	for i, w := range ws {
		n, ok := span(w.Length, w.Count, w.PeerStride)
		if !ok {
			return nil, fmt.Errorf("engine: segment %q: write %d: %d blocks of %d bytes with peer stride %d overflow: %w", s.name, i, w.Count, w.Length, w.PeerStride, transport.ErrOutOfBounds)
		}
		id, off, err := s.Translate(ctx, w.PeerAddr, n)
		if err != nil {
			return nil, fmt.Errorf("write %d: %w", i, err)
		}
		out[i] = transport.WriteRequest{Local: w.Local, Remote: id, RemoteOffset: off, Length: w.Length, Count: w.Count, LocalStride: w.LocalStride, RemoteStride: w.PeerStride}
	}
	return out, nil
}

// SubmitPeerWrites translates ws (Resolve) and submits them as one batch.
func (s *RemoteSegment) SubmitPeerWrites(ctx context.Context, ws []PeerWrite) (transport.BatchID, error) {
	reqs, err := s.Resolve(ctx, ws)
	if err != nil {
		return 0, err
	}
	return s.Submit(ctx, &transport.TransferBatch{Requests: reqs})
}

// ResolveReads translates peer-addressed reads into the region requests of
// a read batch (refreshing the descriptor once when a range misses), as
// Resolve does for writes.
func (s *RemoteSegment) ResolveReads(ctx context.Context, rs []PeerRead) ([]transport.WriteRequest, error) {
	out := make([]transport.WriteRequest, len(rs))
	for i, r := range rs {
		n, ok := span(r.Length, r.Count, r.PeerStride)
		if !ok {
			return nil, fmt.Errorf("engine: segment %q: read %d: %d blocks of %d bytes with peer stride %d overflow: %w", s.name, i, r.Count, r.Length, r.PeerStride, transport.ErrOutOfBounds)
		}
		id, off, err := s.Translate(ctx, r.PeerAddr, n)
		if err != nil {
			return nil, fmt.Errorf("read %d: %w", i, err)
		}
		out[i] = transport.WriteRequest{Local: r.Local, Remote: id, RemoteOffset: off, Length: r.Length, Count: r.Count, LocalStride: r.LocalStride, RemoteStride: r.PeerStride}
	}
	return out, nil
}

// SubmitPeerReads translates rs (ResolveReads) and submits them as one read
// batch (transport.OpRead): the mirror of SubmitPeerWrites. Poll, Wait,
// Cancel and Release apply to the returned ID. Errors: a stale or closed
// segment, a range outside every region the peer registered
// (ErrOutOfBounds), a local range outside registered memory, a transport
// without transport.CapRead (wrapping ErrReadUnsupported); nothing is read
// then.
func (s *RemoteSegment) SubmitPeerReads(ctx context.Context, rs []PeerRead) (transport.BatchID, error) {
	if err := s.readable(); err != nil {
		return 0, err
	}
	reqs, err := s.ResolveReads(ctx, rs)
	if err != nil {
		return 0, err
	}
	return s.Submit(ctx, &transport.TransferBatch{Op: transport.OpRead, Requests: reqs})
}

// Read copies the peer ranges of rs into local memory and returns when they
// have landed (Mooncake's transfer_sync_read): SubmitPeerReads, then Wait
// and Release. Errors: those of SubmitPeerReads, the batch's error when it
// fails (ErrPeerLost for a peer lost mid-read, ErrSegmentStale when the
// peer restarted), ctx's error (the batch is canceled and waited for
// before Read returns, so no byte lands in local memory afterwards).
func (s *RemoteSegment) Read(ctx context.Context, rs []PeerRead) error {
	id, err := s.SubmitPeerReads(ctx, rs)
	if err != nil {
		return err
	}
	return s.waitRead(ctx, id)
}

// ReadRegions is Read for region-addressed requests (a read batch's
// requests: see transport.TransferBatch), refreshing the descriptor once
// for an unknown region ID.
func (s *RemoteSegment) ReadRegions(ctx context.Context, reqs []transport.WriteRequest) error {
	if err := s.readable(); err != nil {
		return err
	}
	id, err := s.Submit(ctx, &transport.TransferBatch{Op: transport.OpRead, Requests: reqs})
	if err != nil {
		return err
	}
	return s.waitRead(ctx, id)
}

// waitRead waits for read batch id and releases it. When ctx ends first it
// cancels the batch and waits (bounded) until it is terminal, so the local
// memory is the caller's again when it returns.
func (s *RemoteSegment) waitRead(ctx context.Context, id transport.BatchID) error {
	defer s.Release(id)
	st, err := s.Wait(ctx, id)
	if err != nil {
		_ = s.Cancel(id)
		dctx, cancel := context.WithTimeout(context.Background(), readDrain)
		defer cancel()
		if st2, err2 := s.Wait(dctx, id); err2 != nil || !st2.State.Terminal() {
			s.invalidate(fmt.Errorf("engine: segment %q: a canceled read did not stop within %v; the segment is closed so that nothing lands in local memory any more: %w", s.name, readDrain, ErrSegmentStale))
		}
		return fmt.Errorf("engine: segment %q: read: %w", s.name, err)
	}
	if st.State != transport.BatchCompleted {
		return fmt.Errorf("engine: segment %q: read %v after %d bytes: %w", s.name, st.State, st.BytesDone, st.Err)
	}
	return nil
}

// readDrain bounds how long Read waits for a canceled read batch to stop.
const readDrain = 10 * time.Second

// readable fails when the segment is stale or closed, or its transport
// cannot read.
func (s *RemoteSegment) readable() error {
	if err := s.usable(); err != nil {
		return err
	}
	if err := transport.CheckOp(s.te.tr.Name(), s.te.tr.Capabilities(), transport.OpRead); err != nil {
		return fmt.Errorf("engine: segment %q: %w", s.name, err)
	}
	return nil
}

// checkRegions verifies every request names a known region and stays inside
// it, refreshing the descriptor once for an unknown region ID.
func (s *RemoteSegment) checkRegions(ctx context.Context, b *transport.TransferBatch) error {
	refreshed := false
	for i := 0; i < len(b.Requests); i++ {
		r := b.Requests[i]
		s.mu.Lock()
		rd, ok := s.byID[r.Remote]
		gen := s.gen
		s.mu.Unlock()
		if !ok && !refreshed {
			refreshed = true
			if err := s.refreshAfter(ctx, gen); err != nil {
				return fmt.Errorf("engine: segment %q: request %d names region %d, unknown here, and the refresh failed: %w", s.name, i, r.Remote, err)
			}
			i-- // look again
			continue
		}
		if !ok {
			return fmt.Errorf("engine: segment %q (epoch %#x): request %d: region %d is not registered on the peer: %w", s.name, s.Epoch(), i, r.Remote, transport.ErrUnknownRegion)
		}
		n, ok := span(r.Length, r.Count, r.RemoteStride)
		if !ok || r.RemoteOffset+n < r.RemoteOffset || r.RemoteOffset+n > rd.Length {
			return fmt.Errorf("engine: segment %q: request %d %ss %d×%d bytes at offset %d (stride %d) of region %d, which has %d bytes: %w",
				s.name, i, b.Op, r.Blocks(), r.Length, r.RemoteOffset, r.RemoteStride, r.Remote, rd.Length, transport.ErrOutOfBounds)
		}
	}
	return nil
}

// Submit checks every request against the peer's regions (refreshing once
// for an unknown region ID), coalesces the requests (transport.Coalescer:
// runs adjacent on both sides merged, with a CapStrided transport
// equal-stride runs sent as one strided request; the counts go to
// the engine's SubmitObserver and CoalesceStats), then submits the batch (a write,
// or a read: transport.TransferBatch.Op) on the transport segment. A stale
// segment fails at once with its reason (ErrSegmentStale).
func (s *RemoteSegment) Submit(ctx context.Context, b *transport.TransferBatch) (transport.BatchID, error) {
	if err := s.usable(); err != nil {
		return 0, err
	}
	if err := s.checkRegions(ctx, b); err != nil {
		return 0, err
	}
	return s.submit(ctx, s.coalesce(b), len(b.Requests))
}

// coalesce returns b with its requests coalesced, or b itself when it has
// one request, a request of length 0 or one whose local range is outside
// the engine's registered memory (the transport then refuses it naming the
// caller's index).
func (s *RemoteSegment) coalesce(b *transport.TransferBatch) *transport.TransferBatch {
	if len(b.Requests) < 2 {
		return b
	}
	lt := s.te.localTable()
	c := transport.NewCoalescer(s.te.caps.Has(transport.CapStrided), len(b.Requests))
	for _, r := range b.Requests {
		n, ok := span(r.Length, r.Count, r.LocalStride)
		if !ok || r.Length == 0 {
			return b
		}
		end, ok := lt.find(uint64(r.Local), n)
		if !ok {
			return b
		}
		c.Add(r, end)
	}
	if c.Out() == len(b.Requests) {
		return b
	}
	return &transport.TransferBatch{Op: b.Op, Requests: c.Requests()}
}

// submit hands a checked (and coalesced) batch to the transport segment;
// in is the number of requests the caller submitted.
func (s *RemoteSegment) submit(ctx context.Context, b *transport.TransferBatch, in int) (transport.BatchID, error) {
	id, err := s.seg.Submit(ctx, b)
	if err != nil {
		if st := s.Err(); st != nil {
			return 0, st
		}
		return 0, err
	}
	s.te.met.submitted(s.te.tr.Name(), b.Op, in, len(b.Requests))
	return id, nil
}

// explain adds the stale reason to a batch that failed because the segment
// was invalidated.
func (s *RemoteSegment) explain(st transport.BatchStatus) transport.BatchStatus {
	if st.State == transport.BatchFailed {
		if reason := s.Err(); reason != nil && !errors.Is(st.Err, ErrSegmentStale) {
			st.Err = fmt.Errorf("%w (batch: %v)", reason, st.Err)
		}
	}
	return st
}

// HandshakeReply returns the transport segment's reply (already delivered
// by OpenSegment).
func (s *RemoteSegment) HandshakeReply() []byte { return s.seg.HandshakeReply() }

// Poll returns the batch's state without blocking.
func (s *RemoteSegment) Poll(id transport.BatchID) (transport.BatchStatus, error) {
	st, err := s.seg.Poll(id)
	return s.explain(st), err
}

// Wait blocks until the batch is terminal or ctx ends.
func (s *RemoteSegment) Wait(ctx context.Context, id transport.BatchID) (transport.BatchStatus, error) {
	st, err := s.seg.Wait(ctx, id)
	return s.explain(st), err
}

// Cancel asks the batch to stop (best effort; keep polling).
func (s *RemoteSegment) Cancel(id transport.BatchID) error { return s.seg.Cancel(id) }

// Release forgets a terminal batch.
func (s *RemoteSegment) Release(id transport.BatchID) { s.seg.Release(id) }

// Close closes the transport segment (pending batches fail) and stops
// watching the peer when no other segment of this engine is open to it.
// Idempotent.
func (s *RemoteSegment) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.te.forget(s)
	return s.seg.Close()
}
