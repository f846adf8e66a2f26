package engine

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Control-plane trust (issue 18 case 7). A control frame names its sender's
// endpoint, and every frame carries the sender's instance id and epoch
// (the envelope, engine/internal/control); with AuthenticateControl all are
// proven by the tag. Peer state is bound to the rank (instance id and
// epoch) that created it:
//
//   - prefill: a decode's registration (dpeers) belongs to the instance that
//     sent the REGISTER. A REGISTER naming the same endpoint replaces it only
//     when it comes from that instance with a newer epoch (without
//     AuthenticateControl: with any epoch while no TRANSFER used the current
//     registration, so a forged REGISTER claiming the decode's identity is
//     undone by the decode's next registration), or when the
//     registered instance is no longer alive (silent for PeerTimeout, or
//     disconnected, or its control connection was reset and nothing came
//     from it since, ctlreset.go, or it dropped and nothing came from it
//     for a few heartbeats); a REGISTER from another instance while the
//     registered one is not known gone is held and decided again until it
//     is, or until the registered one proves alive, which refuses it with a
//     REGISTER_ACK naming both (contested.go: a decode restarted on the same
//     port registers before the prefill noticed its old incarnation's
//     drop), so a stray or forged REGISTER cannot take a live decode's
//     state (the forged "tcpx" REGISTER of the issue). Other frames
//     claiming a registered decode's endpoint from another instance are
//     dropped, except a verdict (STATUS, ABORT) on a room from the
//     instance whose registration that room's TRANSFER came over: a decode
//     restarted on the same address registers anew while its old
//     incarnation's verdicts may still wait in the inbox.
//   - decode: a registration with a prefill rank (ppeers) expects the
//     instance the bootstrap directory named for that rank. A REGISTER_ACK,
//     or any later frame, from another instance at that address means the
//     address now belongs to another process: its rooms fail at once naming
//     both ids (not at their waiting timeout), the registration and the
//     cached directory entries are dropped, and the next room resolves again.
//   - A decode answers HANDSHAKE only from a prefill rank it registered
//     with, and the control sockets a rank opens are bounded (MaxPeers, the
//     least recently used idle one is closed first), so frames naming many
//     endpoints (the ~340 HANDSHAKE flood of the issue) cannot exhaust its
//     sockets.
//
// Without AuthenticateControl the instance ids are claims: they keep stray
// frames and restarted processes from clobbering live state, not a
// determined sender on the network. With it, only holders of the token can
// send anything at all.

// DefaultMaxPeers is ManagerConfig.MaxPeers' default.
const DefaultMaxPeers = 1024

// ErrTooManyPeers is wrapped when a rank refuses a new control peer because
// MaxPeers peers are in use.
var ErrTooManyPeers = errors.New("engine: too many control peers")

// controlKeyIf returns ControlKey(token) when on, else nil.
func controlKeyIf(on bool, token string) []byte {
	if !on {
		return nil
	}
	return control.ControlKey(token)
}

// dropLogger rate-limits the warning about dropped control frames: the
// first at once, then at most one per dropLogEvery with the count since.
type dropLogger struct {
	mu     sync.Mutex
	last   time.Time
	missed int
}

const dropLogEvery = 10 * time.Second

// drop counts a received control frame dropped for err, by reason class
// (MetricControlFramesDropped: malformed, unauthenticated, sender), and
// warns (rate limited) naming the last reason.
func (m *Manager) drop(reason string, err error) {
	m.dropped.Add(1)
	m.met.frameDropped(reason)
	l := &m.dropLog
	l.mu.Lock()
	now := time.Now()
	if now.Sub(l.last) < dropLogEvery {
		l.missed++
		l.mu.Unlock()
		return
	}
	missed := l.missed
	l.last, l.missed = now, 0
	l.mu.Unlock()
	m.log.Warn("dropped control frame", "err", err, "dropped_since_last_warning", missed)
}

// DroppedFrames returns how many received control frames this rank dropped
// (malformed, unauthenticated, or from another instance than the peer state
// they name).
func (m *Manager) DroppedFrames() uint64 { return m.dropped.Load() }

