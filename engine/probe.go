package engine

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Doctor probes: the PROBE and PROBE_RESULT frames are in the control codec
// (package engine/internal/control).
const (
	// MaxProbeBytes bounds a probe's length per transport (16 MiB; the
	// PROBE decoder refuses more).
	MaxProbeBytes = control.MaxProbeBytes
	// DefaultProbeBytes is the probe length a Prober uses when none is
	// given (1 MiB).
	DefaultProbeBytes = 1 << 20
	// probeStepTimeout bounds each stage of a probe on the rank.
	probeStepTimeout = 10 * time.Second
)

// ProbeTransportResult is the outcome of one transport of a probe.
type ProbeTransportResult struct {
	// Transport is the transport's name.
	Transport string `json:"transport"`
	// Stage is where it failed: "" (passed), "handshake" (opening the
	// segment, QP exchange) or "transfer" (the write).
	Stage string `json:"failed_stage,omitempty"`
	// Err says why.
	Err string `json:"error,omitempty"`
	// NotApplicable: the transport cannot connect these two hosts (shm
	// across hosts) or the rank does not have it; not a fault.
	NotApplicable bool `json:"not_applicable,omitempty"`
	// Handshake and Transfer are the stages' durations on the rank.
	Handshake time.Duration `json:"handshake_ns"`
	Transfer  time.Duration `json:"transfer_ns"`
	// Verified (prober side): the scratch region holds exactly the
	// pattern; VerifyErr says what differs.
	Verified  bool   `json:"verified"`
	VerifyErr string `json:"verify_error,omitempty"`
}

// wire is the part of r that PROBE_RESULT carries.
func (r ProbeTransportResult) wire() control.ProbeResult {
	return control.ProbeResult{Transport: r.Transport, Stage: r.Stage, Err: r.Err, NotApplicable: r.NotApplicable, Handshake: r.Handshake, Transfer: r.Transfer}
}

// fromWire returns the results of a PROBE_RESULT, not yet verified.
func fromWire(rs []control.ProbeResult) []ProbeTransportResult {
	var out []ProbeTransportResult // nil when there is none, as before the codec had its own type
	for _, r := range rs {
		out = append(out, ProbeTransportResult{Transport: r.Transport, Stage: r.Stage, Err: r.Err, NotApplicable: r.NotApplicable, Handshake: r.Handshake, Transfer: r.Transfer})
	}
	return out
}

// ProbePattern fills b with the bytes a probe of id writes over transport
// (a SplitMix64 stream seeded by id and the transport's name), so the
// prober can check what landed.
func ProbePattern(id uint64, transport string, b []byte) {
	h := fnv.New64a()
	h.Write([]byte(transport))
	x := id ^ h.Sum64()
	for i := 0; i < len(b); i += 8 {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		z ^= z >> 31
		for k := 0; k < 8 && i+k < len(b); k++ {
			b[i+k] = byte(z >> (8 * k))
		}
	}
}

// probeKey names a probe's HANDSHAKE_ACK wait on the rank.
type probeKey struct {
	endpoint  string
	id        uint64
	transport string
}

