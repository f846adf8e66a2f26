package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
)

// kvxfer doctor --bootstrap HOST:PORT walks the evidence chain against a
// live prefill instance, as a decode would, with a probe room:
//
//	directory         GET /health answers
//	register          every rank of the topology registered (GET /v1/table; missing ranks named)
//	resolve_topology  PrefillServerInfo (GET /route, all -1)
//	resolve_rank      each rank's rank_ip:rank_port (GET /route per rank)
//	connect           each rank's control port accepts a TCP connection from this host
//	handshake         per rank and transport: PROBE answered, data path opened (RDMA QP exchange included)
//	transfer          per rank and transport: the probe bytes written into this host's scratch region
//	verify            per rank and transport: the bytes landed intact
//
// The first failing step is printed with what to do; the later steps are
// skipped. Exit status: 0 every step passed, 1 a step failed, 2 a rank
// refused probes (--no-probe): the doctor stopped at the handshake.

// Doctor step statuses.
const (
	stepPass    = "pass"
	stepFail    = "fail"
	stepStopped = "stopped"
	stepSkipped = "skipped"
)

// chainItem is one rank (and transport) inside a step.
type chainItem struct {
	Rank      string  `json:"rank"`
	Endpoint  string  `json:"endpoint,omitempty"`
	Transport string  `json:"transport,omitempty"`
	Status    string  `json:"status"`
	MS        float64 `json:"ms"`
	Detail    string  `json:"detail,omitempty"`
}

// chainStep is one step of kvxfer doctor --bootstrap.
type chainStep struct {
	Step   string      `json:"step"`
	Status string      `json:"status"`
	MS     float64     `json:"ms"`
	Detail string      `json:"detail"`
	Fix    string      `json:"fix,omitempty"`
	Items  []chainItem `json:"items,omitempty"`
}

// chainReport is the whole walk (--json).
type chainReport struct {
	Bootstrap  string      `json:"bootstrap"`
	OK         bool        `json:"ok"`
	Transports []string    `json:"transports"`
	Steps      []chainStep `json:"steps"`
	// FirstFailure is the first step that did not pass (nil when OK).
	FirstFailure *chainStep `json:"first_failure,omitempty"`
}

// chainSteps are the step names in order.
var chainSteps = []string{"directory", "register", "resolve_topology", "resolve_rank", "connect", "handshake", "transfer", "verify"}

// liveDoctorFlags are doctor's deployment flags.
type liveDoctorFlags struct {
	bootstrap  string
	transport  string
	host       string
	probeBytes int
	timeout    time.Duration
	// controlAuth is --control-auth (auto, true, false): whether the
	// probe's control frames are tagged with the bootstrap auth token.
	controlAuth string
	authToken   string
}

// errDoctor carries doctor's exit status (1 failed, 2 stopped).
type errDoctor struct {
	code int
	msg  string
}

func (e errDoctor) Error() string { return e.msg }

// ExitCode is the process exit status.
func (e errDoctor) ExitCode() int { return e.code }

// validate checks the flags the walk cannot take as given.
func (f *liveDoctorFlags) validate() error {
	if f.probeBytes < 1 || f.probeBytes > engine.MaxProbeBytes {
		return fmt.Errorf("--probe-bytes %d: want 1 … %d", f.probeBytes, engine.MaxProbeBytes)
	}
	if f.timeout <= 0 {
		return fmt.Errorf("--timeout %s: must be > 0", f.timeout)
	}
	return nil
}

// doctorWalk is one walk of the chain: what each step found, for the next.
type doctorWalk struct {
	walk
	f      *liveDoctorFlags
	client *bootstrap.Client
	// table is the directory's table (nil for an SGLang directory), info
	// its PrefillServerInfo, targets the ranks resolved, reports their
	// probes (nil where the probe failed), in targets' order.
	table   *bootstrap.TableSnapshot
	info    *bootstrap.PrefillServerInfo
	targets []doctorTarget
	reports []*engine.ProbeReport
}

