package engine

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Engine metrics (Prometheus, registered on ManagerConfig.Metrics). Names
// follow the Prometheus conventions: the kvxfer_ prefix, base units
// (seconds, bytes), _total on counters. Label values are bounded: role is
// prefill or decode, state and step come from fixed lists, reason is a
// failure class (FailureReason), never error text; peer is a peer rank's
// role and coordinates ("decode tp0/pp0", "prefill tp1/pp0":
// decodePeerLabel, prefillPeerLabel), never an address (ports are often
// ephemeral, and a restarted rank would add series); transport a transport
// name. Doctor probes are counted in MetricProbes only: the prober is no
// peer (no peer series, no peer loss when it exits, no transfer bytes).
//
// Several managers of one process (ranks sharing a C ABI library, tests) may
// register on the same Registerer: they then share the collectors, counters
// add up, and the scrape-time gauges (rooms, peers, ring slots, pool pages)
// sum over every live manager. Without a Registerer the manager keeps its
// counters unregistered (nothing is exported).
const (
	// MetricRooms counts rooms that reached a final state, by role, state
	// (success, failed), reason (FailureReason; "none" for success) and
	// step (the evidence-chain step the room failed at; "none" for success).
	MetricRooms = "kvxfer_rooms_total"
	// MetricRoomsActive is the rooms not yet final, by role and KVPoll state
	// (bootstrapping, waiting_for_input, transferring).
	MetricRoomsActive = "kvxfer_rooms_active"
	// MetricTransferSeconds is the transfer latency of successful rooms
	// (sender: first Send → Success; receiver: TRANSFER sent → Success), by
	// role; SGLang's transfer_latency_s.
	MetricTransferSeconds = "kvxfer_transfer_duration_seconds"
	// MetricTimeToFailedSeconds is, for failed rooms, the time from the
	// room's creation (NewSender/NewReceiver) to Failed, by role and reason.
	MetricTimeToFailedSeconds = "kvxfer_time_to_failed_seconds"
	// MetricBytes is the bytes written by completed transfer batches (KV
	// pages, aux rows, state slots, metadata records), by transport and
	// destination peer (prefill side).
	MetricBytes = "kvxfer_transfer_bytes_total"
	// MetricWriteRequests is the one-sided WRITE requests in completed
	// transfer batches, by transport and peer (a strided request counts
	// once).
	MetricWriteRequests = "kvxfer_write_requests_total"
	// MetricBatches counts transfer batches that ended, by transport, peer
	// and outcome (completed, failed, canceled).
	MetricBatches = "kvxfer_transfer_batches_total"
	// MetricBatchSeconds is a transfer batch's Submit → terminal time, by
	// transport.
	MetricBatchSeconds = "kvxfer_transfer_batch_duration_seconds"
	// MetricBatchesInFlight is the transfer batches submitted and not yet
	// terminal, by transport.
	MetricBatchesInFlight = "kvxfer_transfer_batches_in_flight"
	// MetricReceivedBytes is the KV bytes a decode accepted (as its
	// producers' verified metadata records state), by producer peer.
	MetricReceivedBytes = "kvxfer_received_bytes_total"
	// MetricPeers is the peer ranks this rank has a control connection to,
	// by role and state (connecting: never connected yet; connected;
	// unreachable: reconnections failing).
	MetricPeers = "kvxfer_peers"
	// MetricPeersLost counts peers declared lost (their rooms failed), by
	// role and cause (disconnected: its control connection dropped;
	// heartbeat: silent or unreachable for PeerTimeout; directory: its
	// segment vanished from the metadata directory or changed epoch;
	// bootstrap: its bootstrap server failed the health checks; replaced:
	// another instance than the directory named answers at its address).
	MetricPeersLost = "kvxfer_peers_lost_total"
	// MetricHeartbeatFailures counts failed liveness checks, by kind
	// (peer: a control peer silent past PeerTimeout; bootstrap: a failed
	// GET /health to a prefill's bootstrap server).
	MetricHeartbeatFailures = "kvxfer_heartbeat_failures_total"
	// MetricFencingEvents counts fencing events, by role and event
	// (abort_sent, abort_received, abort_ack_sent, abort_ack_received,
	// quarantined: a failed room's pages held back, fenced: a producer's
	// data path torn down).
	MetricFencingEvents = "kvxfer_fencing_events_total"
	// MetricPoolPages is the decode KV pool's pages by state: free (from
	// ManagerConfig.FreePages, when given) and quarantined (destination
	// pages of failed rooms whose producers are not yet all fenced: ABORT_ACK
	// or a transport fence pending, see Receiver.Close).
	MetricPoolPages = "kvxfer_pool_pages"
	// MetricRoomsWaitingPages is the rooms waiting for KV pages of the
	// caller's pool (ManagerConfig.PagesWaiting, when given), by role: a
	// prefill's rooms waiting for source pages, a decode's for destination
	// pages (served first come, first served).
	MetricRoomsWaitingPages = "kvxfer_rooms_waiting_for_pages"
	// MetricRingSlots is the decode's metadata ring slots by state (free,
	// used).
	MetricRingSlots = "kvxfer_ring_slots"
	// MetricProbes counts doctor probes (kvxfer doctor --bootstrap) this
	// rank answered, by result (passed, failed, refused).
	MetricProbes = "kvxfer_probes_total"
	// MetricControlFramesDropped counts received control frames this rank
	// dropped, by reason (malformed: not a kvxfer frame, another protocol
	// version, a bad field; unauthenticated: AuthenticateControl is on and
	// the tag is missing, wrong or outside the send-time window (ReplayWindow);
	// replay: authenticated, but its sequence number was accepted from that
	// sender before (engine/internal/control, replay.go); sender: from
	// another instance than the peer state it names, a refused REGISTER, a
	// HANDSHAKE from a prefill rank this decode has no registration with).
	// Manager.DroppedFrames is their sum.
	MetricControlFramesDropped = "kvxfer_control_frames_dropped_total"
	// MetricRedials counts data connections dialled again after being lost
	// while idle (a reset between rooms heals without a failed room), by
	// transport; read at scrape time from transports that count them
	// (tcp's Transport.Redials).
	MetricRedials = "kvxfer_data_path_redials_total"
	// MetricRingWaiters is the decode's rooms queued for a metadata ring
	// slot (backpressure: every slot in use; they wait within their waiting
	// timeout instead of failing).
	MetricRingWaiters = "kvxfer_ring_slot_waiters"
)