// handleProbe answers a doctor's PROBE (prefill ranks only): refused when
// ManagerConfig.NoProbe is set or another probe runs, else one result per
// offered transport, written from a fresh probe buffer (never the KV).
func (m *Manager) handleProbe(v *control.ProbeMsg) {
	res := &control.ProbeResultMsg{Endpoint: m.endpoint, ID: v.ID, Rank: m.cfg.Role.String() + " " + m.rankName, Transports: m.TransportNames()}
	switch {
	case m.cfg.NoProbe:
		res.Refused = "this rank refuses probes (started with --no-probe); the data path cannot be proven from outside"
	case m.cfg.Role != RolePrefill:
		res.Refused = "decode ranks take no probes; probe the prefill ranks (kvxfer doctor --bootstrap names their directory)"
	case !m.probing.CompareAndSwap(false, true):
		res.Refused = "another probe is running on this rank; try again in a few seconds"
	}
	if res.Refused != "" {
		m.met.probes.WithLabelValues("refused").Inc()
		m.log.Info("probe refused", "prober", peerLabel(v.Endpoint), "probe", v.ID, "why", res.Refused)
		if n := m.probeRefusals.Add(1); n > maxProbeRefusals {
			m.probeRefusals.Add(-1)
			return // a flood of PROBE frames gets no more answers than this
		}
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			m.probeRefusals.Add(-1)
			return
		}
		m.wg.Add(1)
		m.mu.Unlock()
		go func() {
			defer m.wg.Done()
			defer m.probeRefusals.Add(-1)
			pc, err := m.openProbeReply(v.Endpoint)
			if err == nil {
				_ = pc.send(res.Encode())
				pc.close()
			}
		}()
		return
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		m.probing.Store(false)
		return
	}
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		// The rank takes the next probe once this one's result is decided:
		// released before the result goes out, so a doctor that probes
		// again as soon as it reads it is not refused ("another probe is
		// running"), and only once (a later probe's flag is not cleared).
		released := false
		release := func() {
			if !released {
				released = true
				m.probing.Store(false)
			}
		}
		defer release()
		pc, err := m.openProbeReply(v.Endpoint)
		if err != nil {
			m.log.Warn("probe not answered: no control socket to the prober", "prober", peerLabel(v.Endpoint), "probe", v.ID, "err", err)
			return
		}
		defer pc.close()
		passed := true
		for _, o := range v.Transports {
			r := m.probeOne(v, o, pc)
			if r.Err != "" && !r.NotApplicable {
				passed = false
			}
			res.Results = append(res.Results, r.wire())
		}
		result := "passed"
		if !passed {
			result = "failed"
		}
		m.met.probes.WithLabelValues(result).Inc()
		m.log.Info("probe answered", "prober", peerLabel(v.Endpoint), "probe", v.ID, "result", result)
		release()
		if err := pc.send(res.Encode()); err != nil {
			m.log.Warn("probe result not sent", "prober", peerLabel(v.Endpoint), "err", err)
		}
	}()
}

// maxProbeRefusals bounds the refusals being sent at once (each has its own
// short-lived socket).
const maxProbeRefusals = 4

// probeReplyLinger is how long a closed probe reply socket keeps trying to
// deliver what was queued on it (the PROBE_RESULT sent just before close).
const probeReplyLinger = 2 * time.Second

// probeReply is the control socket a rank answers one doctor probe on. It
// is not one of the manager's peer sockets: a prober is no peer rank, so it
// is not in MaxPeers, the kvxfer_peers gauge or the disconnect monitor (a
// doctor that exits after its probe is not a lost peer), and it is closed
// when the probe ends. Used by one goroutine.
type probeReply struct {
	m        *Manager
	endpoint string
	sock     *zmq.Socket
}

// openProbeReply connects a probe reply socket to the prober's endpoint.
func (m *Manager) openProbeReply(endpoint string) (*probeReply, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed || m.zctx == nil {
		return nil, ErrManagerClosed
	}
	s, err := m.zctx.NewSocket(zmq.PUSH)
	if err != nil {
		return nil, fmt.Errorf("zmq PUSH socket: %w", err)
	}
	_ = s.SetLinger(probeReplyLinger)
	_ = s.SetSndtimeo(controlSendTimeout)
	_ = s.SetImmediate(false)
	if err := s.SetIpv6(true); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("zmq PUSH socket: enable IPv6: %w", err)
	}
	if err := s.Connect(endpoint); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("connect to the prober at %s: %w", peerLabel(endpoint), err)
	}
	return &probeReply{m: m, endpoint: endpoint, sock: s}, nil
}

// send seals and sends frames to the prober (ControlFault applies as to
// every control message).
func (p *probeReply) send(frames [][]byte) error {
	m := p.m
	if f := m.cfg.ControlFault; f != nil && len(frames) > 2 && f(p.endpoint, string(frames[2])) {
		return nil
	}
	frames = control.SealControl(frames, m.instanceID, m.epoch, m.ctlSeq.Add(1), time.Now(), m.ctlKey)
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	if _, err := p.sock.SendMessage(parts...); err != nil {
		return fmt.Errorf("send to the prober at %s: %w (prober gone?)", peerLabel(p.endpoint), err)
	}
	return nil
}

