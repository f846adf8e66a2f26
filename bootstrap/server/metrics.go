package server

// The directory's Prometheus metrics (served on /metrics).

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

type metrics struct {
	reg           *prometheus.Registry
	regOK         prometheus.Counter
	regReplaced   prometheus.Counter
	regBad        prometheus.Counter
	regConflict   prometheus.Counter
	regSuperseded prometheus.Counter
	// regInconsistent: 400 for a policy or DSpark layout that disagrees
	// with the table's, or that the compat key set cannot carry.
	regInconsistent prometheus.Counter
	delRefused      prometheus.Counter
	unauth          prometheus.Counter
	deregs          prometheus.Counter
	lookTopo        prometheus.Counter
	lookRank        prometheus.Counter
	lookMiss        prometheus.Counter
	lookBad         prometheus.Counter
	notReady        prometheus.Counter
	dpRegs          prometheus.Counter
	dpQueries       prometheus.Counter
	dpRooms         prometheus.Counter
	dpDropped       prometheus.Counter
	tableSize       prometheus.Gauge
	expected        prometheus.Gauge
	roomsSize       prometheus.Gauge
}

// newMetrics builds the registry; stale reports the number of stale ranks
// at scrape time (kvxfer_bootstrap_stale_ranks).
func newMetrics(stale func() float64) metrics {
	reg := prometheus.NewRegistry()
	registrations := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_registrations_total",
		Help: "PUT /route registrations by result (ok, replaced, bad_request, conflict, superseded: from an instance older than the entry's, refused; inconsistent: a decode_allocation_policy or dsv41_spec_layout other than the registered ranks', or one the compat key set cannot carry, refused with 400).",
	}, []string{"result"})
	lookups := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_lookups_total",
		Help: "GET /route lookups by kind (topology, rank) and result (ok, not_found, bad_request).",
	}, []string{"kind", "result"})
	dp := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_dp_rank_requests_total",
		Help: "Room→dp-rank registry calls: register, query, rooms asked by queries, and rooms_dropped (entries whose dp_rank was out of range of the topology that became known).",
	}, []string{"op"})
	m := metrics{
		reg:             reg,
		regOK:           registrations.WithLabelValues("ok"),
		regReplaced:     registrations.WithLabelValues("replaced"),
		regBad:          registrations.WithLabelValues("bad_request"),
		regConflict:     registrations.WithLabelValues("conflict"),
		regSuperseded:   registrations.WithLabelValues("superseded"),
		regInconsistent: registrations.WithLabelValues("inconsistent"),
		lookTopo:        lookups.WithLabelValues("topology", "ok"),
		lookRank:        lookups.WithLabelValues("rank", "ok"),
		lookMiss:        lookups.WithLabelValues("rank", "not_found"),
		lookBad:         lookups.WithLabelValues("any", "bad_request"),
		dpRegs:          dp.WithLabelValues("register"),
		dpQueries:       dp.WithLabelValues("query"),
		dpRooms:         dp.WithLabelValues("rooms_queried"),
		dpDropped:       dp.WithLabelValues("rooms_dropped"),
		unauth: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_unauthorized_total",
			Help: "Mutating requests refused with 401 (bearer token missing or wrong).",
		}),
		deregs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_deregistrations_total",
			Help: "DELETE /route calls that removed a rank.",
		}),
		delRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_deregistrations_refused_total",
			Help: "Conditional DELETE /route calls that left the entry in place: it names another instance (the caller was replaced).",
		}),
		notReady: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_not_ready_total",
			Help: "GET /route answers 503 because not every rank has registered.",
		}),
		tableSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_table_size",
			Help: "Distinct (dp, cp, tp, pp) ranks registered.",
		}),
		expected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_expected_ranks",
			Help: "dp·cp·tp·pp of the registered topology (0 before the first registration).",
		}),
		roomsSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_dp_rooms",
			Help: "Live entries in the room→dp-rank registry.",
		}),
	}
	staleRanks := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvxfer_bootstrap_stale_ranks",
		Help: "Registered ranks that declared a heartbeat (heartbeat_ms) and have been silent beyond its bound (bootstrap.StaleAfter): dead, hung or cut off from the directory.",
	}, stale)
	reg.MustRegister(registrations, lookups, dp, m.unauth, m.deregs, m.delRefused, m.notReady, m.tableSize, m.expected, m.roomsSize, staleRanks,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}