// Failure reasons (the reason label of MetricRooms, FailureReason).
const (
	ReasonNone         = "none"
	ReasonTimeout      = "timeout"
	ReasonPeerLost     = "peer_lost"
	ReasonBootstrap    = "bootstrap_lost"
	ReasonAborted      = "aborted"
	ReasonRoomMismatch = "room_mismatch"
	ReasonChecksum     = "checksum"
	ReasonPeerFailed   = "peer_failed"
	ReasonClosed       = "closed"
	ReasonMismatch     = "config_mismatch"
	ReasonDirectory    = "directory"
	ReasonTransport    = "transport"
	ReasonOther        = "other"
)

// errPeerFailed marks a room failed because its peer reported Failed
// (STATUS Failed): FailureReason classes it as ReasonPeerFailed.
var errPeerFailed = errors.New("peer reported Failed")

// peerFailed wraps err so that FailureReason sees errPeerFailed while the
// message stays err's.
func peerFailed(err error) error { return classedError{err: err, class: errPeerFailed} }

type classedError struct {
	err   error
	class error
}

func (e classedError) Error() string   { return e.err.Error() }
func (e classedError) Unwrap() []error { return []error{e.err, e.class} }

// FailureReason returns the failure class of a room's error: a short,
// fixed label value (the Reason* constants) for metrics and timelines.
// Order matters: the most specific cause wins (a room mismatch found while
// aborting is a room mismatch).
func FailureReason(err error) string {
	switch {
	case err == nil:
		return ReasonNone
	case errors.Is(err, ErrRoomMismatch):
		return ReasonRoomMismatch
	case errors.Is(err, ErrChecksum):
		return ReasonChecksum
	case errors.Is(err, ErrManagerClosed):
		return ReasonClosed
	case errors.Is(err, ErrBootstrapLost):
		return ReasonBootstrap
	case errors.Is(err, ErrTimeout):
		return ReasonTimeout
	case errors.Is(err, transport.ErrPeerLost):
		return ReasonPeerLost
	case errors.Is(err, errPeerFailed):
		return ReasonPeerFailed
	case errors.Is(err, ErrAborted):
		return ReasonAborted
	case errors.Is(err, bootstrap.ErrMismatch), errors.Is(err, kvargs.ErrBadKVArgs), errors.Is(err, ErrTokenMismatch), errors.Is(err, ErrVersionSkew):
		return ReasonMismatch
	case errors.Is(err, bootstrap.ErrNotFound), errors.Is(err, bootstrap.ErrNotReady), errors.Is(err, bootstrap.ErrUnauthorized),
		errors.Is(err, bootstrap.ErrBadRequest), errors.Is(err, bootstrap.ErrUnsupported):
		return ReasonDirectory
	case errors.Is(err, transport.ErrOutOfBounds), errors.Is(err, transport.ErrUnknownRegion), errors.Is(err, transport.ErrCanceled), errors.Is(err, transport.ErrClosed),
		errors.Is(err, transport.ErrUnsupportedMemory), errors.Is(err, transport.ErrUnavailable), errors.Is(err, transport.ErrUnknownBatch):
		return ReasonTransport
	}
	return ReasonOther
}

