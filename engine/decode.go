package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// decodeSide is what only a decode rank holds: the metadata ring, the
// prefill ranks it registered with and its cache of their bootstrap
// directories, the rooms' Receivers and the verdicts of finished rooms, and
// the data-path fences it runs. Its maps are guarded by Manager.mu; on a
// prefill rank it stays empty. The decode's control plane (directory
// lookups, REGISTER and its ACK, HANDSHAKE, a producer's STATUS) is in this
// file; the Receiver itself in receiver.go, fencing in fence.go and heal.go,
// bootstrap heartbeats in heartbeat.go.
type decodeSide struct {
	ring *MetaRing

	receivers map[uint64]*Receiver
	verdicts  map[uint64]verdict // outcomes of finished rooms
	// verdictOrder: rooms of verdicts in the order first decided (expiry)
	verdictOrder []uint64
	fenceOps     map[epochKey]chan struct{} // data-path fences running or done
	ppeers       map[string]*prefillPeer    // prefill ranks registered with
	bcache       map[string]*instanceInfo   // bootstrap info per address

	// flights coalesces identical directory lookups in flight (topology per
	// address, endpoint per rank).
	flights singleflight.Group
	// lookupErrs holds the latest failed attempt of each lookup in flight
	// (key → error), for the caller that times out first (Manager.lookup).
	lookupErrs sync.Map
	hbWG       sync.WaitGroup // bootstrap heartbeats (heartbeat.go)
	// attempts numbers the Receivers (control.TransferMsg.Attempt): the
	// last number handed out, from a random start (a restarted decode at
	// the same address does not reuse its predecessor's numbers).
	attempts *atomic.Uint64
	// unacked: the Success verdicts sent that their producer has not
	// acknowledged yet (verdictack.go); unackedOrder: their keys in the
	// order first sent (expiry; a key acknowledged meanwhile is skipped).
	unacked      map[verdictKey]*unackedVerdict
	unackedOrder []verdictKey
}

func newDecodeSide() decodeSide {
	attempts := new(atomic.Uint64)
	attempts.Store(uint64(rand.Uint32()) << 24)
	return decodeSide{
		receivers: map[uint64]*Receiver{},
		verdicts:  map[uint64]verdict{},
		fenceOps:  map[epochKey]chan struct{}{},
		ppeers:    map[string]*prefillPeer{},
		bcache:    map[string]*instanceInfo{},
		attempts:  attempts,
		unacked:   map[verdictKey]*unackedVerdict{},
	}
}

// nextAttempt returns the attempt number of a new Receiver (>= 1, larger
// than every earlier one of this manager).
func (d *decodeSide) nextAttempt() uint64 { return d.attempts.Add(1) }

// instanceInfo is the decode's cache of one bootstrap address: the prefill
// topology and the control endpoints of the ranks looked up so far (SGLang's
// prefill_info_table + connection_pool, spec §4.2–4.4). It is dropped when a
// peer it names is lost, or when its bootstrap server fails the heartbeat
// (heartbeat.go).
type instanceInfo struct {
	m      *Manager
	addr   string
	client *bootstrap.Client
	info   *bootstrap.PrefillServerInfo
	mu     sync.Mutex
	ranks  map[bootstrap.Coord]string
	// insts maps a rank endpoint to the instance id and epoch its
	// directory entry named (absent or zero: none).
	insts map[string]control.PeerID
}

// instanceOf returns the identity the directory named for the rank at
// endpoint ep (zero when none).
func (i *instanceInfo) instanceOf(ep string) control.PeerID {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.insts[ep]
}

func (i *instanceInfo) names(ep string) bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	for _, e := range i.ranks {
		if e == ep {
			return true
		}
	}
	return false
}

