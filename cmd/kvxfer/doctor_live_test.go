package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// runDoctorProc runs `kvxfer doctor --bootstrap addr --json extra...` as a
// process and returns its report and exit status.
func runDoctorProc(t *testing.T, addr string, extra ...string) (*chainReport, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], append([]string{"doctor", "--bootstrap", addr, "--json", "--log-level", "warn"}, extra...)...)
	cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1")
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var rep chainReport
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		t.Fatalf("doctor output is not a report: %v\n%s\nstderr: %s", jerr, out, stderr.String())
	}
	return &rep, exitCode(err)
}

// stepOf returns the report's step by name.
func stepOf(t *testing.T, r *chainReport, name string) chainStep {
	t.Helper()
	for _, s := range r.Steps {
		if s.Step == name {
			return s
		}
	}
	t.Fatalf("report has no step %s: %+v", name, r)
	return chainStep{}
}

// wantFirstFailure checks that step is the first that did not pass, with
// status, a detail containing every want, and a fix; the later steps are
// skipped.
func wantFirstFailure(t *testing.T, r *chainReport, step, status string, want ...string) {
	t.Helper()
	if r.OK || r.FirstFailure == nil || r.FirstFailure.Step != step || r.FirstFailure.Status != status {
		b, _ := json.MarshalIndent(r, "", "  ")
		t.Fatalf("first failure: want step %s %s, report:\n%s", step, status, b)
	}
	for _, w := range want {
		if !strings.Contains(r.FirstFailure.Detail, w) {
			t.Errorf("step %s detail %q lacks %q", step, r.FirstFailure.Detail, w)
		}
	}
	if r.FirstFailure.Fix == "" {
		t.Errorf("step %s says nothing about what to do", step)
	}
	after := false
	for _, s := range r.Steps {
		if after && s.Status != stepSkipped {
			t.Errorf("step %s after the failure: %s, want skipped", s.Step, s.Status)
		}
		if s.Step == step {
			after = true
		} else if !after && s.Status != stepPass {
			t.Errorf("step %s before the failure: %s", s.Step, s.Status)
		}
	}
}