// checkSender applies the instance rules above to a received message before
// it is handled; false drops it.
func (m *Manager) checkSender(msg any, env control.Envelope) bool {
	ep := control.SenderEndpoint(msg)
	if ep == "" {
		return true
	}
	got := control.SenderID(env)
	m.mu.Lock()
	var want control.PeerID
	var registering, contender bool
	if m.cfg.Role == RolePrefill {
		if p := m.pre.dpeers[ep]; p != nil {
			want = p.id
		}
		contender = m.heldContenderLocked(ep, got)
	} else if p := m.dec.ppeers[ep]; p != nil {
		want = p.id
		select {
		case <-p.done:
		default:
			registering = true
		}
	}
	m.mu.Unlock()
	if !want.Known() || want.Is(got) {
		return true
	}
	if m.cfg.Role == RolePrefill {
		if _, ok := msg.(*control.RegisterMsg); ok {
			return true // handleRegister decides
		}
		if room, ok := verdictRoom(msg); ok && m.servedTo(room, ep, got) {
			// A verdict of the incarnation the room was served to, read
			// after its successor at the same address registered (a
			// restart: ZeroMQ reads its connections in turn, not in
			// arrival order; verdicts.go).
			m.log.Debug("verdict of a decode's previous incarnation taken", "room", room, "peer", peerLabel(ep), "instance", got.String(), "registered", want.String())
			return true
		}
		if contender {
			// Its REGISTER is held (contested.go): it waits for the
			// answer, and PINGs meanwhile.
			m.log.Debug("frame of a decode whose REGISTER is held dropped", "type", fmt.Sprintf("%T", msg), "decode", peerLabel(ep), "instance", got.String())
			return false
		}
		m.drop("sender", fmt.Errorf("%T claims decode %s, registered here by instance %s, but comes from instance %s (stray or forged)", msg, ep, want, got))
		return false
	}
	what := "a registered"
	if registering {
		what = "the directory's"
	}
	err := fmt.Errorf("%w: %s answers as instance %s, but %s instance there is %s: the address now belongs to another process (the rank restarted or was replaced, or the directory entry is stale); its rooms fail now and the next room resolves the rank again",
		transport.ErrPeerLost, m.peerName(ep), got, what, want)
	m.log.Warn("prefill rank replaced at its address", "peer", peerLabel(ep), "expected_instance", want.String(), "instance", got.String())
	m.met.peerLost(m.cfg.Role, "replaced")
	go m.peerLost(ep, false, err)
	return false
}

// verdictRoom returns the room of a decode's verdict (STATUS, ABORT).
func verdictRoom(msg any) (uint64, bool) {
	switch v := msg.(type) {
	case *control.StatusMsg:
		return v.Room, true
	case *control.AbortMsg:
		return v.Room, true
	}
	return 0, false
}

// servedTo (prefill) reports whether room's sender holds a TRANSFER from
// decode ep that came over the registration of instance id.
func (m *Manager) servedTo(room uint64, ep string, id control.PeerID) bool {
	m.mu.Lock()
	s := m.pre.senders[room]
	m.mu.Unlock()
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.dsts[ep]
	return d != nil && d.peer != nil && d.peer.id.Known() && d.peer.id.Is(id)
}

// peerLiveLocked reports whether the peer at ep was heard from within
// PeerTimeout (a dead one is also dropped from lastSeen at once when its
// control connection closes); m.mu held.
func (m *Manager) peerLiveLocked(ep string) bool {
	seen, ok := m.lastSeen[ep]
	return ok && time.Since(seen) <= m.cfg.PeerTimeout
}

