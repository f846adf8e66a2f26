package segengine

import (
	"errors"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Segment engine metrics (Prometheus, registered on
// TransferEngineConfig.Metrics; engines of one process registered on the
// same Registerer share the collectors and their counts add up). Labels:
// transport (a transport name) and op (write, read).
const (
	// MetricRequests counts the requests callers submitted on open
	// segments (a caller's strided request counts once), by transport and
	// op.
	MetricRequests = "kvxfer_segment_requests_total"
	// MetricDescriptors counts the descriptors those requests became after
	// coalescing (transport.Coalescer: adjacent runs merged, equal-stride
	// runs sent as one strided request), as handed to the transport, by
	// transport and op. MetricRequests / MetricDescriptors is the
	// coalescing factor.
	MetricDescriptors = "kvxfer_segment_descriptors_total"
)

// CoalesceStats are an engine's request and descriptor counts since it
// started (what MetricRequests and MetricDescriptors count for it).
type CoalesceStats struct {
	// Requests: submitted by callers in accepted batches.
	Requests uint64
	// Descriptors: handed to the transport for them after coalescing.
	Descriptors uint64
}

// teMetrics holds an engine's counters.
type teMetrics struct {
	requests, descriptors atomic.Uint64
	reqVec, descVec       *prometheus.CounterVec
}

func newTEMetrics(reg prometheus.Registerer) (*teMetrics, error) {
	m := &teMetrics{
		reqVec: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricRequests,
			Help: "Requests callers submitted on open segments (a strided request counts once), by transport and op."}, []string{"transport", "op"}),
		descVec: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricDescriptors,
			Help: "Descriptors handed to the transport for those requests after coalescing (adjacent runs merged, equal-stride runs as one strided request), by transport and op."}, []string{"transport", "op"}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.reqVec, err = share(reg, m.reqVec); err != nil {
		return nil, err
	}
	if m.descVec, err = share(reg, m.descVec); err != nil {
		return nil, err
	}
	return m, nil
}

// share registers c on reg, or returns the collector of the same
// description reg already holds.
func share[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if ex, ok := are.ExistingCollector.(C); ok {
				return ex, nil
			}
		}
		var zero C
		return zero, err
	}
	return c, nil
}

// submitted counts one accepted batch: in requests as submitted, out
// descriptors sent.
func (m *teMetrics) submitted(tr string, op transport.Op, in, out int) {
	m.requests.Add(uint64(in))
	m.descriptors.Add(uint64(out))
	m.reqVec.WithLabelValues(tr, op.String()).Add(float64(in))
	m.descVec.WithLabelValues(tr, op.String()).Add(float64(out))
}

// CoalesceStats returns the engine's request and descriptor counts.
func (te *TransferEngine) CoalesceStats() CoalesceStats {
	return CoalesceStats{Requests: te.met.requests.Load(), Descriptors: te.met.descriptors.Load()}
}