// TestDoctorLiveDeployment: kvxfer doctor --bootstrap against real
// processes: a healthy two-rank instance (every step passes, exit 0), a
// directory missing a rank, a rank whose control port is closed, a
// transport mismatch and a rank refusing probes, each naming its step.
func TestDoctorLiveDeployment(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Run("healthy", func(t *testing.T) {
		_, addr := startBootstrapProc(t, "127.0.0.1", 0)
		for tp := 0; tp < 2; tp++ {
			p := startProc(t, "prefill tp"+strconv.Itoa(tp), nil, roleArgs("prefill", addr, "127.0.0.1", "--tp-size", "2", "--tp-rank", strconv.Itoa(tp))...)
			p.ready()
		}
		rep, code := runDoctorProc(t, addr, "--transport", "tcp")
		if code != 0 || !rep.OK {
			b, _ := json.MarshalIndent(rep, "", "  ")
			t.Fatalf("exit %d, report:\n%s", code, b)
		}
		if len(rep.Steps) != len(chainSteps) {
			t.Fatalf("steps %d, want %d", len(rep.Steps), len(chainSteps))
		}
		for i, s := range rep.Steps {
			if s.Step != chainSteps[i] || s.Status != stepPass {
				t.Errorf("step %d: %s %s, want %s pass", i, s.Step, s.Status, chainSteps[i])
			}
		}
		for _, name := range []string{"handshake", "transfer", "verify"} {
			if s := stepOf(t, rep, name); len(s.Items) != 2 {
				t.Errorf("%s: %d items, want one per rank over tcp: %+v", name, len(s.Items), s.Items)
			}
		}
		// The handshake step's time (the whole probe) says what it is made
		// of, apart from the rows' rank-side handshakes (issue 22).
		if d := stepOf(t, rep, "handshake").Detail; !strings.Contains(d, "opening this host's transports tcp and the prober") || !strings.Contains(d, "of probe round trips to 2 ranks") {
			t.Errorf("handshake detail %q: want the step's time split into opening the transports and the probe round trips", d)
		}
		// The default 64 KiB probe is a latency, not a bandwidth (issue 26).
		for _, it := range stepOf(t, rep, "transfer").Items {
			if !strings.Contains(it.Detail, "latency") || strings.Contains(it.Detail, "GB/s") {
				t.Errorf("transfer item %q: want a latency and no GB/s for a 64 KiB probe", it.Detail)
			}
		}
		rep, code = runDoctorProc(t, addr, "--transport", "tcp", "--probe-bytes", strconv.Itoa(8<<20))
		for _, it := range stepOf(t, rep, "transfer").Items {
			if code != 0 || !strings.Contains(it.Detail, "GB/s") {
				t.Errorf("8 MiB probe (exit %d): transfer item %q, want GB/s", code, it.Detail)
			}
		}
	})
	t.Run("missing-rank", func(t *testing.T) {
		_, addr := startBootstrapProc(t, "127.0.0.1", 0)
		p := startProc(t, "prefill tp0", nil, roleArgs("prefill", addr, "127.0.0.1", "--tp-size", "2", "--tp-rank", "0")...)
		p.ready()
		rep, err := runLiveDoctor(context.Background(), &liveDoctorFlags{bootstrap: addr, transport: "tcp", probeBytes: 4096, timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		wantFirstFailure(t, rep, "register", stepFail, "1 of 2 ranks registered", "dp0/cp0/tp1/pp0")
	})
	t.Run("closed-control-port", func(t *testing.T) {
		_, addr := startBootstrapProc(t, "127.0.0.1", 0)
		c, err := bootstrap.NewClient(addr)
		if err != nil {
			t.Fatal(err)
		}
		closed := freePort(t, "127.0.0.1") // nothing listens there
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err = c.Register(ctx, bootstrap.RegisterRequest{AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
			RankIP: "127.0.0.1", RankPort: closed, PageSize: 16})
		if err != nil {
			t.Fatal(err)
		}
		rep, code := runDoctorProc(t, addr, "--transport", "tcp", "--timeout", "3s")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		wantFirstFailure(t, rep, "connect", stepFail, "dp0/cp0/tp0/pp0", "127.0.0.1:"+strconv.Itoa(closed), "refused")
		if fix := rep.FirstFailure.Fix; !strings.Contains(fix, "--advertise-host") || !strings.Contains(fix, "firewall") {
			t.Errorf("advice for a closed control port: %q", fix)
		}
	})
	t.Run("transport-mismatch", func(t *testing.T) {
		if err := transport.ProbeTransport("shm"); err != nil {
			t.Skipf("shm unusable here: %v", err)
		}
		_, addr := startBootstrapProc(t, "127.0.0.1", 0)
		p := startProc(t, "prefill tcp only", nil, roleArgs("prefill", addr, "127.0.0.1")...) // roleArgs: --transport tcp
		p.ready()
		rep, err := runLiveDoctor(context.Background(), &liveDoctorFlags{bootstrap: addr, transport: "shm", probeBytes: 4096, timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		wantFirstFailure(t, rep, "handshake", stepFail, "no common transport", "this host offers shm", "the rank has tcp")
		if fix := rep.FirstFailure.Fix; !strings.Contains(fix, "--transport") || strings.Contains(fix, "firewall") {
			t.Errorf("advice for a transport mismatch: %q, want --transport and nothing about firewalls", fix)
		}
	})
	t.Run("no-probe", func(t *testing.T) {
		_, addr := startBootstrapProc(t, "127.0.0.1", 0)
		p := startProc(t, "prefill --no-probe", nil, roleArgs("prefill", addr, "127.0.0.1", "--no-probe")...)
		p.ready()
		rep, code := runDoctorProc(t, addr, "--transport", "tcp")
		if code != 2 {
			t.Errorf("exit %d, want 2 (stopped at the handshake)", code)
		}
		wantFirstFailure(t, rep, "handshake", stepStopped, "--no-probe")
	})
}

// TestRoleMetricsAndTimelines: ranks started with --metrics-addr serve
// their metrics and room timelines; kvxfer room shows a room on both sides,
// and a room that fails (the prefill never gets it) names its step.
func TestRoleMetricsAndTimelines(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0)
	pre := startProc(t, "prefill", nil, roleArgs("prefill", addr, "127.0.0.1", "--metrics-addr", "127.0.0.1:0")...)
	dec := startProc(t, "decode", nil, roleArgs("decode", addr, "127.0.0.1", "--metrics-addr", "127.0.0.1:0", "--waiting-timeout", "2s")...)
	pm, dm := pre.ready().Metrics, dec.ready().Metrics
	if pm == "" || dm == "" {
		t.Fatalf("ready lines name no metrics address: prefill %q decode %q", pm, dm)
	}
	transferRoom(t, 4242, pre, dec)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v := fetchRoom(ctx, 4242, []string{dm, pm})
	if len(v.Timelines) != 2 || len(v.Errors) != 0 {
		t.Fatalf("room 4242 on both ranks: %+v", v)
	}
	for _, tl := range v.Timelines {
		if tl.State != "Success" || tl.Room != 4242 {
			t.Errorf("%s timeline: %s", tl.Role, tl)
		}
	}
	var out strings.Builder
	printRoom(&out, v)
	if !strings.Contains(out.String(), "merged (each host's clock)") || !strings.Contains(out.String(), "verify done") {
		t.Errorf("kvxfer room output:\n%s", out.String())
	}
	// A room only the decode gets: its waiting timeout fails it at transfer.
	dec.send(requestLine{Room: 4343, Tokens: 64})
	if r := dec.result(time.Minute); r.OK {
		t.Fatalf("room 4343 succeeded without a prefill: %+v", r)
	}
	v = fetchRoom(ctx, 4343, []string{dm, pm})
	if len(v.Timelines) != 1 || v.Timelines[0].Step != engine.StepTransfer || v.Timelines[0].Reason != engine.ReasonTimeout || len(v.Missing) != 1 {
		t.Fatalf("room 4343: %+v", v)
	}
	ds, err := scrapeMetrics(ctx, dm)
	if err != nil {
		t.Fatal(err)
	}
	if n := sumSeries(ds, engine.MetricRooms, `state="success"`); n != 1 {
		t.Errorf("decode rooms success = %v, want 1", n)
	}
	if n := sumSeries(ds, engine.MetricRooms, `reason="timeout"`, `step="transfer"`); n != 1 {
		t.Errorf("decode rooms failed by timeout at transfer = %v, want 1", n)
	}
	ps, err := scrapeMetrics(ctx, pm)
	if err != nil {
		t.Fatal(err)
	}
	if n := sumSeries(ps, engine.MetricBytes, `transport="tcp"`); n == 0 {
		t.Errorf("prefill wrote no bytes by its metrics: %v", ps)
	}
	if n := sumSeries(ds, engine.MetricPoolPages, `state="free"`); n == 0 {
		t.Errorf("decode reports no free pool pages: %v", ds)
	}
}

// TestDoctorSGLangDirectory: doctor --bootstrap against a directory that
// speaks only SGLang's routes (GET /health, GET /route; anything else 404,
// as SGLang's aiohttp server answers) passes the register step as "ready,
// names not listed"; against a server that answers /health but is no
// directory at all (a rank's metrics port) it says so and what to give.
func TestDoctorSGLangDirectory(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	sglang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/health":
			_, _ = w.Write([]byte("OK"))
		case r.URL.Path == "/route" && r.URL.Query().Get("target_tp_rank") == "-1":
			_, _ = w.Write([]byte(`{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":16,"kv_cache_dtype":"auto","follow_bootstrap_room":true}`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer sglang.Close()
	rep, _ := runDoctorProc(t, strings.TrimPrefix(sglang.URL, "http://"), "--transport", "tcp", "--timeout", "5s")
	if st := stepOf(t, rep, "register"); st.Status != stepPass || !strings.Contains(st.Detail, "SGLang") {
		t.Errorf("register step against an SGLang directory: %+v, want pass naming SGLang", st)
	}

	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			_, _ = w.Write([]byte("OK"))
			return
		}
		http.NotFound(w, r)
	}))
	defer plain.Close()
	rep, code := runDoctorProc(t, strings.TrimPrefix(plain.URL, "http://"), "--transport", "tcp", "--timeout", "5s")
	if code != 1 {
		t.Errorf("exit %d against a server that is no directory, want 1", code)
	}
	wantFirstFailure(t, rep, "register", stepFail, "not a bootstrap directory")
}

// TestDoctorProbesLeaveNoTrace: 100 doctor probes (a fresh prober each, as
// every `kvxfer doctor` run is, each on its own ephemeral control port)
// against a live prefill rank that also served a room: the rank counts them
// in kvxfer_probes_total only. No peer is lost when a prober exits, no
// series is added by a probe, and no label value of any metric of either
// rank is an address (issue 26 item 2: label values are bounded).
func TestDoctorProbesLeaveNoTrace(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0)
	pre := startProc(t, "prefill", nil, roleArgs("prefill", addr, "127.0.0.1", "--metrics-addr", "127.0.0.1:0")...)
	dec := startProc(t, "decode", nil, roleArgs("decode", addr, "127.0.0.1", "--metrics-addr", "127.0.0.1:0")...)
	pr := pre.ready()
	pm, dm := pr.Metrics, dec.ready().Metrics
	transferRoom(t, 7001, pre, dec)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	probe := func() {
		t.Helper()
		tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		p, err := engine.NewProber(engine.ProberConfig{Transports: []transport.Transport{tr}, Length: 64 << 10, Timeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		rep, err := p.Probe(ctx, pr.Endpoint)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Refused != "" || len(rep.Results) != 1 || !rep.Results[0].Verified {
			t.Fatalf("probe: %+v", rep)
		}
	}
	probe()
	before, err := scrapeMetrics(ctx, pm)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < 100; i++ {
		probe()
	}
	transferRoom(t, 7002, pre, dec) // the rank still serves rooms
	after, err := scrapeMetrics(ctx, pm)
	if err != nil {
		t.Fatal(err)
	}
	if n := sumSeries(after, engine.MetricProbes, `result="passed"`); n != 100 {
		t.Errorf("probes passed = %v, want 100", n)
	}
	if n := sumSeries(after, engine.MetricPeersLost); n != 0 {
		t.Errorf("peers lost after 100 probes = %v, want 0 (a prober is no peer)", n)
	}
	if n := sumSeries(after, engine.MetricPeers, `state="connected"`); n != 1 {
		t.Errorf("connected peers = %v, want 1 (the decode; probers are not peers)", n)
	}
	if n := sumSeries(after, engine.MetricBytes, `peer="decode tp0/pp0"`); n == 0 {
		t.Errorf("no bytes to peer \"decode tp0/pp0\": %v", after)
	}
	var added []string
	for k := range after {
		if _, ok := before[k]; !ok && strings.HasPrefix(k, "kvxfer_") {
			added = append(added, k)
		}
	}
	if len(added) != 0 {
		t.Errorf("99 more probes (and a room) added series: %v", added)
	}
	ds, err := scrapeMetrics(ctx, dm)
	if err != nil {
		t.Fatal(err)
	}
	addrLike := regexp.MustCompile(`="([^"]*(:[0-9]+|tcp://)[^"]*)"`)
	for _, s := range []map[string]float64{after, ds} {
		for k := range s {
			if m := addrLike.FindStringSubmatch(k); m != nil {
				t.Errorf("label value %q is an address: %s", m[1], k)
			}
		}
	}
}