// doctorTarget is one rank to probe: its coordinates and control endpoint.
type doctorTarget struct {
	coord bootstrap.Coord
	ep    string
}

func (t doctorTarget) addr() string { return strings.TrimPrefix(t.ep, "tcp://") }

// runLiveDoctor runs the walk and returns the report; the report's steps say
// what failed, the error only what stopped the doctor itself (bad flags).
func runLiveDoctor(ctx context.Context, f *liveDoctorFlags) (*chainReport, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	client, err := bootstrap.NewClient(f.bootstrap) // read-only routes: no token needed
	if err != nil {
		return nil, fmt.Errorf("--bootstrap %q: %w", f.bootstrap, err)
	}
	rep := &chainReport{Bootstrap: f.bootstrap}
	d := &doctorWalk{walk: walk{rep: rep, ctx: ctx, timeout: f.timeout}, f: f, client: client}
	d.step("directory", d.directory)
	d.step("register", d.register)
	d.step("resolve_topology", d.resolveTopology)
	d.step("resolve_rank", d.resolveRank)
	d.step("connect", d.connect)
	d.step("handshake", d.handshake) // handshake, transfer, verify: one probe per rank
	d.step("transfer", d.transfer)
	d.step("verify", d.verify)
	rep.OK = rep.FirstFailure == nil
	return rep, nil
}

// directory: GET /health answers.
func (d *doctorWalk) directory(s *chainStep) {
	if err := d.call(func(ctx context.Context) error { return d.client.Health(ctx) }); err != nil {
		s.fail(fmt.Sprintf("the bootstrap directory at %s does not answer GET /health: %v", d.f.bootstrap, err),
			"check the address (the prefill instance's bootstrap host:port, default port 8998; IPv6 as [addr]:port), that its bootstrap server runs (kvxfer bootstrap, or SGLang's prefill), and that this host can reach it")
		return
	}
	s.pass("GET /health answered")
}

// register: every rank of the topology registered (GET /v1/table; an
// SGLang directory has none: its readiness, GET /route, stands in).
func (d *doctorWalk) register(s *chainStep) {
	err := d.call(func(ctx context.Context) error { var err error; d.table, err = d.client.Table(ctx); return err })
	if errors.Is(err, bootstrap.ErrUnsupported) {
		d.registerSGLang(s)
		return
	}
	if err != nil {
		s.fail(fmt.Sprintf("GET /v1/table: %v", err), "check the directory's log; kvxfer bootstrap table "+d.f.bootstrap+" shows the same table")
		return
	}
	switch t := d.table; {
	case t.Expected == 0:
		s.fail("no prefill rank has registered yet", "start the prefill ranks with --bootstrap "+d.f.bootstrap+"; each registers with PUT /route when it starts")
	case !t.Ready && t.Registered == t.Expected && t.Stale > 0:
		var silent []string
		for _, r := range t.Ranks {
			if r.Stale {
				silent = append(silent, fmt.Sprintf("%s at %s", coordName(r.Coord), r.Endpoint()))
			}
		}
		s.fail(fmt.Sprintf("all %d ranks registered, but %d stopped checking in with the directory beyond their heartbeat bound: %s", t.Registered, t.Stale, strings.Join(silent, ", ")),
			"those ranks are dead, hung or cut off from the directory: read their logs, restart them (a restarted rank registers again), and check that they reach "+d.f.bootstrap)
	case !t.Ready:
		var miss []string
		for i, c := range t.Missing {
			if i == 16 {
				miss = append(miss, fmt.Sprintf("… %d more", len(t.Missing)-16))
				break
			}
			miss = append(miss, coordName(c))
		}
		s.fail(fmt.Sprintf("%d of %d ranks registered; missing: %s", t.Registered, t.Expected, strings.Join(miss, ", ")),
			"start the missing prefill ranks, or read their logs: a rank that cannot reach the directory, or whose registration is refused (409 topology conflict, 401 token), says so; kvxfer bootstrap table "+d.f.bootstrap+" lists the table")
	default:
		s.pass(fmt.Sprintf("all %d ranks registered", t.Registered))
	}
}