// prefillPeer is a prefill rank this decode registered with (REGISTER sent
// once per epoch, answered by REGISTER_ACK with the prefill's geometry).
// epoch names the data path of that registration.
type prefillPeer struct {
	done  chan struct{}
	err   error
	epoch uint64
	geo   *kvargs.Geometry // the prefill's, from REGISTER_ACK
	ack   chan ackResult
	// id is the prefill's identity: the one the directory named when the
	// registration started (zero when it named none), then the one that
	// answered REGISTER_ACK. Frames from another rank at this address are
	// a replaced process (trust.go).
	id control.PeerID
}

// ackResult is a REGISTER_ACK, or why none will come (the peer was lost).
type ackResult struct {
	msg *control.RegisterAckMsg
	err error
}

// notDirectoryTries is how many answers in a row that no bootstrap
// directory gives (notDirectory) a topology lookup takes before it fails
// the room: a few, not the whole bootstrap timeout, as the address is some
// other HTTP server.
const notDirectoryTries = 3

// notDirectory reports whether err is an answer that no bootstrap
// directory gives to GET /route's topology query: 404/405 (the route is
// missing) or 2xx content that is no PrefillServerInfo.
func notDirectory(err error) bool {
	return errors.Is(err, bootstrap.ErrUnsupported) || errors.Is(err, bootstrap.ErrNotDirectory)
}

// permanentError is an attempt's error that retry returns at once.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// retry calls f until it succeeds, fails with a non-retryable error, or ctx
// ends (then the last error is returned, wrapped in ErrTimeout).
func retry(ctx context.Context, what string, f func(context.Context) error) error {
	return retryNoted(ctx, what, f, nil)
}

// retryNoted is retry that hands every failed attempt (0-based) and its
// error to note, when note is not nil, before it waits for the next one.
func retryNoted(ctx context.Context, what string, f func(context.Context) error, note func(attempt int, err error)) error {
	var last error
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(actx)
		cancel()
		if err == nil {
			return nil
		}
		last = err
		if note != nil {
			note(attempt, err)
		}
		if errors.Is(err, bootstrap.ErrMismatch) || errors.Is(err, bootstrap.ErrBadRequest) || errors.Is(err, bootstrap.ErrUnauthorized) {
			return err
		}
		var perm *permanentError
		if errors.As(err, &perm) {
			return perm.err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %s: gave up after %d attempts; last error: %v", ErrTimeout, what, attempt+1, last)
		case <-time.After(min(200*time.Millisecond*time.Duration(attempt+1), time.Second)):
		}
	}
}