// FailureReasons lists every value FailureReason returns.
func FailureReasons() []string {
	return []string{ReasonNone, ReasonTimeout, ReasonPeerLost, ReasonBootstrap, ReasonAborted, ReasonRoomMismatch, ReasonChecksum,
		ReasonPeerFailed, ReasonClosed, ReasonMismatch, ReasonDirectory, ReasonTransport, ReasonOther}
}

// latencyBuckets span 100 µs … ~100 s: a small room on shm to a waiting
// timeout.
var latencyBuckets = prometheus.ExponentialBuckets(100e-6, 2.5, 16)

type metricSpec struct {
	name, help string
	kind       string // counter, gauge, histogram; gaugefunc, counterfunc: collected at scrape time
	labels     []string
}

// metricSpecs is every metric the engine exports (the dashboard test checks
// deploy/grafana against it through MetricNames).
var metricSpecs = []metricSpec{
	{MetricRooms, "Rooms that reached a final state, by role, state (success, failed), failure reason class and the evidence-chain step they failed at.", "counter", []string{"role", "state", "reason", "step"}},
	{MetricRoomsActive, "Rooms not yet final, by role and KVPoll state.", "gaugefunc", []string{"role", "state"}},
	{MetricTransferSeconds, "Transfer latency of successful rooms (sender: first Send to Success; receiver: TRANSFER to Success), seconds.", "histogram", []string{"role"}},
	{MetricTimeToFailedSeconds, "Time from a room's creation to Failed, seconds, by role and failure reason.", "histogram", []string{"role", "reason"}},
	{MetricBytes, "Bytes written by completed transfer batches (KV, aux, state, metadata records), by transport and destination peer.", "counter", []string{"transport", "peer"}},
	{MetricWriteRequests, "One-sided WRITE requests in completed transfer batches, by transport and destination peer.", "counter", []string{"transport", "peer"}},
	{MetricBatches, "Transfer batches that ended, by transport, destination peer and outcome (completed, failed, canceled).", "counter", []string{"transport", "peer", "outcome"}},
	{MetricBatchSeconds, "Transfer batch Submit to terminal state, seconds, by transport.", "histogram", []string{"transport"}},
	{MetricBatchesInFlight, "Transfer batches submitted and not yet terminal, by transport.", "gauge", []string{"transport"}},
	{MetricReceivedBytes, "KV bytes a decode accepted from verified metadata records, by producer peer.", "counter", []string{"peer"}},
	{MetricPeers, "Peer ranks with a control connection from this rank, by role and state (connecting, connected, unreachable).", "gaugefunc", []string{"role", "state"}},
	{MetricPeersLost, "Peers declared lost, by role and cause (disconnected, heartbeat, directory, bootstrap, replaced).", "counter", []string{"role", "cause"}},
	{MetricHeartbeatFailures, "Failed liveness checks, by kind (peer: control peer silent past the peer timeout; bootstrap: failed GET /health).", "counter", []string{"kind"}},
	{MetricFencingEvents, "Fencing events, by role and event (abort_sent, abort_received, abort_ack_sent, abort_ack_received, quarantined, fenced).", "counter", []string{"role", "event"}},
	{MetricPoolPages, "Decode KV pool pages by state (free: reported by the caller; quarantined: pages of failed rooms waiting for their producers to be fenced).", "gaugefunc", []string{"state"}},
	{MetricRoomsWaitingPages, "Rooms waiting for KV pages of the caller's pool, by role (reported by the caller).", "gaugefunc", []string{"role"}},
	{MetricRingSlots, "Decode metadata ring slots by state (free, used).", "gaugefunc", []string{"state"}},
	{MetricProbes, "Doctor probes this rank answered, by result (passed, failed, refused).", "counter", []string{"result"}},
	{MetricControlFramesDropped, "Received control frames dropped, by reason (malformed, unauthenticated, replay: an authenticated frame accepted before, sender: from another instance than the peer state it names).", "counter", []string{"reason"}},
	{MetricRedials, "Data connections dialled again after being lost while idle, by transport (read from the transport at scrape time).", "counterfunc", []string{"transport"}},
	{MetricRingWaiters, "Decode rooms queued for a metadata ring slot (every slot in use).", "gaugefunc", nil},
}

