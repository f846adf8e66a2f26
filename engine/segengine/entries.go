package segengine

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// PeerAddressRegion as Entries.Region (and as a C request's remote_region,
// KVX_REGION_PEER_ADDRESS) says that the remote values are addresses in
// the peer process (Mooncake's peer_buffer_address), translated to region
// and offset with the segment's descriptor.
const PeerAddressRegion = transport.RegionID(0xFFFFFFFF)

// ErrLocalNotRegistered: a request's local range is not inside memory
// registered with this engine (RegisterMemory first). A caller's error
// (KVX_ERR_NOT_REGISTERED in the C ABI).
var ErrLocalNotRegistered = errors.New("local memory not registered with this engine")

// ErrBadEntry: a batch entry is malformed (a zero length, arrays of
// different lengths). A caller's argument error (KVX_ERR_INVALID_ARGUMENT
// in the C ABI).
var ErrBadEntry = errors.New("bad batch entry")

// Entries is a transfer batch in struct-of-arrays form, as the C ABI's
// kvx_batch_submit_soa and the Python binding's numpy arrays hand it over:
// entry i moves Length[i] bytes between local address Local[i] and
// Remote[i] of the peer, which is a byte offset in region Region, or, when
// Region is PeerAddressRegion, an address in the peer process. The three
// slices have the same length; they are read during the call only (they
// may be views of a caller's C or numpy memory). Every entry is one block:
// no strides (the engine forms strided requests itself: transport.Coalescer).
type Entries struct {
	Local, Remote, Length []uint64
	Region                transport.RegionID
}

// localTable is a sorted snapshot of the engine's registered memory, with
// the last hit cached: the entries of a batch mostly fall in the region of
// the entry before.
type localTable struct {
	mems []transport.Memory // sorted by Addr; registrations never overlap
	last int                // index of the last hit, -1 before the first
}

// localTable snapshots the engine's registered memory.
func (te *TransferEngine) localTable() *localTable {
	te.mu.Lock()
	t := &localTable{mems: make([]transport.Memory, 0, len(te.regions)), last: -1}
	for _, r := range te.regions {
		t.mems = append(t.mems, r.mem)
	}
	te.mu.Unlock()
	sort.Slice(t.mems, func(i, j int) bool { return t.mems[i].Addr < t.mems[j].Addr })
	return t
}

// find returns the end address of the registered memory holding
// [addr, addr+n) entirely, and false when none does (n > 0).
func (t *localTable) find(addr, n uint64) (uint64, bool) {
	if t.last >= 0 {
		m := t.mems[t.last]
		if lo := uint64(m.Addr); addr >= lo && addr-lo <= m.Length && n <= m.Length-(addr-lo) {
			return lo + m.Length, true
		}
	}
	i := sort.Search(len(t.mems), func(i int) bool { return uint64(t.mems[i].Addr) > addr }) - 1
	if i < 0 {
		return 0, false
	}
	m := t.mems[i]
	if lo := uint64(m.Addr); addr-lo > m.Length || n > m.Length-(addr-lo) {
		return 0, false
	}
	t.last = i
	return uint64(m.Addr) + m.Length, true
}

// remoteTable is a snapshot of the peer's regions for translating peer
// addresses, with the last hit cached.
type remoteTable struct {
	regs []transport.RegionDesc // sorted by Addr (setDesc)
	gen  uint64
	last int
}

func (s *RemoteSegment) remoteTable() *remoteTable {
	s.mu.Lock()
	defer s.mu.Unlock()
	// setDesc replaces the slice and never changes it in place, so it may
	// be read without the lock.
	return &remoteTable{regs: s.desc.Regions, gen: s.gen, last: -1}
}

// find translates [addr, addr+n) to (region, offset).
func (t *remoteTable) find(addr, n uint64) (transport.RegionID, uint64, bool) {
	if t.last >= 0 {
		r := t.regs[t.last]
		if addr >= r.Addr && addr-r.Addr <= r.Length && n <= r.Length-(addr-r.Addr) {
			return r.ID, addr - r.Addr, true
		}
	}
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr > addr }) - 1
	if i < 0 {
		return 0, 0, false
	}
	r := t.regs[i]
	if addr-r.Addr > r.Length || n > r.Length-(addr-r.Addr) {
		return 0, 0, false
	}
	t.last = i
	return r.ID, addr - r.Addr, true
}

