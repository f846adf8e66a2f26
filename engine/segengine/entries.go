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
// add gets one single-block request (Count 1) per entry, in order.
func (s *RemoteSegment) ResolveEntries(ctx context.Context, op transport.Op, e Entries, add func(r transport.WriteRequest, localEnd uint64)) error {
	return s.resolve(ctx, op, e, false, false, add)
}

// minRun is the fewest entries resolve checks as one run (see runEnd):
// shorter ones cost no more entry by entry.
const minRun = 3

// runEnd returns the index j of the last entry of the run that starts at
// entry i: entries i..j have one length L > 0, and consecutive entries are
// a local stride ls and a remote stride rs apart, both at least L (the
// blocks do not overlap on either side), with Local and Remote strictly
// increasing (so no step wraps the address space: Local[k] =
// Local[i] + (k-i)*ls exactly, likewise Remote). j == i when entry i
// starts no run of two or more.
//
// Why checking a run's first and last entry is enough: for i <= k <= j,
// Local[i] <= Local[k] <= Local[j], so Local[k] >= lo and Local[k]+L <=
// Local[j]+L <= hi for any [lo, hi) that holds [Local[i], +L) and
// [Local[j], +L); the same for Remote. So when one registered local region
// holds the first and the last entry's local range, and one peer region
// their remote range, every entry of the run lies inside those two
// regions. (Both ends must be checked against the same region: two
// registrations may sit side by side with a gap, or none, between them.)
func runEnd(e Entries, i int) int {
	n := len(e.Local)
	if i+1 >= n {
		return i
	}
	L := e.Length[i]
	l0, r0 := e.Local[i], e.Remote[i]
	l1, r1 := e.Local[i+1], e.Remote[i+1]
	if L == 0 || e.Length[i+1] != L || l1 <= l0 || r1 <= r0 {
		return i
	}
	ls, rs := l1-l0, r1-r0
	if ls < L || rs < L {
		return i
	}
	j := i + 1
	for j+1 < n {
		nl, nr := e.Local[j+1], e.Remote[j+1]
		if e.Length[j+1] != L || nl <= e.Local[j] || nr <= e.Remote[j] || nl-e.Local[j] != ls || nr-e.Remote[j] != rs {
			break
		}
		j++
	}
	return j
}

// resolve is ResolveEntries. With runs, a run of entries (runEnd) whose
// first and last entry are inside one local registration and one peer
// region reaches add as few requests: adjacent on both sides as one
// contiguous request of at most transport.CoalesceMaxBytes, otherwise,
// when strided (the transport has transport.CapStrided), as strided
// requests of at most transport.CoalesceMaxStridedBytes, else entry by
// entry. A run that fails that check is resolved entry by entry, which
// names the first bad entry.
func (s *RemoteSegment) resolve(ctx context.Context, op transport.Op, e Entries, runs, strided bool, add func(r transport.WriteRequest, localEnd uint64)) error {
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
	slowTo := -1 // entries up to slowTo go entry by entry (a run that failed its check)
	for i := 0; i < n; {
		if i > slowTo {
			if j := runEnd(e, i); j-i+1 >= minRun {
				if s.addRun(e, i, j, lt, rt, runs, strided, add) {
					i = j + 1
					continue
				}
				slowTo = j
			}
		}
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
		i++
	}
	return nil
}

// addRun checks the run of entries i..j (runEnd; j > i) by its first and
// last entry (see runEnd for why that covers every entry) and hands it to
// add (as resolve says); false, with nothing added, when the two are not
// inside one local registration and one peer region (a region's offsets
// were checked entry by entry by checkRegion already), so that the caller
// resolves the run entry by entry.
func (s *RemoteSegment) addRun(e Entries, i, j int, lt *localTable, rt *remoteTable, runs, strided bool, add func(r transport.WriteRequest, localEnd uint64)) bool {
	L := e.Length[i]
	first, last := e.Local[i], e.Local[j]
	localEnd, ok := lt.find(first, L)
	if !ok || last > localEnd || L > localEnd-last {
		return false
	}
	rfirst, rlast := e.Remote[i], e.Remote[j]
	region, off := e.Region, rfirst
	if e.Region == PeerAddressRegion {
		id, o, ok := rt.find(rfirst, L)
		if !ok {
			return false // the entry-by-entry path refreshes once
		}
		r := rt.regs[rt.last]
		if end := r.Addr + r.Length; rlast > end || L > end-rlast {
			return false
		}
		region, off = id, o
	}
	ls, rs := e.Local[i+1]-first, e.Remote[i+1]-rfirst
	count := uint64(j - i + 1)
	switch {
	case runs && ls == L && rs == L:
		per := max(1, transport.CoalesceMaxBytes/L)
		for k := uint64(0); k < count; k += per {
			c := min(per, count-k)
			add(transport.WriteRequest{Local: uintptr(first + k*L), Remote: region, RemoteOffset: off + k*L, Length: c * L, Count: 1}, localEnd)
		}
	case runs && strided:
		per := max(1, transport.CoalesceMaxStridedBytes/L)
		for k := uint64(0); k < count; k += per {
			c := min(per, count-k)
			r := transport.WriteRequest{Local: uintptr(first + k*ls), Remote: region, RemoteOffset: off + k*rs, Length: L, Count: 1}
			if c > 1 {
				r.Count, r.LocalStride, r.RemoteStride = uint32(c), ls, rs
			}
			add(r, localEnd)
		}
	default:
		for k := uint64(0); k < count; k++ {
			add(transport.WriteRequest{Local: uintptr(first + k*ls), Remote: region, RemoteOffset: off + k*rs, Length: L, Count: 1}, localEnd)
		}
	}
	return true
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
// coalesces them as they are translated (see Submit; a run of entries of
// one length and equal local and remote strides is checked by its first
// and last entry and becomes its descriptors directly: resolve, runEnd)
// and submits them as one transfer batch of op. Poll, Wait, Cancel and Release apply to the
// returned ID. Errors: those of ResolveEntries, a read on a transport
// without transport.CapRead, and Submit's.
func (s *RemoteSegment) SubmitEntries(ctx context.Context, op transport.Op, e Entries) (transport.BatchID, error) {
	if op == transport.OpRead {
		if err := s.readable(); err != nil {
			return 0, err
		}
	}
	strided := s.te.caps.Has(transport.CapStrided)
	c := transport.NewCoalescer(strided, len(e.Local))
	if err := s.resolve(ctx, op, e, true, strided, c.Add); err != nil {
		return 0, err
	}
	b := &transport.TransferBatch{Op: op, Requests: c.Requests()}
	if err := s.checkRegions(ctx, b); err != nil {
		return 0, err
	}
	return s.submit(ctx, b, len(e.Local))
}