// registerSGLang is the register step for a directory without GET
// /v1/table: readiness without names.
func (d *doctorWalk) registerSGLang(s *chainStep) {
	err := d.call(func(ctx context.Context) error { _, err := d.client.ServerInfo(ctx); return err })
	switch {
	case errors.Is(err, bootstrap.ErrUnsupported):
		s.fail(fmt.Sprintf("%s answers GET /health but has neither GET /v1/table nor GET /route: it is not a bootstrap directory (%v)", d.f.bootstrap, err),
			"give --bootstrap the prefill instance's bootstrap host:port (default port 8998), not a rank's metrics or control port")
	case err != nil:
		s.fail(fmt.Sprintf("the directory (not a kvxfer one: no /v1/table) is not ready: %v", err),
			"start the prefill ranks that did not register; each registers with PUT /route when it starts (see its log)")
	default:
		s.pass("ready (SGLang directory: rank names not listed)")
	}
}

// resolveTopology: PrefillServerInfo (GET /route, all -1).
func (d *doctorWalk) resolveTopology(s *chainStep) {
	err := d.call(func(ctx context.Context) error { var err error; d.info, err = d.client.ServerInfo(ctx); return err })
	if err != nil {
		s.fail(fmt.Sprintf("GET /route (PrefillServerInfo): %v", err), "the directory is not ready or refuses the query; see the register step and the directory's log")
		return
	}
	info := d.info
	detail := fmt.Sprintf("dp %d × cp %d × tp %d × pp %d", info.DPSize, max(info.AttnCPSize, 1), info.AttnTPSize, info.PPSize)
	if info.PageSize != nil {
		detail += fmt.Sprintf(", page_size %d", *info.PageSize)
	}
	if info.KVCacheDtype != nil {
		detail += ", kv_cache_dtype " + *info.KVCacheDtype
	}
	s.pass(detail)
}

// coords are the ranks to resolve: the table's, or every coordinate of
// the topology for an SGLang directory.
func (d *doctorWalk) coords() []bootstrap.Coord {
	var coords []bootstrap.Coord
	if d.table != nil {
		for _, r := range d.table.Ranks {
			coords = append(coords, r.Coord)
		}
		return coords
	}
	info := d.info
	for dp := 0; dp < max(info.DPSize, 1); dp++ {
		for cp := 0; cp < max(info.AttnCPSize, 1); cp++ {
			for tp := 0; tp < info.AttnTPSize; tp++ {
				for pp := 0; pp < max(info.PPSize, 1); pp++ {
					coords = append(coords, bootstrap.Coord{DP: dp, CP: cp, TP: tp, PP: pp})
				}
			}
		}
	}
	return coords
}

// resolveRank: each rank's rank_ip:rank_port (GET /route per rank).
func (d *doctorWalk) resolveRank(s *chainStep) {
	coords := d.coords()
	failed := 0
	for _, c := range coords {
		t0 := time.Now()
		var ri *bootstrap.PrefillRankInfo
		err := d.call(func(ctx context.Context) error {
			var err error
			ri, err = d.client.RankInfo(ctx, c.DP, c.CP, c.TP, c.PP)
			return err
		})
		it := chainItem{Rank: coordName(c), MS: ms(time.Since(t0))}
		if err != nil {
			it.Status, it.Detail = stepFail, err.Error()
			failed++
		} else {
			it.Status, it.Endpoint = stepPass, strings.TrimPrefix(ri.Endpoint(), "tcp://")
			d.targets = append(d.targets, doctorTarget{c, ri.Endpoint()})
		}
		s.Items = append(s.Items, it)
	}
	if failed > 0 {
		s.fail(fmt.Sprintf("%d of %d ranks could not be looked up (GET /route per rank)", failed, len(coords)), "see the items; a rank that deregistered meanwhile is restarting or gone")
		return
	}
	s.pass(fmt.Sprintf("%d rank endpoints", len(d.targets)))
}