// MetricNames returns the name of every metric family the engine exports
// (histograms as their base name: add _bucket, _sum, _count).
func MetricNames() []string {
	out := make([]string, len(metricSpecs))
	for i, s := range metricSpecs {
		out[i] = s.name
	}
	return out
}

// MetricLabels returns the label names of an engine metric (MetricNames;
// histograms add "le" to their _bucket series; empty, not nil, for a metric
// without labels), nil for another name.
func MetricLabels(name string) []string {
	for _, s := range metricSpecs {
		if s.name == name {
			return append([]string{}, s.labels...)
		}
	}
	return nil
}

// MetricKind returns "counter", "gauge" or "histogram" for an engine
// metric name (MetricNames), "" for another name.
func MetricKind(name string) string {
	for _, s := range metricSpecs {
		if s.name == name {
			switch s.kind {
			case "gaugefunc":
				return "gauge"
			case "counterfunc":
				return "counter"
			}
			return s.kind
		}
	}
	return ""
}

func specOf(name string) metricSpec {
	for _, s := range metricSpecs {
		if s.name == name {
			return s
		}
	}
	panic("engine: no metric spec " + name)
}

// engineMetrics are one manager's handles on the (possibly shared)
// collectors.
type engineMetrics struct {
	rooms      *prometheus.CounterVec
	latency    *prometheus.HistogramVec
	toFailed   *prometheus.HistogramVec
	bytes      *prometheus.CounterVec
	writes     *prometheus.CounterVec
	batches    *prometheus.CounterVec
	batchSec   *prometheus.HistogramVec
	inFlight   *prometheus.GaugeVec
	recvBytes  *prometheus.CounterVec
	peersLost  *prometheus.CounterVec
	heartbeats *prometheus.CounterVec
	fencing    *prometheus.CounterVec
	probes     *prometheus.CounterVec
	dropped    *prometheus.CounterVec
	state      *stateCollector
}

