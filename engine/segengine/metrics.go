package segengine

import (
	"sync/atomic"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// SubmitObserver is told of every batch a segment of the engine accepted:
// the transport's name, the op, the requests the caller submitted (a
// strided request counts once) and the descriptors they became after
// coalescing (transport.Coalescer: adjacent runs merged, equal-stride runs
// sent as one strided request), as handed to the transport. It is called
// on the submitting goroutine and must not block. The C library exports
// the counts as kvxfer_segment_requests_total and
// kvxfer_segment_descriptors_total; the segment engine itself links no
// metrics stack (internal/layers).
type SubmitObserver func(transportName string, op transport.Op, requests, descriptors int)

// CoalesceStats are an engine's request and descriptor counts since it
// started (what its SubmitObserver was told, summed).
type CoalesceStats struct {
	// Requests: submitted by callers in accepted batches.
	Requests uint64
	// Descriptors: handed to the transport for them after coalescing.
	Descriptors uint64
}

// teMetrics holds an engine's counters.
type teMetrics struct {
	requests, descriptors atomic.Uint64
	observe               SubmitObserver
}

// submitted counts one accepted batch: in requests as submitted, out
// descriptors sent.
func (m *teMetrics) submitted(tr string, op transport.Op, in, out int) {
	m.requests.Add(uint64(in))
	m.descriptors.Add(uint64(out))
	if m.observe != nil {
		m.observe(tr, op, in, out)
	}
}

// CoalesceStats returns the engine's request and descriptor counts.
func (te *TransferEngine) CoalesceStats() CoalesceStats {
	return CoalesceStats{Requests: te.met.requests.Load(), Descriptors: te.met.descriptors.Load()}
}