// registerRefusalLocked says why a REGISTER must not replace the current
// registration old of its endpoint ("" when it may), and refuses a new
// decode when MaxPeers registrations are live; contested reports a
// REGISTER of another instance than old's while old is not judged gone,
// which is held rather than refused (contested.go); m.mu held.
func (m *Manager) registerRefusalLocked(v *control.RegisterMsg, env control.Envelope, old *decodePeer) (why string, contested bool) {
	switch {
	case old == nil:
		if len(m.pre.dpeers) >= m.cfg.MaxPeers && !m.evictIdleDecodeLocked() {
			return fmt.Sprintf("%v: prefill %s has %d decode ranks registered, all with rooms or heard from within the peer timeout (MaxPeers %d: raise --max-peers, kvx_kv_config.max_peers or KVXFER_MAX_PEERS on the prefill, or spread the decodes over more prefill ranks)", ErrTooManyPeers, m.endpoint, len(m.pre.dpeers), m.cfg.MaxPeers), false
		}
		return "", false
	case old.id.Is(control.SenderID(env)) && v.Epoch <= old.reg.Epoch && (m.ctlKey != nil || old.proven()):
		// Without control authentication a registration no room has used
		// yet may be a forgery claiming the decode's identity with a huge
		// epoch: the decode's own next REGISTER, whatever its epoch, takes
		// it back (issue 22 case 4).
		return fmt.Sprintf("epoch %d is not newer than the registration's epoch %d (a repeated or replayed REGISTER)", v.Epoch, old.reg.Epoch), false
	case !old.id.Is(control.SenderID(env)) && m.peerLiveLocked(v.Endpoint) && !m.registeredGoneLocked(v.Endpoint, old):
		return fmt.Sprintf("that endpoint is registered by instance %s, alive (heard from within the peer timeout %s); a REGISTER from another instance replaces it only once it is gone", old.id, m.cfg.PeerTimeout), true
	}
	return "", false
}

// evictIdleDecodeLocked drops the registration of one idle decode to make
// room for a new one, and reports whether it found one; m.mu held. A decode
// not heard from within the peer timeout goes first; else the least
// recently used live decode with no room on this rank (no sender has it as
// a destination, no TRANSFER or SUBSCRIBE of it waits for a sender). A live
// one is told first (REGISTER_ACK of its registration epoch, with
// EvictedPrefix in the refusal), so it registers again for its next room
// instead of sending TRANSFER to a registration that is gone.
func (m *Manager) evictIdleDecodeLocked() bool {
	for ep, p := range m.pre.dpeers {
		if m.peerLiveLocked(ep) {
			continue
		}
		m.evictDecodeLocked(ep, p, false)
		return true
	}
	waiting := map[string]bool{}
	for _, byEP := range m.pre.pending {
		for ep := range byEP {
			waiting[ep] = true
		}
	}
	for _, byEP := range m.pre.subs {
		for ep := range byEP {
			waiting[ep] = true
		}
	}
	var victim string
	var oldest int64
	for ep, p := range m.pre.dpeers {
		if p.rooms.Load() > 0 || waiting[ep] {
			continue
		}
		if u := p.lastUse.Load(); victim == "" || u < oldest {
			victim, oldest = ep, u
		}
	}
	if victim == "" {
		return false
	}
	m.evictDecodeLocked(victim, m.pre.dpeers[victim], true)
	return true
}

// EvictedPrefix starts the refusal of the REGISTER_ACK with which a
// prefill at its peer cap tells an idle decode it dropped its registration.
const EvictedPrefix = "registration evicted"

// evictDecodeLocked drops decode ep's registration; tell sends it the
// eviction notice first; m.mu held.
func (m *Manager) evictDecodeLocked(ep string, p *decodePeer, tell bool) {
	delete(m.pre.dpeers, ep)
	delete(m.lastSeen, ep)
	// This socket, taken out now: a new registration of the decode opens
	// its own, which the close below must not hit.
	ps := m.push[ep]
	delete(m.push, ep)
	m.log.Info("evicted the least recently used idle decode registration (peer cap)", "decode", ep, "max_peers", m.cfg.MaxPeers)
	go p.close()
	if ps == nil {
		return
	}
	go func() {
		if tell {
			ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Geometry: *m.geo, Epoch: p.reg.Epoch,
				Err: fmt.Sprintf("%s: prefill %s is at its peer cap (MaxPeers %d) and dropped this idle decode's registration for a new one; the next room registers again", EvictedPrefix, m.endpoint, m.cfg.MaxPeers)}
			if frames := ack.Encode(); !m.faulted(ep, frames) {
				_ = m.sendVia(ps, ep, frames, false)
			}
		}
		ps.close()
	}()
}