// newEngineMetrics builds the manager's metrics and registers them on reg
// (nil: unregistered). A collector reg already holds (another manager of
// the process) is shared. Errors: reg refuses a collector for another
// reason (a conflicting metric of the same name).
func newEngineMetrics(reg prometheus.Registerer, m *Manager) (*engineMetrics, error) {
	counter := func(name string) *prometheus.CounterVec {
		s := specOf(name)
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: s.name, Help: s.help}, s.labels)
	}
	hist := func(name string) *prometheus.HistogramVec {
		s := specOf(name)
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: s.name, Help: s.help, Buckets: latencyBuckets}, s.labels)
	}
	gauge := func(name string) *prometheus.GaugeVec {
		s := specOf(name)
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: s.name, Help: s.help}, s.labels)
	}
	em := &engineMetrics{
		rooms: counter(MetricRooms), latency: hist(MetricTransferSeconds), toFailed: hist(MetricTimeToFailedSeconds),
		bytes: counter(MetricBytes), writes: counter(MetricWriteRequests), batches: counter(MetricBatches),
		batchSec: hist(MetricBatchSeconds), inFlight: gauge(MetricBatchesInFlight), recvBytes: counter(MetricReceivedBytes),
		peersLost: counter(MetricPeersLost), heartbeats: counter(MetricHeartbeatFailures), fencing: counter(MetricFencingEvents),
		probes: counter(MetricProbes), dropped: counter(MetricControlFramesDropped), state: newStateCollector(),
	}
	if reg != nil {
		var err error
		em.rooms, err = share(reg, em.rooms)
		if err == nil {
			em.latency, err = share(reg, em.latency)
		}
		if err == nil {
			em.toFailed, err = share(reg, em.toFailed)
		}
		if err == nil {
			em.bytes, err = share(reg, em.bytes)
		}
		if err == nil {
			em.writes, err = share(reg, em.writes)
		}
		if err == nil {
			em.batches, err = share(reg, em.batches)
		}
		if err == nil {
			em.batchSec, err = share(reg, em.batchSec)
		}
		if err == nil {
			em.inFlight, err = share(reg, em.inFlight)
		}
		if err == nil {
			em.recvBytes, err = share(reg, em.recvBytes)
		}
		if err == nil {
			em.peersLost, err = share(reg, em.peersLost)
		}
		if err == nil {
			em.heartbeats, err = share(reg, em.heartbeats)
		}
		if err == nil {
			em.fencing, err = share(reg, em.fencing)
		}
		if err == nil {
			em.probes, err = share(reg, em.probes)
		}
		if err == nil {
			em.dropped, err = share(reg, em.dropped)
		}
		if err == nil {
			em.state, err = share(reg, em.state)
		}
		if err != nil {
			return nil, err
		}
	}
	return em, nil
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

// open adds the manager to the scrape-time gauges (once its memory and
// transports are set up).
func (em *engineMetrics) open(m *Manager) { em.state.add(m) }

// close stops the manager's scrape-time gauges.
func (em *engineMetrics) close(m *Manager) { em.state.remove(m) }

// peerLabel is a control endpoint as host:port, for logs and timelines
// (never a metric label: an address, its port often ephemeral, is not a
// bounded label value).
func peerLabel(ep string) string { return strings.TrimPrefix(ep, "tcp://") }

// rankCoords formats a rank's coordinates as ranks name themselves
// ("tp1/pp0"; "dp2/" and "cp1/" in front when not 0).
func rankCoords(dp, cp, tp, pp int) string {
	s := fmt.Sprintf("tp%d/pp%d", tp, pp)
	if cp != 0 {
		s = fmt.Sprintf("cp%d/", cp) + s
	}
	if dp != 0 {
		s = fmt.Sprintf("dp%d/", dp) + s
	}
	return s
}

