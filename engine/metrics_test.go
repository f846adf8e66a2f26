package engine_test

import (
	"context"
	"encoding/binary"
	"errors"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// sample sums the series of metric name whose labels include want: counter
// and gauge values, histogram sample counts. A family that is absent sums to
// 0.
func sample(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range want {
				if have[k] != v {
					continue next
				}
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				sum += m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				sum += m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// waitSample polls until sample(...) == want (the final-state hooks run
// right after the state change a waiter sees).
func waitSample(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string, want float64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := sample(t, g, name, labels)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s%v = %v, want %v", name, labels, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestMetricsAcrossOutcomes: one successful room, one that times out and one
// whose metadata record fails verification (a producer writing another
// room's record; no checksum, the production setting) move the engine's
// metrics and timelines as documented.
func TestMetricsAcrossOutcomes(t *testing.T) {
	addr := startBootstrap(t)
	preReg, decReg := prometheus.NewRegistry(), prometheus.NewRegistry()
	var lie bool // edit the record of the verification-failure room only
	rw := &recordEditor{edit: func(rec []byte) {
		if lie {
			binary.LittleEndian.PutUint64(rec, binary.LittleEndian.Uint64(rec)^1)
		}
	}}
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, metrics: preReg,
		wrap: func(tr transport.Transport) transport.Transport { rw.Transport = tr; return rw }})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, metrics: decReg, waiting: 1500 * time.Millisecond})}
	decRooms := func(state, reason, step string) map[string]string {
		return map[string]string{"role": "decode", "state": state, "reason": reason, "step": step}
	}

	// 1. Success.
	r := transferOneExpectFail(t, addr, pre, dec, 1001, 4)
	if r.Poll() != engine.KVSuccess {
		t.Fatalf("room 1001: %s %v", r.Poll(), r.Failure())
	}
	r.Close()
	waitSample(t, decReg, engine.MetricRooms, decRooms("success", "none", "none"), 1)
	waitSample(t, preReg, engine.MetricRooms, map[string]string{"role": "prefill", "state": "success"}, 1)
	if n := sample(t, decReg, engine.MetricTransferSeconds, map[string]string{"role": "decode"}); n != 1 {
		t.Errorf("decode transfer latency samples = %v, want 1", n)
	}
	if n := sample(t, preReg, engine.MetricTransferSeconds, map[string]string{"role": "prefill"}); n != 1 {
		t.Errorf("prefill transfer latency samples = %v, want 1", n)
	}
	peer := "decode tp0/pp0" // the peer label is the rank, never its address
	var pageBytes uint64
	for _, n := range dec[0].m.Geometry().KVItemLens {
		pageBytes += n
	}
	wantBytes := 4 * pageBytes
	if got := sample(t, preReg, engine.MetricBytes, map[string]string{"transport": "tcp", "peer": peer}); got < float64(wantBytes) {
		t.Errorf("bytes to %s = %v, want at least the %d KV bytes", peer, got, wantBytes)
	}
	if got := sample(t, preReg, engine.MetricWriteRequests, map[string]string{"transport": "tcp", "peer": peer}); got < 3 {
		t.Errorf("write requests = %v, want >= 3 (KV runs, record body, commit word)", got)
	}
	// One batch: tcp orders the commit word after the rest of it
	// (transport.CapOrderedLast), so it needs no batch of its own.
	if got := sample(t, preReg, engine.MetricBatches, map[string]string{"outcome": "completed"}); got < 1 {
		t.Errorf("completed batches = %v, want >= 1 (data, record and commit word)", got)
	}
	if got := sample(t, preReg, engine.MetricBatchesInFlight, nil); got != 0 {
		t.Errorf("batches in flight after the room = %v, want 0", got)
	}
	if got := sample(t, decReg, engine.MetricReceivedBytes, map[string]string{"peer": "prefill tp0/pp0"}); got != float64(wantBytes) {
		t.Errorf("decode received bytes from prefill tp0/pp0 = %v, want %d", got, wantBytes)
	}
	if got := sample(t, decReg, engine.MetricPeers, map[string]string{"role": "decode", "state": "connected"}); got != 1 {
		t.Errorf("decode connected peers = %v, want 1", got)
	}
	if got := sample(t, decReg, engine.MetricRingSlots, map[string]string{"state": "used"}); got != 0 {
		t.Errorf("ring slots used after Close = %v, want 0", got)
	}
	tl, ok := dec[0].m.RoomTimeline(1001)
	if !ok || tl.State != "Success" {
		t.Fatalf("decode timeline of room 1001: %v %+v", ok, tl)
	}
	for _, s := range engine.Steps(engine.RoleDecode) {
		if !hasDone(tl, s) {
			t.Errorf("decode timeline lacks step %s: %s", s, tl)
		}
	}
	ptl, ok := pre[0].m.RoomTimeline(1001)
	if !ok || ptl.State != "Success" || !hasDone(ptl, engine.StepTransfer) {
		t.Errorf("prefill timeline of room 1001: %v %s", ok, ptl)
	}

	// 2. Timeout: the prefill never creates the room, the decode's waiting
	// timeout fails it at the transfer step.
	dp, _ := dec[0].pool.Alloc(3)
	defer dec[0].pool.Free(dp)
	r, err := dec[0].m.NewReceiver(addr, 1002)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Init(dp); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrTimeout) {
		t.Fatalf("room 1002: %s %v, want Failed with a timeout", st, r.Failure())
	}
	r.Close()
	waitSample(t, decReg, engine.MetricRooms, decRooms("failed", engine.ReasonTimeout, string(engine.StepTransfer)), 1)
	if n := sample(t, decReg, engine.MetricTimeToFailedSeconds, map[string]string{"role": "decode", "reason": engine.ReasonTimeout}); n != 1 {
		t.Errorf("time-to-failed samples (timeout) = %v, want 1", n)
	}
	if tl, _ := dec[0].m.RoomTimeline(1002); tl.Step != engine.StepTransfer || tl.Reason != engine.ReasonTimeout || !hasDone(tl, engine.StepConnect) {
		t.Errorf("timeline of the timed-out room: %s", tl)
	}
	if n := sample(t, preReg, engine.MetricRooms, map[string]string{"role": "prefill"}); n != 1 {
		t.Errorf("prefill rooms = %v after a room it never created, want still 1", n)
	}

	// 3. Verification failure: the producer's record names another room.
	lie = true
	r = transferOneExpectFail(t, addr, pre, dec, 1003, 2)
	if r.Poll() != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrRoomMismatch) {
		t.Fatalf("room 1003: %s %v, want a bootstrap_room mismatch", r.Poll(), r.Failure())
	}
	r.Close()
	waitSample(t, decReg, engine.MetricRooms, decRooms("failed", engine.ReasonRoomMismatch, string(engine.StepVerify)), 1)
	waitSample(t, decReg, engine.MetricRooms, map[string]string{"role": "decode"}, 3)
	waitSample(t, preReg, engine.MetricRooms, map[string]string{"role": "prefill"}, 2)
	if tl, _ := dec[0].m.RoomTimeline(1003); tl.Step != engine.StepVerify || !hasDone(tl, engine.StepTransfer) || hasDone(tl, engine.StepVerify) {
		t.Errorf("timeline of the mismatched room: %s", tl)
	}
	if got := sample(t, decReg, engine.MetricReceivedBytes, nil); got != float64(wantBytes) {
		t.Errorf("decode received bytes = %v after two failed rooms, want still %d", got, wantBytes)
	}
	failed := dec[0].m.RoomTimelines(true, 0)
	if len(failed) != 2 || failed[0].Room != 1003 || failed[1].Room != 1002 {
		t.Errorf("failed timelines, newest first: %+v", failed)
	}
}