// ResolveEntries checks and translates the entries of a batch of op into
// region requests for the transport, handing each to add with the end
// address of the local registered memory holding its local range (what a
// transport.Coalescer needs to merge only inside one registration). Errors
// name the entry's index: different slice lengths, a zero length, a range
// that wraps, a local range outside the engine's registered memory
// (ErrLocalNotRegistered), a peer address range in no region the peer
// registered after one refresh of its descriptor (ErrOutOfBounds), a
// region offset past the region's end (ErrOutOfBounds), a region the peer
// does not have after one refresh (ErrUnknownRegion). Nothing is submitted.
func (s *RemoteSegment) ResolveEntries(ctx context.Context, op transport.Op, e Entries, add func(r transport.WriteRequest, localEnd uint64)) error {
	n := len(e.Local)
	if len(e.Remote) != n || len(e.Length) != n {
		return fmt.Errorf("engine: segment %q: %d local addresses, %d remote addresses and %d lengths: want as many of each: %w", s.name, n, len(e.Remote), len(e.Length), ErrBadEntry)
	}
	if err := s.usable(); err != nil {
		return err
	}
	if e.Region != PeerAddressRegion && n > 0 {
		// One region for every entry: check it once.
		if err := s.checkRegion(ctx, op, e); err != nil {
			return err
		}
	}
	lt := s.te.localTable()
	rt := s.remoteTable()
	refreshed := false
	for i := 0; i < n; i++ {
		local, remote, length := e.Local[i], e.Remote[i], e.Length[i]
		if length == 0 {
			return fmt.Errorf("engine: segment %q: %s %d: length is 0 bytes (want > 0): %w", s.name, op, i, ErrBadEntry)
		}
		if local+length < local || remote+length < remote {
			return fmt.Errorf("engine: segment %q: %s %d: local %#x or remote %#x + %d bytes wraps the address space: %w", s.name, op, i, local, remote, length, transport.ErrOutOfBounds)
		}
		localEnd, ok := lt.find(local, length)
		if !ok {
			return fmt.Errorf("engine: segment %q: %s %d: local range [%#x, +%d bytes) is not inside memory registered with this engine (register it first): %w", s.name, op, i, local, length, ErrLocalNotRegistered)
		}
		req := transport.WriteRequest{Local: uintptr(local), Length: length, Count: 1}
		if e.Region == PeerAddressRegion {
			id, off, ok := rt.find(remote, length)
			if !ok && !refreshed {
				refreshed = true
				if err := s.refreshAfter(ctx, rt.gen); err != nil {
					return fmt.Errorf("engine: segment %q: %s %d: peer address range [%#x, +%d bytes) is in no known region, and the refresh failed: %w", s.name, op, i, remote, length, err)
				}
				rt = s.remoteTable()
				id, off, ok = rt.find(remote, length)
			}
			if !ok {
				return fmt.Errorf("%s %d: %w", op, i, s.outside(remote, length))
			}
			req.Remote, req.RemoteOffset = id, off
		} else {
			req.Remote, req.RemoteOffset = e.Region, remote
		}
		add(req, localEnd)
	}
	return nil
}

// checkRegion checks that region e.Region exists on the peer (refreshing
// once) and holds every entry.
func (s *RemoteSegment) checkRegion(ctx context.Context, op transport.Op, e Entries) error {
	s.mu.Lock()
	rd, ok := s.byID[e.Region]
	gen := s.gen
	s.mu.Unlock()
	if !ok {
		if err := s.refreshAfter(ctx, gen); err != nil {
			return fmt.Errorf("engine: segment %q: the entries name region %d, unknown here, and the refresh failed: %w", s.name, e.Region, err)
		}
		s.mu.Lock()
		rd, ok = s.byID[e.Region]
		s.mu.Unlock()
		if !ok {
			return fmt.Errorf("engine: segment %q (epoch %#x): region %d is not registered on the peer: %w", s.name, s.Epoch(), e.Region, transport.ErrUnknownRegion)
		}
	}
	for i := range e.Remote {
		if e.Remote[i] > rd.Length || e.Length[i] > rd.Length-e.Remote[i] {
			return fmt.Errorf("engine: segment %q: %s %d of %d bytes at offset %d of region %d, which has %d bytes: %w", s.name, op, i, e.Length[i], e.Remote[i], e.Region, rd.Length, transport.ErrOutOfBounds)
		}
	}
	return nil
}

// SubmitEntries checks and translates the entries (ResolveEntries),
// coalesces them as they are translated (see Submit) and submits them as
// one transfer batch of op. Poll, Wait, Cancel and Release apply to the
// returned ID. Errors: those of ResolveEntries, a read on a transport
// without transport.CapRead, and Submit's.
func (s *RemoteSegment) SubmitEntries(ctx context.Context, op transport.Op, e Entries) (transport.BatchID, error) {
	if op == transport.OpRead {
		if err := s.readable(); err != nil {
			return 0, err
		}
	}
	c := transport.NewCoalescer(s.te.caps.Has(transport.CapStrided), len(e.Local))
	if err := s.ResolveEntries(ctx, op, e, c.Add); err != nil {
		return 0, err
	}
	b := &transport.TransferBatch{Op: op, Requests: c.Requests()}
	if err := s.checkRegions(ctx, b); err != nil {
		return 0, err
	}
	return s.submit(ctx, b, c.In())
}