// decodePeerLabel is the peer label value of a decode rank (prefill-side
// metrics): its role and coordinates from its REGISTER, e.g. "decode
// tp0/pp0". Bounded by the deployment's shape, whatever ports the ranks
// bind and however often they restart; the decodes of several instances at
// the same coordinates share the series (logs and timelines name their
// addresses).
func decodePeerLabel(g kvargs.Geometry) string {
	return "decode " + rankCoords(0, 0, g.TPRank, g.PPRank)
}

// prefillPeerLabel is the peer label value of a prefill rank (decode-side
// metrics): "prefill " and its directory coordinates, e.g. "prefill
// tp1/pp0".
func prefillPeerLabel(r bootstrap.TargetRank) string {
	return "prefill " + rankCoords(r.DP, r.CP, r.TP, r.PP)
}

// batchStart counts a submitted batch in flight and returns the function
// that records its end (outcome completed, failed or canceled; bytes and
// requests counted for completed batches).
//
// The end function reads the batch's final status through st when it is
// called, so it can be deferred right after Submit.
func (em *engineMetrics) batchStart(transportName, peer string, b *transport.TransferBatch) func(st *transport.BatchStatus) {
	g := em.inFlight.WithLabelValues(transportName)
	g.Inc()
	t := time.Now()
	return func(st *transport.BatchStatus) {
		g.Dec()
		em.batchSec.WithLabelValues(transportName).Observe(time.Since(t).Seconds())
		outcome := "canceled" // canceled, or never terminal
		switch st.State {
		case transport.BatchCompleted:
			outcome = "completed"
			em.bytes.WithLabelValues(transportName, peer).Add(float64(b.Bytes()))
			em.writes.WithLabelValues(transportName, peer).Add(float64(len(b.Requests)))
		case transport.BatchFailed:
			outcome = "failed"
		}
		em.batches.WithLabelValues(transportName, peer, outcome).Inc()
	}
}

// roomDone records a room's final state.
func (em *engineMetrics) roomDone(role Role, ok bool, reason string, step Step, sinceCreated, transfer time.Duration) {
	if ok {
		em.rooms.WithLabelValues(role.String(), "success", ReasonNone, "none").Inc()
		if transfer > 0 {
			em.latency.WithLabelValues(role.String()).Observe(transfer.Seconds())
		}
		return
	}
	em.rooms.WithLabelValues(role.String(), "failed", reason, string(step)).Inc()
	em.toFailed.WithLabelValues(role.String(), reason).Observe(sinceCreated.Seconds())
}

// peerLost counts a lost peer by cause.
func (em *engineMetrics) peerLost(role Role, cause string) {
	em.peersLost.WithLabelValues(role.String(), cause).Inc()
}

// heartbeatFailed counts a failed liveness check of kind peer or bootstrap.
func (em *engineMetrics) heartbeatFailed(kind string) { em.heartbeats.WithLabelValues(kind).Inc() }

// frameDropped counts a dropped control frame by reason class.
func (em *engineMetrics) frameDropped(reason string) { em.dropped.WithLabelValues(reason).Inc() }

// fence counts a fencing event.
func (em *engineMetrics) fence(role Role, event string) {
	em.fencing.WithLabelValues(role.String(), event).Inc()
}

// stateCollector exports the scrape-time gauges (rooms active, peers, ring
// slots, pool pages) and redial counts summed over the live managers that
// share it. A manager joins once its memory and transports are set up
// (NewManager) and leaves first thing in teardown; remove waits for a
// collection in progress, so no scrape reads a manager being torn down.
type stateCollector struct {
	mu       sync.RWMutex // write: add/remove; read: a collection
	managers []*Manager
	active   *prometheus.Desc
	peers    *prometheus.Desc
	pool     *prometheus.Desc
	ring     *prometheus.Desc
	waiters  *prometheus.Desc
	redials  *prometheus.Desc
	pageWait *prometheus.Desc
}