func hasDone(tl engine.RoomTimeline, s engine.Step) bool {
	for _, e := range tl.Events {
		if e.Step == s && e.Done {
			return true
		}
	}
	return false
}

// redialing is a tcp transport (every method, fencing included) whose
// Redials reports a fixed count.
type redialing struct {
	*tcp.Transport
	n uint64
}

func (r redialing) Redials() uint64 { return r.n }

func withRedials(n uint64) func(transport.Transport) transport.Transport {
	return func(tr transport.Transport) transport.Transport { return redialing{tr.(*tcp.Transport), n} }
}

// TestMetricsShareRegistry: two managers of one process may register on the
// same registry; counters add up and the gauges sum over both, redials
// read from the transports at scrape time included.
func TestMetricsShareRegistry(t *testing.T) {
	addr := startBootstrap(t)
	reg := prometheus.NewRegistry()
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, metrics: reg, wrap: withRedials(3)})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, metrics: reg, wrap: withRedials(4)})}
	for _, room := range []uint64{5, 6} {
		r := transferOneExpectFail(t, addr, pre, dec, room, 2)
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("room %d: %s %v", room, r.Poll(), r.Failure())
		}
		r.Close()
	}
	waitSample(t, reg, engine.MetricRooms, map[string]string{"state": "success"}, 4)
	if got := sample(t, reg, engine.MetricRingSlots, map[string]string{"state": "free"}); got != float64(dec[0].m.Ring().Slots()) {
		t.Errorf("free ring slots = %v, want %d", got, dec[0].m.Ring().Slots())
	}
	if got := sample(t, reg, engine.MetricPeers, map[string]string{"state": "connected"}); got != 2 {
		t.Errorf("connected peers over both managers = %v, want 2 (each side's PUSH socket)", got)
	}
	if got := sample(t, reg, engine.MetricRedials, map[string]string{"transport": "tcp"}); got != 7 {
		t.Errorf("redials over both managers' transports = %v, want 3+4", got)
	}
	if got := sample(t, reg, engine.MetricRingWaiters, nil); got != 0 {
		t.Errorf("ring slot waiters with no room = %v", got)
	}
	// A registry holding another kvxfer_rooms_total is refused by name.
	bad := prometheus.NewRegistry()
	bad.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: engine.MetricRooms, Help: "not the engine's"}))
	l, _ := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 4})
	pool, _ := workload.NewKVBuffers(l, workload.BufferOptions{Name: "bad", Device: -1})
	defer pool.Close()
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	_, err = engine.NewManager(context.Background(), engine.ManagerConfig{Role: engine.RoleDecode, KV: pool.Args(), Transports: []transport.Transport{tr}, Metrics: bad})
	if err == nil || !strings.Contains(err.Error(), "register metrics") {
		t.Fatalf("NewManager with a conflicting registry: %v, want a register-metrics error", err)
	}
}