// instance returns the cached bootstrap info of addr, fetching the topology
// on a miss. Concurrent misses for one address share one fetch (one
// GET /route topology query however many rooms arrive at once, issue 13);
// the fetch runs under the manager's lifetime bounded by BootstrapTimeout,
// not under the first caller's ctx, so a room that gives up early does not
// fail the others. Each caller waits at most until its own ctx ends.
func (m *Manager) instance(ctx context.Context, addr string) (*instanceInfo, error) {
	m.mu.Lock()
	inst := m.dec.bcache[addr]
	m.mu.Unlock()
	if inst != nil {
		return inst, nil
	}
	v, err := m.lookup(ctx, "topology http://"+addr, func(fctx context.Context, note func(int, error)) (any, error) {
		m.mu.Lock()
		cur := m.dec.bcache[addr]
		m.mu.Unlock()
		if cur != nil {
			return cur, nil
		}
		c, err := bootstrap.NewClient(addr, bootstrap.WithAuthToken(m.cfg.BootstrapAuthToken))
		if err != nil {
			return nil, err
		}
		var info *bootstrap.PrefillServerInfo
		notDir := 0 // answers in a row that no bootstrap directory gives
		err = retryNoted(fctx, "fetch prefill parallel info from http://"+addr, func(ctx context.Context) error {
			var err error
			info, err = c.ServerInfo(ctx)
			if !notDirectory(err) {
				notDir = 0 // 503 (topology not complete), refused, timeouts: retried until the bootstrap timeout
				return err
			}
			if notDir++; notDir < notDirectoryTries {
				return err
			}
			return &permanentError{fmt.Errorf("http://%s is not a bootstrap directory: it answered the topology query (GET /route) %d times in a row with what no directory answers: %w; "+
				"the request's bootstrap address must be the prefill's bootstrap server (--disaggregation-bootstrap-port, default %d), not another HTTP service",
				addr, notDir, err, bootstrap.DefaultPort)}
		}, note)
		if err != nil {
			return nil, err
		}
		inst := &instanceInfo{addr: addr, client: c, info: info, ranks: map[bootstrap.Coord]string{}, insts: map[string]control.PeerID{}, m: m}
		m.mu.Lock()
		defer m.mu.Unlock()
		if cur := m.dec.bcache[addr]; cur != nil {
			return cur, nil
		}
		if m.closed {
			return nil, ErrManagerClosed
		}
		m.dec.bcache[addr] = inst
		m.startHeartbeatLocked(inst)
		return inst, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*instanceInfo), nil
}

// lookup runs fetch once for all concurrent callers with the same key
// (singleflight) under a context that ends with the manager or after
// BootstrapTimeout; each caller returns when the shared fetch ends or its
// own ctx does.
//
// While the fetch retries, note records its latest failure for the key and
// logs a warning on the first failed attempt and every tenth after it, so a
// mistyped or dead bootstrap address is visible at once, not only when the
// caller's timeout ends; a caller that times out first reports that last
// failure (e.g. "connection refused") instead of a bare deadline.
func (m *Manager) lookup(ctx context.Context, key string, fetch func(ctx context.Context, note func(attempt int, err error)) (any, error)) (any, error) {
	note := func(attempt int, err error) {
		m.dec.lookupErrs.Store(key, err)
		if attempt%10 == 0 {
			m.log.Warn("bootstrap lookup failed; retrying until the bootstrap timeout", "lookup", key, "attempt", attempt+1,
				"timeout", m.cfg.BootstrapTimeout, "err", err)
		}
	}
	ch := m.dec.flights.DoChan(key, func() (any, error) {
		fctx, cancel := context.WithTimeout(m.life, m.cfg.BootstrapTimeout)
		defer cancel()
		v, err := fetch(fctx, note)
		if err == nil {
			// A failed lookup keeps its last error (one entry per address
			// or rank that failed) for callers still timing out.
			m.dec.lookupErrs.Delete(key)
		}
		return v, err
	})
	select {
	case r := <-ch:
		return r.Val, r.Err
	case <-ctx.Done():
		select {
		case r := <-ch: // the shared fetch ended at the same moment
			if r.Err != nil {
				return nil, r.Err
			}
			return r.Val, nil
		default:
		}
		if last, ok := m.dec.lookupErrs.Load(key); ok {
			return nil, fmt.Errorf("%w: %s: %w; last error: %v", ErrTimeout, key, context.Cause(ctx), last)
		}
		// No attempt ended: the address accepted the connection (or the
		// dial hangs) and never answered HTTP.
		return nil, fmt.Errorf("%w: %s: %w: no answer to its first request yet: check that the address is the prefill's bootstrap server's HTTP port (--disaggregation-bootstrap-port, default %d), not a rank's control or metrics port, and that the server is not stopped",
			ErrTimeout, key, context.Cause(ctx), bootstrap.DefaultPort)
	}
}

// rank returns the control endpoint of the prefill rank at c, asking the
// directory on a miss; concurrent misses for the same rank share one
// GET /route (see Manager.lookup).
func (i *instanceInfo) rank(ctx context.Context, c bootstrap.Coord) (string, error) {
	i.mu.Lock()
	ep, ok := i.ranks[c]
	i.mu.Unlock()
	if ok {
		return ep, nil
	}
	v, err := i.m.lookup(ctx, "rank "+c.String()+" at http://"+i.addr, func(fctx context.Context, note func(int, error)) (any, error) {
		i.mu.Lock()
		ep, ok := i.ranks[c]
		i.mu.Unlock()
		if ok {
			return ep, nil
		}
		var ri *bootstrap.PrefillRankInfo
		err := retryNoted(fctx, "fetch bootstrap info for "+c.String()+" from http://"+i.addr, func(ctx context.Context) error {
			var err error
			ri, err = i.client.RankInfo(ctx, c.DP, c.CP, c.TP, c.PP)
			return err
		}, note)
		if err != nil {
			return nil, err
		}
		ep = ri.Endpoint()
		i.mu.Lock()
		i.ranks[c] = ep
		i.insts[ep] = control.NewPeerID(ri.InstanceID, ri.Epoch)
		i.mu.Unlock()
		return ep, nil
	})
	if err != nil {
		return "", err
	}
	return v.(string), nil
}

// ensureRegistered sends REGISTER (our geometry and, per transport, endpoint
// and regions) to a prefill rank once per epoch and waits for its
// REGISTER_ACK; it returns the epoch and the prefill's geometry, or its
// refusal.
func (m *Manager) ensureRegistered(ctx context.Context, ep string, id control.PeerID) (uint64, *kvargs.Geometry, error) {
	m.mu.Lock()
	p := m.dec.ppeers[ep]
	if p != nil && id.Known() && p.id.Known() && !p.id.Is(id) {
		// The directory now names another process at this address than
		// the one registered here: that one is gone.
		was := p.id
		m.mu.Unlock()
		m.peerLost(ep, false, fmt.Errorf("%w: the directory now names instance %s at prefill %s, this decode registered with instance %s there (the rank restarted or was replaced)", transport.ErrPeerLost, id, ep, was))
		m.mu.Lock()
		p = m.dec.ppeers[ep]
	}
	owner := p == nil
	if owner {
		p = &prefillPeer{done: make(chan struct{}), epoch: transport.NewEpoch(), ack: make(chan ackResult, 1), id: id}
		m.dec.ppeers[ep] = p
	}
	m.mu.Unlock()
	if owner {
		m.watchPeer(ep)
	}
	if !owner {
		select {
		case <-p.done:
			return p.epoch, p.geo, p.err
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		}
	}
	regAt := time.Now()
	p.err = m.register(ctx, ep, p.epoch)
	if p.err == nil {
		// Watch the peer while waiting: a silent or dead prefill is lost
		// after PeerTimeout (or at once on disconnect) and ends the wait.
		m.mu.Lock()
		if _, ok := m.lastSeen[ep]; !ok {
			m.lastSeen[ep] = time.Now()
		}
		m.mu.Unlock()
		select {
		case a := <-p.ack:
			switch {
			case a.err != nil:
				p.err = a.err
			case a.msg.Err != "":
				p.err = fmt.Errorf("engine: prefill %s refused this decode's registration: %s", ep, a.msg.Err)
			default:
				p.geo = &a.msg.Geometry
			}
		case <-ctx.Done():
			hint := "a prefill that authenticates control frames drops untagged ones: give every rank the same token and AuthenticateControl (--control-auth)"
			if unreachable, connected, dialErr := m.pushState(ep); unreachable && !connected {
				// Nothing ever answered at that address: no token explains
				// that; a prefill that exited (its directory entry stays
				// until it goes stale) or a wrong address does.
				why := ""
				if dialErr != "" && dialErr != "probing" {
					why = " (" + dialErr + ")"
				}
				hint = "no connection to its control socket succeeded" + why + ": the process is not running or not listening there (a prefill that exited stays in the directory, reported stale, until it is replaced); check `kvxfer bootstrap table` and that address"
			} else if m.ctlKey != nil {
				hint = "this rank tags its control frames: the prefill drops them unless it has the same token"
				if d := m.unauth.Since(ep, regAt); d != "" {
					// The prefill answered, untagged or with another
					// token: the claim is unverified, so it only
					// explains the timeout.
					hint = d + "; the prefill does not authenticate control frames with this rank's token: give every rank the same token and control authentication (--control-auth, kvx_kv_config.control_auth)"
				}
			}
			p.err = fmt.Errorf("%w: prefill %s did not answer REGISTER (no REGISTER_ACK): %v (%s)", ErrTimeout, ep, ctx.Err(), hint)
		}
	}
	if p.err != nil {
		m.mu.Lock()
		if m.dec.ppeers[ep] == p {
			delete(m.dec.ppeers, ep)
		}
		m.mu.Unlock()
		m.goTracked(func() { _ = m.fenceTransports(ep, p.epoch) }) // withdraw the admission
	} else {
		m.mu.Lock()
		m.lastSeen[ep] = time.Now()
		m.mu.Unlock()
	}
	close(p.done)
	return p.epoch, p.geo, p.err
}

// handleRegisterAck hands a prefill's REGISTER_ACK to the registration
// waiting for it (dropped when none waits, or for another epoch).
func (m *Manager) handleRegisterAck(v *control.RegisterAckMsg, env control.Envelope) {
	m.mu.Lock()
	p := m.dec.ppeers[v.Endpoint]
	sameID := p != nil && (!p.id.Known() || p.id.Is(control.SenderID(env)))
	if p != nil && p.ack != nil && p.epoch == v.Epoch && sameID {
		p.id = control.SenderID(env) // the answering process is the peer (the directory may have named none, or no epoch)
	}
	m.mu.Unlock()
	if p != nil && p.epoch == v.Epoch && sameID && strings.HasPrefix(v.Err, EvictedPrefix) {
		select {
		case <-p.done:
			// The prefill dropped this (idle) registration at its peer
			// cap: the next room registers again.
			m.mu.Lock()
			if m.dec.ppeers[v.Endpoint] == p {
				delete(m.dec.ppeers, v.Endpoint)
			}
			m.mu.Unlock()
			m.log.Info("prefill evicted this decode's idle registration", "prefill", v.Endpoint, "epoch", v.Epoch)
			// A room still on this registration had nothing written
			// (evictmove.go): it registers again and goes on; the fence
			// below fails only what cannot (and makes a room resolving
			// now register again).
			m.mu.Lock()
			rs := make([]*Receiver, 0, len(m.dec.receivers))
			for _, r := range m.dec.receivers {
				rs = append(rs, r)
			}
			m.mu.Unlock()
			var moving []*Receiver
			for _, r := range rs {
				if r.beginMove(v.Endpoint, v.Epoch) {
					moving = append(moving, r)
				}
			}
			m.fenceEpoch(v.Endpoint, v.Epoch, fmt.Sprintf("prefill %s dropped this decode's registration (epoch %d) before it held the room's TRANSFER, so nothing was written for the room: %s", v.Endpoint, v.Epoch, v.Err), true)
			id := p.id
			for _, r := range moving {
				m.goTracked(func() { r.moveEvicted(v.Endpoint, v.Epoch, id, v.Err) })
			}
			return
		default:
		}
	}
	if p == nil || p.ack == nil || p.epoch != v.Epoch {
		m.log.Debug("REGISTER_ACK without a registration in progress for its epoch", "from", v.Endpoint, "epoch", v.Epoch)
		return
	}
	select {
	case p.ack <- ackResult{msg: v}:
	default:
	}
}

// register sends REGISTER for epoch: per transport its endpoint for the
// prefill (an rdma transport creates the QPs here) and, for a transport that
// fences, the epoch admitted right after, so that its data path exists only
// for this registration.
func (m *Manager) register(ctx context.Context, ep string, epoch uint64) error {
	msg := &control.RegisterMsg{Endpoint: m.endpoint, Geometry: *m.geo, RingSlots: m.dec.ring.Slots(), Epoch: epoch}
	for _, r := range m.regs {
		blob, err := r.t.Endpoint(ctx, ep)
		if err == nil {
			err = m.admitEpoch(r.t, ep, epoch)
		}
		if err != nil {
			m.log.Warn("transport cannot prepare an endpoint", "transport", r.t.Name(), "prefill", ep, "err", err)
			continue
		}
		msg.Transports = append(msg.Transports, control.TransportOffer{Name: r.t.Name(), Endpoint: blob, Ring: r.meta, KV: r.kv, Aux: r.aux, State: r.state})
	}
	if len(msg.Transports) == 0 {
		return fmt.Errorf("engine: no transport could prepare an endpoint for prefill %s", ep)
	}
	return m.send(ep, msg.Encode(), false)
}

func (m *Manager) handleHandshake(v *control.HandshakeMsg) {
	if m.currentEpoch(v.Endpoint) == 0 {
		// Not a prefill rank this decode registered with: no answer, so
		// that frames naming endpoints at random open no sockets.
		m.drop("sender", fmt.Errorf("HANDSHAKE from %s, a prefill rank this decode has no registration with", v.Endpoint))
		return
	}
	var errText string
	var acc transport.Acceptor
	for _, r := range m.regs {
		if r.t.Name() == v.Transport {
			acc, _ = r.t.(transport.Acceptor)
		}
	}
	if acc == nil {
		errText = fmt.Sprintf("decode has no transport %q that accepts handshakes", v.Transport)
	} else if cur := m.currentEpoch(v.Endpoint); cur != v.Epoch {
		errText = fmt.Sprintf("handshake for epoch %d, but this decode's registration with %s is epoch %d (stale segment; it registers again)", v.Epoch, v.Endpoint, cur)
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := acc.Accept(ctx, v.Endpoint, v.Reply); err != nil {
			errText = err.Error()
		}
		cancel()
	}
	if errText != "" {
		m.log.Warn("handshake failed", "prefill", v.Endpoint, "transport", v.Transport, "err", errText)
	}
	_ = m.send(v.Endpoint, (&control.HandshakeAckMsg{Endpoint: m.endpoint, Transport: v.Transport, Err: errText, Epoch: v.Epoch}).Encode(), false)
}

// currentEpoch returns the epoch of this decode's registration with the
// prefill rank ep (0 when there is none).
func (m *Manager) currentEpoch(ep string) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p := m.dec.ppeers[ep]; p != nil {
		return p.epoch
	}
	return 0
}