// redialCounter is a transport that counts its redials (tcp).
type redialCounter interface {
	Redials() uint64
}

func newStateCollector() *stateCollector {
	d := func(name string) *prometheus.Desc {
		s := specOf(name)
		return prometheus.NewDesc(s.name, s.help, s.labels, nil)
	}
	return &stateCollector{active: d(MetricRoomsActive), peers: d(MetricPeers), pool: d(MetricPoolPages), ring: d(MetricRingSlots),
		waiters: d(MetricRingWaiters), redials: d(MetricRedials), pageWait: d(MetricRoomsWaitingPages)}
}

func (c *stateCollector) add(m *Manager) {
	c.mu.Lock()
	c.managers = append(c.managers, m)
	c.mu.Unlock()
}

func (c *stateCollector) remove(m *Manager) {
	c.mu.Lock()
	c.managers = slices.DeleteFunc(c.managers, func(x *Manager) bool { return x == m })
	c.mu.Unlock()
}

// Describe implements prometheus.Collector.
func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.active
	ch <- c.peers
	ch <- c.pool
	ch <- c.ring
	ch <- c.waiters
	ch <- c.redials
	ch <- c.pageWait
}

// Collect implements prometheus.Collector.
func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ms := c.managers
	type key struct{ role, state string }
	active := map[key]float64{}
	peers := map[key]float64{}
	var free, quarantined, ringFree, ringUsed, waiters float64
	var haveFree, haveRing bool
	// Redials by transport, each transport once (managers may share one;
	// pointer transports are told apart by address, as kvxfer's all are).
	redials := map[string]float64{}
	pageWait := map[string]float64{}
	seen := map[uintptr]bool{}
	roles := map[Role]bool{}
	for _, m := range ms {
		roles[m.cfg.Role] = true
	}
	for role := range roles { // zeros for the roles this process runs
		for _, st := range []KVPoll{KVBootstrapping, KVWaitingForInput, KVTransferring} {
			active[key{role.String(), stateLabel(st)}] = 0
		}
		for _, st := range []string{"connecting", "connected", "unreachable"} {
			peers[key{role.String(), st}] = 0
		}
	}
	for _, m := range ms {
		s := m.stateSnapshot()
		for st, n := range s.active {
			active[key{m.cfg.Role.String(), stateLabel(st)}] += float64(n)
		}
		for st, n := range s.peers {
			peers[key{m.cfg.Role.String(), st}] += float64(n)
		}
		quarantined += float64(s.quarantinedPages)
		if s.pagesWaiting >= 0 {
			pageWait[m.cfg.Role.String()] += float64(s.pagesWaiting)
		}
		if s.freePages >= 0 {
			free += float64(s.freePages)
			haveFree = true
		}
		if s.ringSlots > 0 {
			ringFree += float64(s.ringSlots - s.ringUsed)
			ringUsed += float64(s.ringUsed)
			waiters += float64(s.ringWaiting)
			haveRing = true
		}
		for _, rs := range m.regs {
			rc, ok := rs.t.(redialCounter)
			if !ok {
				continue
			}
			if v := reflect.ValueOf(rs.t); v.Kind() == reflect.Pointer {
				if seen[v.Pointer()] {
					continue
				}
				seen[v.Pointer()] = true
			}
			redials[rs.t.Name()] += float64(rc.Redials())
		}
	}
	for role, n := range pageWait {
		ch <- prometheus.MustNewConstMetric(c.pageWait, prometheus.GaugeValue, n, role)
	}
	for tr, n := range redials {
		ch <- prometheus.MustNewConstMetric(c.redials, prometheus.CounterValue, n, tr)
	}
	for k, v := range active {
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, v, k.role, k.state)
	}
	for k, v := range peers {
		ch <- prometheus.MustNewConstMetric(c.peers, prometheus.GaugeValue, v, k.role, k.state)
	}
	ch <- prometheus.MustNewConstMetric(c.pool, prometheus.GaugeValue, quarantined, "quarantined")
	if haveFree {
		ch <- prometheus.MustNewConstMetric(c.pool, prometheus.GaugeValue, free, "free")
	}
	if haveRing {
		ch <- prometheus.MustNewConstMetric(c.ring, prometheus.GaugeValue, ringFree, "free")
		ch <- prometheus.MustNewConstMetric(c.ring, prometheus.GaugeValue, ringUsed, "used")
		ch <- prometheus.MustNewConstMetric(c.waiters, prometheus.GaugeValue, waiters)
	}
}