// connect: each rank's control port accepts a TCP connection from here.
func (d *doctorWalk) connect(s *chainStep) {
	var bad []string
	for _, t := range d.targets {
		t0 := time.Now()
		err := d.call(func(ctx context.Context) error {
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", t.addr())
			if err == nil {
				_ = c.Close()
			}
			return err
		})
		it := chainItem{Rank: coordName(t.coord), Endpoint: t.addr(), Status: stepPass, MS: ms(time.Since(t0))}
		if err != nil {
			it.Status, it.Detail = stepFail, dialReason(err)
			bad = append(bad, fmt.Sprintf("%s at %s (%s)", it.Rank, it.Endpoint, it.Detail))
		}
		s.Items = append(s.Items, it)
	}
	if len(bad) > 0 {
		s.fail(fmt.Sprintf("%d of %d rank control endpoints unreachable from this host: %s", len(bad), len(d.targets), strings.Join(bad, "; ")),
			"the rank's control port is closed or filtered: check that the process still runs (a stale registration outlives a killed rank until it is replaced), that its --host/--advertise-host is an address this host can reach, and firewalls between the hosts")
		return
	}
	s.pass(fmt.Sprintf("%d control endpoints accept connections", len(d.targets)))
}

// probeOutcome gathers the handshake step's findings over the ranks: what
// failed, which ranks refused probes, and what kind of failure it was (for
// the advice).
type probeOutcome struct {
	fails, refused              []string
	silent, mismatch, refusedHS bool
}

// handshake: per rank and transport, PROBE answered and the data path
// opened; the probe also writes and checks the bytes the next two steps
// report.
//
// The step's time is the doctor's whole probe: opening this host's
// transports and the prober, then each rank's probe round trip (the rank
// allocates and registers a probe buffer per transport, opens the segment,
// writes, and answers). A row's time is only the rank's handshake for one
// transport (opening the segment to the ack), so the two can differ by
// orders of magnitude; the detail names the parts.
func (d *doctorWalk) handshake(s *chainStep) {
	t0 := time.Now()
	p, closeProber, ok := d.newProber(s)
	if !ok {
		return
	}
	defer closeProber()
	opened := time.Since(t0)
	var o probeOutcome
	var trips time.Duration
	for _, t := range d.targets {
		t1 := time.Now()
		d.reports = append(d.reports, d.probeRank(p, t, s, &o))
		trips += time.Since(t1)
	}
	phases := fmt.Sprintf(" (the step's time: %.1f ms opening this host's transports %s and the prober, %.1f ms of probe round trips to %d ranks; a row is the rank's own handshake over one transport, segment open to ack)",
		ms(opened), strings.Join(d.rep.Transports, ","), ms(trips), len(d.targets))
	switch {
	case len(o.fails) > 0:
		var fix []string
		if o.mismatch {
			fix = append(fix, "no common transport: run the doctor with --transport naming one the rank has (listed above), or start the ranks with a transport this host has")
		}
		if o.silent {
			fix = append(fix, "no answer to the probe: the rank cannot reach this host at "+p.Endpoint()+" (a firewall, or give --doctor-host an address the ranks reach), or the rank is stalled (see its log)")
		}
		if o.refusedHS {
			fix = append(fix, "a failed handshake names its cause on the rank: read the error above and the rank's log (memlock, a missing device, a peer lost)")
		}
		s.fail(strings.Join(o.fails, "; ")+phases, strings.Join(fix, "; "))
	case len(o.refused) > 0:
		s.stop(fmt.Sprintf("%s refuse probes (started with --no-probe): the doctor stops at the handshake; the control channel answers, but the data path is not proven", strings.Join(o.refused, ", ")),
			"restart those ranks without --no-probe to let the doctor prove their data path (a probe writes a small pattern into the doctor's scratch region, never serving KV)")
	default:
		s.pass(fmt.Sprintf("%d ranks answered the probe; data paths opened", len(d.targets)) + phases)
	}
}