// handleStatus (decode): a producer's STATUS. For a room that is closed, or
// already decided, the producer gets the verdict again (it may have missed
// it); a producer asking about a room this decode does not know is told the
// room failed.
func (m *Manager) handleStatus(v *control.StatusMsg) {
	m.mu.Lock()
	r := m.dec.receivers[v.Room]
	vd, known := m.dec.verdicts[v.Room]
	m.mu.Unlock()
	if r != nil {
		r.onStatus(v)
		return
	}
	// The answers go out from goroutines Close waits for (verdictFlight);
	// a Success is re-sent by Close until acknowledged (verdictack.go).
	if known {
		if vd.ok {
			m.goReanswer(func() { m.sendSuccessVerdict(v.Endpoint, v.Room, v.Epoch, vd.attempt) })
		} else {
			m.goReanswer(func() { m.sendAbort(v.Endpoint, v.Room, vd.reason, v.Epoch, vd.attempt) })
		}
		return
	}
	m.log.Debug("STATUS for an unknown or cleared room", "room", v.Room, "peer", peerLabel(v.Endpoint))
	m.goReanswer(func() {
		m.sendAbort(v.Endpoint, v.Room, fmt.Sprintf("decode %s %s %d (closed long ago, or never created here)", m.endpoint, noRoomReason, v.Room), v.Epoch, 0)
	})
}