// close closes the socket; what was sent is delivered within
// probeReplyLinger.
func (p *probeReply) close() { _ = p.sock.Close() }

// probeOne runs one transport of a probe: open a segment to the prober's
// scratch region (handshake), write the pattern from a probe buffer
// (transfer).
func (m *Manager) probeOne(v *control.ProbeMsg, o control.ProbeOffer, pc *probeReply) ProbeTransportResult {
	r := ProbeTransportResult{Transport: o.Name}
	var rs *regSet
	for _, x := range m.regs {
		if x.t.Name() == o.Name {
			rs = x
		}
	}
	if rs == nil {
		r.Stage, r.NotApplicable = "handshake", true
		r.Err = fmt.Sprintf("this rank has no %s transport (it has %s)", o.Name, strings.Join(m.TransportNames(), ","))
		return r
	}
	fail := func(stage string, err error) ProbeTransportResult {
		r.Stage, r.Err = stage, err.Error()
		r.NotApplicable = errors.Is(err, transport.ErrUnavailable)
		return r
	}
	buf, err := transport.AllocHost("kvxfer-probe", int64(v.Length))
	if err != nil {
		return fail("handshake", fmt.Errorf("allocate the probe buffer: %w", err))
	}
	defer buf.Close()
	ProbePattern(v.ID, o.Name, buf.Bytes())
	d, err := rs.t.RegisterMemory(buf.Memory())
	if err != nil {
		return fail("handshake", fmt.Errorf("register the probe buffer: %w", err))
	}
	defer func() { _ = rs.t.DeregisterMemory(d.ID) }()
	ctx, cancel := context.WithTimeout(m.life, probeStepTimeout)
	defer cancel()
	t0 := time.Now()
	seg, err := rs.t.OpenSegment(ctx, transport.SegmentInfo{Endpoint: o.Endpoint, Regions: []transport.RegionDesc{o.Region}, Epoch: v.ID})
	if err != nil {
		return fail("handshake", fmt.Errorf("open a %s segment to %s: %w", o.Name, peerLabel(v.Endpoint), err))
	}
	defer seg.Close()
	if rs.caps.Has(transport.CapHandshake) {
		k := probeKey{v.Endpoint, v.ID, o.Name}
		ch := make(chan error, 1)
		m.mu.Lock()
		m.probeAcks[k] = ch
		m.mu.Unlock()
		defer func() {
			m.mu.Lock()
			delete(m.probeAcks, k)
			m.mu.Unlock()
		}()
		if err := pc.send((&control.HandshakeMsg{Endpoint: m.endpoint, Transport: o.Name, Reply: seg.HandshakeReply(), Epoch: v.ID}).Encode()); err != nil {
			return fail("handshake", err)
		}
		select {
		case err := <-ch:
			if err != nil {
				return fail("handshake", err)
			}
		case <-ctx.Done():
			return fail("handshake", fmt.Errorf("%w: no HANDSHAKE_ACK from the prober within %s", ErrTimeout, probeStepTimeout))
		}
	}
	r.Handshake = time.Since(t0)
	t1 := time.Now()
	b := &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: buf.Addr(), Remote: o.Region.ID, Length: v.Length}}}
	id, err := seg.Submit(ctx, b)
	if err != nil {
		return fail("transfer", fmt.Errorf("submit %d bytes: %w", v.Length, err))
	}
	defer seg.Release(id)
	// Not counted in the transfer metrics (bytes, write requests, batches):
	// a probe is no room, and kvxfer_probes_total counts it.
	st, err := seg.Wait(ctx, id)
	switch {
	case err != nil:
		_ = seg.Cancel(id)
		return fail("transfer", fmt.Errorf("write %d bytes: %w", v.Length, err))
	case st.State != transport.BatchCompleted:
		return fail("transfer", fmt.Errorf("write %d bytes: batch %s after %d bytes: %v", v.Length, st.State, st.BytesDone, st.Err))
	}
	r.Transfer = time.Since(t1)
	return r
}