// newProber opens this host's transports and the prober (failing s when
// it cannot); closeProber closes both.
func (d *doctorWalk) newProber(s *chainStep) (p *engine.Prober, closeProber func(), ok bool) {
	ts, err := openTransports(d.f.transport, hostOr(d.f.host, "127.0.0.1"), "")
	if err != nil {
		s.fail(fmt.Sprintf("this host can open no transport: %v", err), "run kvxfer doctor (without --bootstrap) to see what this host offers")
		return nil, nil, false
	}
	for _, t := range ts {
		d.rep.Transports = append(d.rep.Transports, t.Name())
	}
	host := d.f.host
	if host == "" && len(d.targets) > 0 {
		host = localAddrToward(d.targets[0].addr())
	}
	pc := engine.ProberConfig{Transports: ts, Length: d.f.probeBytes, ControlHost: host, Timeout: d.f.timeout + 2*10*time.Second}
	if !validControlAuth(d.f.controlAuth) {
		closeAll(ts)
		s.fail(fmt.Sprintf("--control-auth %q is not auto, true or false", d.f.controlAuth), "give --control-auth=true, false or auto")
		return nil, nil, false
	}
	if tok := bootstrapToken(d.f.authToken, os.Getenv); controlAuthOn(d.f.controlAuth, tok) {
		if pc.AuthToken = tok; pc.AuthToken == "" {
			closeAll(ts)
			s.fail("--control-auth needs the deployment's token", "give --bootstrap-auth-token or set KVXFER_BOOTSTRAP_AUTH_TOKEN")
			return nil, nil, false
		}
	}
	p, err = engine.NewProber(pc)
	if err != nil {
		closeAll(ts)
		s.fail(err.Error(), "give --doctor-host an address of this host that the ranks can reach")
		return nil, nil, false
	}
	return p, func() { _ = p.Close(); closeAll(ts) }, true
}

// probeRank probes one rank, adding its items to s and its findings to o;
// it returns the report (nil when the probe itself failed).
func (d *doctorWalk) probeRank(p *engine.Prober, t doctorTarget, s *chainStep, o *probeOutcome) *engine.ProbeReport {
	pctx, cancel := context.WithTimeout(d.ctx, d.f.timeout+10*time.Second)
	pr, err := p.Probe(pctx, t.ep)
	cancel()
	name := coordName(t.coord)
	if err != nil {
		s.Items = append(s.Items, chainItem{Rank: name, Endpoint: t.addr(), Status: stepFail, Detail: err.Error()})
		o.fails = append(o.fails, fmt.Sprintf("%s: %v", name, err))
		if errors.Is(err, engine.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) {
			o.silent = true
		} else {
			o.refusedHS = true
		}
		return nil
	}
	if pr.Refused != "" {
		s.Items = append(s.Items, chainItem{Rank: name, Endpoint: t.addr(), Status: stepStopped, MS: ms(pr.RoundTrip), Detail: pr.Refused})
		o.refused = append(o.refused, name)
		return pr
	}
	ok, failed := 0, 0
	var notes []string
	for _, r := range pr.Results {
		it := chainItem{Rank: name, Endpoint: t.addr(), Transport: r.Transport, Status: stepPass, MS: ms(r.Handshake)}
		switch {
		case r.NotApplicable:
			it.Status, it.Detail = stepSkipped, r.Err
			notes = append(notes, r.Transport+": "+r.Err)
		case r.Stage == "handshake":
			it.Status, it.Detail = stepFail, r.Err
			o.fails = append(o.fails, fmt.Sprintf("%s over %s: %s", name, r.Transport, r.Err))
			failed++
			o.refusedHS = true
		default:
			ok++
		}
		s.Items = append(s.Items, it)
	}
	if ok == 0 && failed == 0 {
		o.mismatch = true
		why := ""
		if len(notes) > 0 {
			why = " (" + strings.Join(notes, "; ") + ")"
		}
		o.fails = append(o.fails, fmt.Sprintf("%s: no common transport: this host offers %s, the rank has %s%s", name,
			strings.Join(d.rep.Transports, ","), strings.Join(pr.Transports, ","), why))
	}
	return pr
}