// recordingRegisterer registers on a real registry and keeps the
// collectors.
type recordingRegisterer struct {
	*prometheus.Registry
	cs []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.cs = append(r.cs, c)
	return r.Registry.Register(c)
}

// TestMetricNamesAreRegistered: what a manager registers describes exactly
// engine.MetricNames (the list the Grafana dashboard test checks against).
func TestMetricNamesAreRegistered(t *testing.T) {
	rr := &recordingRegisterer{Registry: prometheus.NewRegistry()}
	l, _ := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 4})
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "names", Device: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	m, err := engine.NewManager(context.Background(), engine.ManagerConfig{Role: engine.RoleDecode, KV: pool.Args(), Transports: []transport.Transport{tr}, Metrics: rr})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	var got []string
	for _, c := range rr.cs {
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			if mm := fq.FindStringSubmatch(d.String()); mm != nil {
				got = append(got, mm[1])
			}
		}
	}
	want := engine.MetricNames()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("registered %v\nMetricNames %v", got, want)
	}
	for _, n := range want {
		if !strings.HasPrefix(n, "kvxfer_") || engine.MetricKind(n) == "" || engine.MetricLabels(n) == nil {
			t.Errorf("metric %s: kind %q labels %v", n, engine.MetricKind(n), engine.MetricLabels(n))
		}
		if engine.MetricKind(n) == "counter" && !strings.HasSuffix(n, "_total") {
			t.Errorf("counter %s does not end in _total", n)
		}
		if engine.MetricKind(n) == "histogram" && !strings.HasSuffix(n, "_seconds") {
			t.Errorf("histogram %s is not in seconds", n)
		}
	}
}

// TestMetricRoomsWaitingForPages: ManagerConfig.PagesWaiting is exported
// as kvxfer_rooms_waiting_for_pages by role, summed over the managers of
// one registry, read at each scrape.
func TestMetricRoomsWaitingForPages(t *testing.T) {
	reg := prometheus.NewRegistry()
	l, _ := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 4})
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "waiting", Device: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	m, err := engine.NewManager(context.Background(), engine.ManagerConfig{Role: engine.RoleDecode, KV: pool.Args(), Transports: []transport.Transport{tr},
		Metrics: reg, PagesWaiting: pool.Waiting})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	held, err := pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{}, 2)
	for range 2 {
		go func() { pool.AllocWait(ctx, 3); done <- struct{}{} }()
	}
	waitSample(t, reg, engine.MetricRoomsWaitingPages, map[string]string{"role": "decode"}, 2)
	pool.Free(held)
	<-done
	waitSample(t, reg, engine.MetricRoomsWaitingPages, map[string]string{"role": "decode"}, 1)
	cancel()
	<-done
	waitSample(t, reg, engine.MetricRoomsWaitingPages, map[string]string{"role": "decode"}, 0)
}