// probeHandshakeAck hands a HANDSHAKE_ACK to the probe waiting for it;
// false when none waits (a decode's, handled by handleHandshakeAck).
func (m *Manager) probeHandshakeAck(v *control.HandshakeAckMsg) bool {
	m.mu.Lock()
	ch := m.probeAcks[probeKey{v.Endpoint, v.Epoch, v.Transport}]
	m.mu.Unlock()
	if ch == nil {
		return false
	}
	var err error
	if v.Err != "" {
		err = fmt.Errorf("the prober refused the %s handshake: %s", v.Transport, v.Err)
	}
	select {
	case ch <- err:
	default:
	}
	return true
}

// ProberConfig configures a Prober.
type ProberConfig struct {
	// Transports are the prober's opened transports (at least one); each
	// gets a scratch region that probes write into. The prober does not
	// close them.
	Transports []transport.Transport
	// Length is the bytes each probe writes per transport
	// (DefaultProbeBytes when 0; at most MaxProbeBytes).
	Length int
	// ControlHost is the address the prober's control socket binds and
	// the ranks send their results to: an address of this host the ranks
	// can reach (default 127.0.0.1).
	ControlHost string
	// Timeout bounds one probe, from PROBE to PROBE_RESULT (default 30 s).
	Timeout time.Duration
	// AuthToken is the deployment's shared token, needed when the ranks
	// authenticate control frames (ManagerConfig.AuthenticateControl):
	// the prober's frames are then tagged with ControlKey(AuthToken) and
	// the ranks' answers checked. Empty sends untagged frames.
	AuthToken string
}

// Prober runs doctor probes against prefill ranks. Not safe for concurrent
// Probe calls; Close releases it.
type Prober struct {
	cfg      ProberConfig
	zctx     *zmq.Context
	pull     *zmq.Socket
	endpoint string
	scratch  []*transport.HostBuffer
	regions  []transport.RegionDesc
	instance string        // the prober's instance id (envelope)
	seq      atomic.Uint64 // the prober's frame numbers (envelope)
	key      []byte        // ControlKey(AuthToken), or nil
	mu       sync.Mutex
	closed   bool
}

// NewProber allocates and registers the scratch regions and binds the
// control socket. Errors name the failing step.
func NewProber(cfg ProberConfig) (*Prober, error) {
	if len(cfg.Transports) == 0 {
		return nil, errors.New("engine: prober: at least one transport is required")
	}
	if cfg.Length <= 0 {
		cfg.Length = DefaultProbeBytes
	}
	if cfg.Length > control.MaxProbeBytes {
		return nil, fmt.Errorf("engine: prober: length %d bytes, at most %d", cfg.Length, control.MaxProbeBytes)
	}
	if cfg.ControlHost == "" {
		cfg.ControlHost = "127.0.0.1"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	inst, err := newInstanceID()
	if err != nil {
		return nil, err
	}
	p := &Prober{cfg: cfg, instance: inst, key: control.ControlKey(cfg.AuthToken)}
	ok := false
	defer func() {
		if !ok {
			p.Close()
		}
	}()
	for _, t := range cfg.Transports {
		b, err := transport.AllocHost("kvxfer-probe-scratch", int64(cfg.Length))
		if err != nil {
			return nil, fmt.Errorf("engine: prober: scratch region: %w", err)
		}
		p.scratch = append(p.scratch, b)
		d, err := t.RegisterMemory(b.Memory())
		if err != nil {
			return nil, fmt.Errorf("engine: prober: register the scratch region with %s: %w", t.Name(), err)
		}
		p.regions = append(p.regions, d)
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("engine: prober: zmq context: %w", err)
	}
	p.zctx = zctx
	if p.pull, err = zctx.NewSocket(zmq.PULL); err != nil {
		return nil, fmt.Errorf("engine: prober: zmq PULL socket: %w", err)
	}
	_ = p.pull.SetLinger(0)
	_ = p.pull.SetRcvtimeo(100 * time.Millisecond)
	if err := limitControlSocket(p.pull, "prober PULL"); err != nil {
		return nil, err
	}
	if err := p.pull.SetIpv6(true); err != nil {
		return nil, fmt.Errorf("engine: prober: enable IPv6: %w", err)
	}
	host := strings.Trim(cfg.ControlHost, "[]")
	if err := p.pull.Bind("tcp://" + bracket(host) + ":*"); err != nil {
		return nil, fmt.Errorf("engine: prober: bind control socket on %s: %w (is it an address of this host?)", host, err)
	}
	ep, err := p.pull.GetLastEndpoint()
	if err != nil {
		return nil, fmt.Errorf("engine: prober: control socket endpoint: %w", err)
	}
	_, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		return nil, fmt.Errorf("engine: prober: control socket endpoint %q: %w", ep, err)
	}
	p.endpoint = "tcp://" + net.JoinHostPort(host, port)
	ok = true
	return p, nil
}