// stateLabel is a KVPoll state as a label value (snake case).
func stateLabel(p KVPoll) string {
	switch p {
	case KVBootstrapping:
		return "bootstrapping"
	case KVWaitingForInput:
		return "waiting_for_input"
	case KVTransferring:
		return "transferring"
	case KVSuccess:
		return "success"
	case KVFailed:
		return "failed"
	}
	return "unknown"
}

// managerState is what the scrape-time gauges read from one manager.
type managerState struct {
	active           map[KVPoll]int
	peers            map[string]int
	quarantinedPages int
	freePages        int // -1: not reported
	pagesWaiting     int // -1: not reported
	ringSlots        int
	ringUsed         int
	ringWaiting      int
}

// stateSnapshot reads the manager's rooms, peers, ring and pool for a
// scrape.
func (m *Manager) stateSnapshot() managerState {
	s := managerState{active: map[KVPoll]int{}, peers: map[string]int{}, freePages: -1, pagesWaiting: -1}
	m.mu.Lock()
	polls := make([]*pollState, 0, len(m.pre.senders)+len(m.dec.receivers))
	for _, x := range m.pre.senders {
		polls = append(polls, x.st)
	}
	for _, x := range m.dec.receivers {
		polls = append(polls, x.st)
	}
	socks := make([]*pushSock, 0, len(m.push))
	for _, ps := range m.push {
		socks = append(socks, ps)
	}
	m.mu.Unlock()
	for _, p := range polls {
		if st, _ := p.get(); st != KVSuccess && st != KVFailed {
			s.active[st]++
		}
	}
	for _, ps := range socks {
		ps.mu.Lock()
		switch {
		case ps.unreachable && ps.connected:
			s.peers["unreachable"]++
		case ps.connected:
			s.peers["connected"]++
		default:
			s.peers["connecting"]++
		}
		ps.mu.Unlock()
	}
	s.quarantinedPages = m.quarantinedPages()
	if f := m.cfg.FreePages; f != nil {
		s.freePages = f()
	}
	if f := m.cfg.PagesWaiting; f != nil {
		s.pagesWaiting = f()
	}
	if m.dec.ring != nil {
		s.ringSlots = m.dec.ring.Slots()
		s.ringUsed = m.dec.ring.InUse()
		s.ringWaiting = m.dec.ring.Waiting()
	}
	return s
}

// quarantinedPages is the destination pages of this decode's failed rooms
// that are not yet fenced (Receiver.Fenced open: a producer that got
// TRANSFER has neither acknowledged the abort cleanly nor had its data path
// fenced): pages the caller cannot get back yet (Close waits).
func (m *Manager) quarantinedPages() int {
	m.mu.Lock()
	rs := make([]*Receiver, 0, len(m.dec.receivers))
	for _, r := range m.dec.receivers {
		rs = append(rs, r)
	}
	m.mu.Unlock()
	n := 0
	for _, r := range rs {
		if r.Poll() != KVFailed {
			continue
		}
		select {
		case <-r.fenceCh:
			continue
		default:
		}
		r.mu.Lock()
		n += len(r.pages)
		r.mu.Unlock()
	}
	return n
}