// probeBandwidthMin is the smallest probe whose transfer time is reported
// as a bandwidth: below it the time is the write's latency (round trips,
// completion), not a rate of the path.
const probeBandwidthMin = 4 << 20

// transfer: per rank and transport, the probe bytes written into this
// host's scratch region: a probe below probeBandwidthMin is reported as a
// write latency, a larger one also as GB/s.
func (d *doctorWalk) transfer(s *chainStep) {
	var fails []string
	for i, t := range d.targets {
		for _, r := range usable(d.reports[i]) {
			it := chainItem{Rank: coordName(t.coord), Endpoint: t.addr(), Transport: r.Transport, Status: stepPass, MS: ms(r.Transfer)}
			switch {
			case r.Stage == "transfer":
				it.Status, it.Detail = stepFail, r.Err
				fails = append(fails, fmt.Sprintf("%s over %s: %s", it.Rank, r.Transport, r.Err))
			case d.f.probeBytes < probeBandwidthMin:
				it.Detail = fmt.Sprintf("%d bytes written in %.2f ms (a write's latency: a probe under %d MiB is too small for a bandwidth figure; --probe-bytes 16M gives one)",
					d.f.probeBytes, ms(r.Transfer), probeBandwidthMin>>20)
			default:
				it.Detail = fmt.Sprintf("%d bytes in %.2f ms, %.2f GB/s", d.f.probeBytes, ms(r.Transfer), float64(d.f.probeBytes)/max(r.Transfer.Seconds(), 1e-9)/1e9)
			}
			s.Items = append(s.Items, it)
		}
	}
	for _, it := range s.Items {
		s.MS += it.MS
	}
	if len(fails) > 0 {
		s.fail(strings.Join(fails, "; "), "the data path opened but the write failed: read the error (a peer lost mid-write, a refused region) and the rank's log")
		return
	}
	s.pass(fmt.Sprintf("%d probe writes of %d bytes", len(s.Items), d.f.probeBytes))
}

// verify: per rank and transport, the bytes landed intact.
func (d *doctorWalk) verify(s *chainStep) {
	var fails []string
	for i, t := range d.targets {
		for _, r := range usable(d.reports[i]) {
			it := chainItem{Rank: coordName(t.coord), Endpoint: t.addr(), Transport: r.Transport, Status: stepPass, Detail: "pattern intact"}
			if !r.Verified {
				it.Status, it.Detail = stepFail, r.VerifyErr
				fails = append(fails, fmt.Sprintf("%s over %s: %s", it.Rank, r.Transport, r.VerifyErr))
			}
			s.Items = append(s.Items, it)
		}
	}
	if len(fails) > 0 {
		s.fail(strings.Join(fails, "; "), "bytes reported written did not land intact: the transport is corrupting data (run kvxfer bench on both hosts, check the NIC/driver); serve with --checksum until fixed")
		return
	}
	s.pass(fmt.Sprintf("%d scratch regions hold the probe pattern", len(s.Items)))
}

// usable is the probe results that got past the handshake.
func usable(r *engine.ProbeReport) []engine.ProbeTransportResult {
	if r == nil || r.Refused != "" {
		return nil
	}
	var out []engine.ProbeTransportResult
	for _, x := range r.Results {
		if !x.NotApplicable && x.Stage != "handshake" {
			out = append(out, x)
		}
	}
	return out
}

// walk runs the steps in order; after the first that does not pass, the
// rest are skipped.
type walk struct {
	rep     *chainReport
	ctx     context.Context
	timeout time.Duration
}

func (w *walk) call(f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(w.ctx, w.timeout)
	defer cancel()
	return f(ctx)
}