// Endpoint is the prober's control endpoint "tcp://host:port".
func (p *Prober) Endpoint() string { return p.endpoint }

// ProbeReport is one rank's answer to a probe.
type ProbeReport struct {
	// Endpoint is the rank's control endpoint, Rank its role and
	// coordinates and Transports its transports, as it reported them.
	Endpoint   string   `json:"endpoint"`
	Rank       string   `json:"rank"`
	Transports []string `json:"rank_transports"`
	// Refused says why the rank refused the probe ("" when it ran).
	Refused string `json:"refused,omitempty"`
	// RoundTrip is PROBE sent → PROBE_RESULT received.
	RoundTrip time.Duration `json:"round_trip_ns"`
	// Results has one entry per prober transport, in the prober's order.
	Results []ProbeTransportResult `json:"results"`
}

// Probe sends PROBE to the rank at endpoint ("tcp://host:port" or
// "host:port") and waits for its PROBE_RESULT, answering the rank's
// HANDSHAKE for transports that need one, then checks each scratch region.
// Errors: the rank did not answer within the timeout (it cannot reach this
// host, drops unknown messages, or hangs), ctx ended, or the prober is
// closed.
func (p *Prober) Probe(ctx context.Context, endpoint string) (*ProbeReport, error) {
	if !strings.HasPrefix(endpoint, "tcp://") {
		endpoint = "tcp://" + endpoint
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, transport.ErrClosed
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	id := transport.NewEpoch()
	msg := &control.ProbeMsg{Endpoint: p.endpoint, ID: id, Length: uint64(p.cfg.Length)}
	for i, t := range p.cfg.Transports {
		clear(p.scratch[i].Bytes()) // stale bytes never pass verification
		blob, err := t.Endpoint(ctx, endpoint)
		if err != nil {
			return nil, fmt.Errorf("engine: probe %s: prepare the %s endpoint: %w", peerLabel(endpoint), t.Name(), err)
		}
		if f, ok := t.(interface {
			AdmitEpoch(peer string, epoch uint64) error
		}); ok { // a fencing transport refuses writes of an epoch it never admitted
			if err := f.AdmitEpoch(endpoint, id); err != nil {
				return nil, fmt.Errorf("engine: probe %s: admit the probe's epoch on %s: %w", peerLabel(endpoint), t.Name(), err)
			}
		}
		msg.Transports = append(msg.Transports, control.ProbeOffer{Name: t.Name(), Endpoint: blob, Region: p.regions[i]})
	}
	push, err := p.zctx.NewSocket(zmq.PUSH)
	if err != nil {
		return nil, fmt.Errorf("engine: probe: zmq PUSH socket: %w", err)
	}
	defer push.Close()
	_ = push.SetLinger(0)
	_ = push.SetSndtimeo(controlSendTimeout)
	_ = push.SetIpv6(true)
	if err := push.Connect(endpoint); err != nil {
		return nil, fmt.Errorf("engine: probe: connect to %s: %w", endpoint, err)
	}
	send := func(frames [][]byte) error {
		frames = control.SealControl(frames, p.instance, 0, p.seq.Add(1), time.Now(), p.key)
		parts := make([]any, len(frames))
		for i, f := range frames {
			parts[i] = f
		}
		_, err := push.SendMessage(parts...)
		return err
	}
	start := time.Now()
	if err := send(msg.Encode()); err != nil {
		return nil, fmt.Errorf("engine: probe: send PROBE to %s: %w", endpoint, err)
	}
	for {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: rank %s did not answer the probe within %s: it accepted the control connection, but no PROBE_RESULT came back to %s "+
				"(the rank cannot reach this host there, e.g. a firewall toward the doctor; or it is an older kvxfer that drops PROBE; or it hangs)",
				ErrTimeout, peerLabel(endpoint), time.Since(start).Round(time.Millisecond), p.endpoint)
		}
		parts, err := recvControl(p.pull, 0)
		if err != nil {
			continue // receive timeout (check ctx), or an oversize frame
		}
		body, _, err := control.OpenControl(parts, p.key, time.Now())
		if err != nil {
			continue
		}
		m, err := control.DecodeControl(body)
		if err != nil {
			continue
		}
		switch v := m.(type) {
		case *control.HandshakeMsg:
			if v.Epoch == id {
				ack := &control.HandshakeAckMsg{Endpoint: p.endpoint, Transport: v.Transport, Epoch: v.Epoch}
				if err := p.accept(ctx, v); err != nil {
					ack.Err = err.Error()
				}
				_ = send(ack.Encode())
			}
		case *control.ProbeResultMsg:
			if v.ID != id {
				continue
			}
			rep := &ProbeReport{Endpoint: v.Endpoint, Rank: v.Rank, Transports: v.Transports, Refused: v.Refused, RoundTrip: time.Since(start), Results: fromWire(v.Results)}
			p.verify(id, rep)
			return rep, nil
		}
	}
}