// sweepDeadPushLocked removes from m.push the sockets to endpoints that are
// no peer of this rank (no registration, not heard from within the peer
// timeout), whose connection attempts are failing and which were not used
// for a peer timeout, and returns them for closing; m.mu held. A send to a
// dead peer's old endpoint (a late ABORT, verdict or answer after it was
// declared lost, or a lookup that still named it) opens such a socket; each
// used to stay, retrying its connection every 100 ms, until MaxPeers forced
// it out (the chaos soak's decode reached ZeroMQ's socket limit).
func (m *Manager) sweepDeadPushLocked(now time.Time) []*pushSock {
	var out []*pushSock
	for ep, ps := range m.push {
		if m.pre.dpeers[ep] != nil || m.dec.ppeers[ep] != nil || m.peerLiveLocked(ep) ||
			now.Sub(time.Unix(0, ps.lastUse.Load())) <= m.cfg.PeerTimeout {
			continue
		}
		ps.mu.Lock()
		dead := ps.unreachable
		ps.mu.Unlock()
		if dead {
			delete(m.push, ep)
			out = append(out, ps)
		}
	}
	return out
}

// evictIdlePushLocked removes from m.push the least recently used socket to
// an endpoint this rank has no registration with and has not heard from
// within the peer timeout, and returns it for closing (nil when every socket
// is in use); m.mu held.
func (m *Manager) evictIdlePushLocked() *pushSock {
	var victim string
	var oldest int64
	for ep, ps := range m.push {
		if m.pre.dpeers[ep] != nil || m.dec.ppeers[ep] != nil || m.peerLiveLocked(ep) {
			continue
		}
		if u := ps.lastUse.Load(); victim == "" || u < oldest {
			victim, oldest = ep, u
		}
	}
	if victim == "" {
		return nil
	}
	ps := m.push[victim]
	delete(m.push, victim)
	m.log.Debug("closed the least recently used idle control socket", "peer", victim, "max_peers", m.cfg.MaxPeers)
	return ps
}

// unauthAnswerEvery bounds how often a prefill answers one endpoint's
// unauthenticated REGISTERs.
const unauthAnswerEvery = time.Second

// refuseUnauthenticated (prefill, AuthenticateControl on) answers a REGISTER
// dropped as unauthenticated with a REGISTER_ACK refusal that says why (at
// most once per unauthAnswerEvery per endpoint): a decode without a token
// (which checks no tags) then fails its room at once naming the token and
// the switch, instead of waiting for an answer until its bootstrap timeout.
// A decode with another token drops the answer too, and reports the
// unauthenticated frames from this prefill when its registration times out.
func (m *Manager) refuseUnauthenticated(v *control.RegisterMsg, why error) {
	m.mu.Lock()
	key := "auth " + v.Endpoint
	if time.Since(m.versionTold[key]) < unauthAnswerEvery {
		m.mu.Unlock()
		return
	}
	if len(m.versionTold) >= m.cfg.MaxPeers {
		clear(m.versionTold)
	}
	m.versionTold[key] = time.Now()
	m.mu.Unlock()
	ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Geometry: *m.geo, Epoch: v.Epoch,
		Err: fmt.Sprintf("prefill %s authenticates control frames (its bootstrap token is set, so control authentication is on) and dropped this decode's REGISTER: %v; give every prefill and decode rank the deployment's token (--bootstrap-auth-token, KVXFER_BOOTSTRAP_AUTH_TOKEN, kvx_kv_config.bootstrap_auth_token), or turn control authentication off on every rank (--control-auth=false, KVXFER_CONTROL_AUTH=0, KVX_CONTROL_AUTH_OFF)", m.endpoint, why)}
	go func() { _ = m.send(v.Endpoint, ack.Encode(), false) }()
}
