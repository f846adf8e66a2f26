package transport

import "math/bits"

// Coalescing limits: a request merged from adjacent ones carries at most
// CoalesceMaxBytes, a strided request formed from equal-stride ones at most
// CoalesceMaxStridedBytes (a transport sends one strided request as one
// frame: tcp puts it on one stream, so a run of many small blocks is cut
// where the batch still spreads over the streams).
const (
	CoalesceMaxBytes        = 1 << 30
	CoalesceMaxStridedBytes = 4 << 20
)

// Coalescer merges the requests of one transfer batch as they are added, in
// order, into fewer descriptors that move exactly the same bytes:
//
//   - a request whose local and remote ranges both start where the previous
//     one's end (same remote region, same local registration) extends it;
//   - with Strided (the transport has CapStrided), a run of requests of equal
//     Length whose local and remote starts advance by constant strides (each
//     at least Length, so no block overlaps another) becomes one strided
//     request (Count blocks, LocalStride, RemoteStride), as the KV path's
//     TP-mismatch head slices are sent;
//   - anything else starts a new descriptor.
//
// Merging changes no outcome: a batch's requests complete in any order and
// the batch completes (or fails) as a whole, so a merged descriptor has the
// outcome of its parts. Requests of length 0 and strided requests are
// passed through unchanged (the transport validates them); a strided
// request is never extended either (its strides are the caller's).
//
// The caller validates every request before adding it (remote region and
// bounds, local range inside registered memory) and passes localEnd, the end
// address of the local registration holding its local range: requests are
// merged only inside one registration, so a merged descriptor's local range
// is registered memory too (two registrations may be adjacent in the address
// space and still need separate descriptors, e.g. RDMA lkeys).
type Coalescer struct {
	// Strided allows forming strided requests (set it from the transport's
	// CapStrided; without it only adjacent runs are merged).
	Strided bool

	out    []WriteRequest
	end    uint64 // localEnd of out's last request
	frozen bool   // out's last request is a caller's strided one
	in     int
}

// NewCoalescer returns a Coalescer for a batch of about n requests.
func NewCoalescer(strided bool, n int) *Coalescer {
	return &Coalescer{Strided: strided, out: make([]WriteRequest, 0, min(max(n, 1), 4096))}
}

// In returns how many requests were added; Out how many descriptors they
// became.
func (c *Coalescer) In() int { return c.in }

// Out returns how many descriptors the added requests became.
func (c *Coalescer) Out() int { return len(c.out) }

// Requests returns the merged requests (the Coalescer's own slice: add no
// more after taking it).
func (c *Coalescer) Requests() []WriteRequest { return c.out }

// Add appends r (validated by the caller; localEnd is the end address of
// the local registration holding it), merging it into the previous
// descriptor when the rules allow.
func (c *Coalescer) Add(r WriteRequest, localEnd uint64) {
	c.in++
	if r.Count == 0 {
		r.Count = 1
	}
	if n := len(c.out); n > 0 && r.Count == 1 && r.Length > 0 && localEnd == c.end && !c.frozen && c.merge(&c.out[n-1], r) {
		return
	}
	c.out = append(c.out, r)
	c.end = localEnd
	c.frozen = r.Count > 1 // the caller's strided request
}

// merge extends last by r when the rules allow, and reports whether it did.
func (c *Coalescer) merge(last *WriteRequest, r WriteRequest) bool {
	if last.Remote != r.Remote || last.Length == 0 {
		return false
	}
	L := last.Length
	la, ra := uint64(last.Local), uint64(r.Local)
	if last.Count <= 1 {
		// Adjacent on both sides: one longer request.
		if ra == la+L && r.RemoteOffset == last.RemoteOffset+L && L+r.Length <= CoalesceMaxBytes && la+L > la {
			last.Length += r.Length
			return true
		}
		// The second block of a strided run.
		if !c.Strided || r.Length != L || 2*L > CoalesceMaxStridedBytes || ra <= la || r.RemoteOffset <= last.RemoteOffset {
			return false
		}
		ls, rs := ra-la, r.RemoteOffset-last.RemoteOffset
		if ls < L || rs < L {
			return false
		}
		last.Count, last.LocalStride, last.RemoteStride = 2, ls, rs
		return true
	}
	// The next block of a strided run.
	if !c.Strided || r.Length != L || last.Count == ^uint32(0) {
		return false
	}
	k := uint64(last.Count)
	if hi, lo := bits.Mul64(k+1, L); hi != 0 || lo > CoalesceMaxStridedBytes {
		return false
	}
	if !at(la, k, last.LocalStride, ra) || !at(last.RemoteOffset, k, last.RemoteStride, r.RemoteOffset) {
		return false
	}
	last.Count++
	return true
}

// at reports whether base + k*stride == want, without overflow.
func at(base, k, stride, want uint64) bool {
	hi, lo := bits.Mul64(k, stride)
	if hi != 0 {
		return false
	}
	s, carry := bits.Add64(base, lo, 0)
	return carry == 0 && s == want
}