func (w *walk) step(name string, run func(s *chainStep)) {
	s := chainStep{Step: name}
	if w.rep.FirstFailure != nil {
		s.Status, s.Detail = stepSkipped, "not run: an earlier step did not pass"
		w.rep.Steps = append(w.rep.Steps, s)
		return
	}
	t0 := time.Now()
	run(&s)
	if s.MS == 0 { // a step may state its own time (the rank-side stages of a probe)
		s.MS = ms(time.Since(t0))
	}
	if s.Status == "" {
		s.Status = stepPass
	}
	w.rep.Steps = append(w.rep.Steps, s)
	if s.Status != stepPass {
		last := w.rep.Steps[len(w.rep.Steps)-1]
		w.rep.FirstFailure = &last
	}
}

func (s *chainStep) pass(detail string) { s.Status, s.Detail = stepPass, detail }
func (s *chainStep) fail(detail, fix string) {
	s.Status, s.Detail, s.Fix = stepFail, detail, fix
}
func (s *chainStep) stop(detail, fix string) {
	s.Status, s.Detail, s.Fix = stepStopped, detail, fix
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// coordName is a rank's coordinates, short: "dp0/cp0/tp1/pp0".
func coordName(c bootstrap.Coord) string {
	return fmt.Sprintf("dp%d/cp%d/tp%d/pp%d", c.DP, c.CP, c.TP, c.PP)
}

// dialReason is what a failed TCP dial says, without the Go noise.
func dialReason(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "no answer (timed out: filtered, or the host is down)"
	}
	return err.Error()
}

// localAddrToward is this host's address on the route to addr ("host:port")
// — where a rank there can reach the doctor; 127.0.0.1 when unknown.
func localAddrToward(addr string) string {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "127.0.0.1"
	}
	defer c.Close()
	if ua, ok := c.LocalAddr().(*net.UDPAddr); ok {
		return ua.IP.String()
	}
	return "127.0.0.1"
}

func hostOr(h, def string) string {
	if h == "" {
		return def
	}
	return h
}

// printChain prints the walk as a table, then the first failing step and
// what to do.
func printChain(w io.Writer, r *chainReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "STEP\tSTATUS\tTIME\tDETAIL\n")
	for _, s := range r.Steps {
		fmt.Fprintf(tw, "%s\t%s\t%.1f ms\t%s\n", s.Step, s.Status, s.MS, s.Detail)
		for _, it := range s.Items {
			who := it.Rank
			if it.Transport != "" {
				who += " " + it.Transport
			}
			if it.Endpoint != "" {
				who += " @" + it.Endpoint
			}
			fmt.Fprintf(tw, "  %s\t%s\t%.1f ms\t%s\n", who, it.Status, it.MS, it.Detail)
		}
	}
	_ = tw.Flush()
	if r.FirstFailure == nil {
		fmt.Fprintf(w, "every step passed: directory %s, its ranks and their data paths (%s) work from this host\n", r.Bootstrap, strings.Join(r.Transports, ","))
		return
	}
	ff := r.FirstFailure
	fmt.Fprintf(w, "FIRST FAILING STEP: %s (%s): %s\n", ff.Step, ff.Status, ff.Detail)
	if ff.Fix != "" {
		fmt.Fprintf(w, "WHAT TO DO: %s\n", ff.Fix)
	}
}

// finishLiveDoctor prints the report and returns doctor's exit status as
// an errDoctor (nil when every step passed).
func finishLiveDoctor(out io.Writer, r *chainReport, jsonOut bool) error {
	if jsonOut {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			return err
		}
	} else {
		printChain(out, r)
	}
	if r.FirstFailure == nil {
		return nil
	}
	code := 1
	if r.FirstFailure.Status == stepStopped {
		code = 2
	}
	return errDoctor{code: code, msg: fmt.Sprintf("doctor: step %s %s", r.FirstFailure.Step, map[string]string{stepFail: "failed", stepStopped: "stopped the walk"}[r.FirstFailure.Status])}
}
