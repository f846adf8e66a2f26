//go:build cgo

package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/common/expfmt"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/debugsrv"
)

// libRegistry is the library's Prometheus registry: every KV manager of the
// process registers its kvxfer_* metrics here (they share the collectors),
// with the Go runtime and process collectors. kvx_metrics_text renders it,
// kvx_metrics_serve serves it.
var libRegistry = sync.OnceValue(func() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		segmentRequests, segmentDescriptors)
	return reg
})

// The segment engines' (kvx_engine_*, the agent's) request and descriptor
// counts, by transport and op (write, read): segmentRequests counts the
// requests callers submitted (a strided request once), segmentDescriptors
// what they became after coalescing (adjacent runs merged, equal-stride
// runs as one strided request), as handed to the transport. Their ratio is
// the coalescing factor. Fed by countSubmit, every engine's
// segengine.SubmitObserver.
var (
	segmentRequests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_segment_requests_total",
		Help: "Requests callers submitted on open segments (a strided request counts once), by transport and op."}, []string{"transport", "op"})
	segmentDescriptors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_segment_descriptors_total",
		Help: "Descriptors handed to the transport for those requests after coalescing (adjacent runs merged, equal-stride runs as one strided request), by transport and op."}, []string{"transport", "op"})
)

// countSubmit is the segment engines' segengine.SubmitObserver.
func countSubmit(tr string, op transport.Op, requests, descriptors int) {
	segmentRequests.WithLabelValues(tr, op.String()).Add(float64(requests))
	segmentDescriptors.WithLabelValues(tr, op.String()).Add(float64(descriptors))
}

// metricsText renders the registry in the Prometheus text format.
func metricsText() ([]byte, error) {
	fams, err := libRegistry().Gather()
	if err != nil {
		return nil, fail(stInternal, "kvx_metrics_text: gather: %v", err)
	}
	var b bytes.Buffer
	enc := expfmt.NewEncoder(&b, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, f := range fams {
		if err := enc.Encode(f); err != nil {
			return nil, fail(stInternal, "kvx_metrics_text: encode %s: %v", f.GetName(), err)
		}
	}
	return b.Bytes(), nil
}

// libRooms serves the timelines of every live KV manager.
var libRooms = debugsrv.Rooms(func() []debugsrv.RoomSource {
	kvs.mu.Lock()
	defer kvs.mu.Unlock()
	out := make([]debugsrv.RoomSource, 0, len(kvs.m))
	for _, k := range kvs.m {
		out = append(out, k.mgr)
	}
	return out
})

// The process's debug server (kvx_metrics_serve): one at most.
var (
	debugMu  sync.Mutex
	debugSrv *debugsrv.Server
)

// serveMetrics starts the debug server on addr, or returns the running
// one's address.
func serveMetrics(addr string) (string, error) {
	debugMu.Lock()
	defer debugMu.Unlock()
	if debugSrv != nil {
		return debugSrv.Addr(), nil
	}
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	s, err := debugsrv.Start(addr, libRegistry(), libRooms, slog.Default())
	if err != nil {
		return "", fail(stUnavailable, "kvx_metrics_serve: %v", err)
	}
	debugSrv = s
	return s.Addr(), nil
}

// roomTimelineJSON is the newest timeline of room among the live KV
// managers, as JSON (engine.RoomTimeline).
func roomTimelineJSON(room uint64) ([]byte, error) {
	tl, ok := libRooms.RoomTimeline(room)
	if !ok {
		return nil, fail(stNotFound, "kvx_room_timeline: no KV manager of this process has room %d (it never ran here, or finished before the last rooms each keeps)", room)
	}
	b, err := json.Marshal(tl)
	if err != nil {
		return nil, fail(stInternal, "kvx_room_timeline: %v", err)
	}
	return b, nil
}

// envNoProbe is KVXFER_NO_PROBE: "1" or "true" makes the library's prefill
// KV managers refuse doctor probes (the CLI's --no-probe).
func envNoProbe() bool {
	v := getenv("KVXFER_NO_PROBE")
	return v == "1" || v == "true"
}