// accept completes a transport handshake the rank started for a probe.
func (p *Prober) accept(ctx context.Context, v *control.HandshakeMsg) error {
	for _, t := range p.cfg.Transports {
		if t.Name() != v.Transport {
			continue
		}
		acc, ok := t.(transport.Acceptor)
		if !ok {
			return fmt.Errorf("prober transport %s accepts no handshake", v.Transport)
		}
		return acc.Accept(ctx, v.Endpoint, v.Reply)
	}
	return fmt.Errorf("prober has no transport %q", v.Transport)
}

// verify checks the scratch region of every transport the rank reports as
// written, and adds the results it lacks for offered transports.
func (p *Prober) verify(id uint64, rep *ProbeReport) {
	want := make([]byte, p.cfg.Length)
	for i := range rep.Results {
		r := &rep.Results[i]
		if r.Err != "" || rep.Refused != "" {
			continue
		}
		k := -1
		for j, t := range p.cfg.Transports {
			if t.Name() == r.Transport {
				k = j
			}
		}
		if k < 0 {
			r.VerifyErr = "the rank reports a transport this prober did not offer"
			continue
		}
		ProbePattern(id, r.Transport, want)
		got := p.scratch[k].Bytes()
		if off := firstDiff(got, want); off >= 0 {
			r.VerifyErr = fmt.Sprintf("the scratch region differs from the probe pattern at byte %d of %d (got %#02x, want %#02x): the write reported success but the bytes did not land intact",
				off, len(want), got[off], want[off])
			continue
		}
		r.Verified = true
	}
}

func firstDiff(a, b []byte) int {
	for i := range b {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// Close releases the control socket and the scratch regions (deregistered
// from the transports). Idempotent.
func (p *Prober) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	if p.pull != nil {
		_ = p.pull.Close()
	}
	if p.zctx != nil {
		_ = p.zctx.Term()
	}
	for i, d := range p.regions {
		_ = p.cfg.Transports[i].DeregisterMemory(d.ID)
	}
	for _, b := range p.scratch {
		_ = b.Close()
	}
	return nil
}
