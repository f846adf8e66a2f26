package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// prefillSide is what only a prefill rank holds: the record staging buffer,
// the decode ranks registered with it, the rooms' Senders and what the
// control loop keeps about rooms that have no Sender yet or no longer have
// one, and the rank's bootstrap registration. Its maps are guarded by
// Manager.mu (the staging free list by stageMu); on a decode rank it stays
// empty. The handlers of the frames a prefill receives (REGISTER, TRANSFER,
// HANDSHAKE_ACK, ABORT, a verdict's STATUS) are in this file; the Sender
// itself in sender.go, the re-registration in reregister.go.
type prefillSide struct {
	staging *transport.HostBuffer // records to write (defaultStagingSlots x RecordSize bytes)
	stageMu sync.Mutex
	stFree  []int

	senders map[uint64]*Sender
	pending map[uint64]map[string]pendingTransfer // TRANSFERs before NewSender
	subs    map[uint64]map[string]pendingSub      // SUBSCRIBEs before NewSender (allocpolicy.go)
	aborted map[uint64]earlyAbort                 // ABORTs before NewSender
	recent  map[uint64]ackMemo                    // how closed senders ended (late ABORTs, TRANSFERs)
	// recentOrder: rooms of recent in the order first closed (expiry).
	recentOrder []uint64
	// doneAborted: per room whose sender closed with Success, the attempts
	// decodes aborted before that sender was created (endpoint -> attempt,
	// Sender.earlyAborted); a late TRANSFER of one of them is dropped at
	// once. doneOrder: its rooms in the order recorded (expiry, maxRecent).
	doneAborted map[uint64]map[string]uint64
	doneOrder   []uint64
	dpeers      map[string]*decodePeer // registered decode ranks
	// held: per endpoint, the latest REGISTER from another instance than
	// the one registered there, while that one may be gone (contested.go).
	held map[string]*heldRegister
	// silentDropped: decodes whose registration was dropped because they
	// were silent for PeerTimeout (endpoint -> registration epoch); told
	// when heard from again (silentdrop.go).
	silentDropped map[string]uint64

	dir       *bootstrap.Client // the directory this rank registers with
	reregs    atomic.Int64      // re-registrations (reregister.go)
	watchStop chan struct{}     // stops watchDirectory
	// checkNow asks watchDirectory for a check at once (a TRANSFER for a
	// room this rank does not hold); replaced, once set, says why this rank
	// gets no new rooms: its directory names a newer instance (wrongpeer.go).
	checkNow  chan struct{}
	replaced  atomic.Pointer[string]
	watchDone chan struct{} // closed when watchDirectory returned
}

func newPrefillSide(dir *bootstrap.Client) prefillSide {
	return prefillSide{
		senders: map[uint64]*Sender{},
		pending: map[uint64]map[string]pendingTransfer{},
		subs:    map[uint64]map[string]pendingSub{},
		aborted: map[uint64]earlyAbort{},
		recent:  map[uint64]ackMemo{},
		dpeers:  map[string]*decodePeer{},
		held:    map[string]*heldRegister{},
		dir:     dir,

		doneAborted:   map[uint64]map[string]uint64{},
		silentDropped: map[string]uint64{},
		checkNow:      make(chan struct{}, 1),
	}
}

// earlyAbort is a decode's ABORT of a room this prefill rank did not hold
// yet: when, from which decode, and why. It concludes that attempt of the
// room on the decode; NewSender reads it (see earlyAbortGrace).
type earlyAbort struct {
	at     time.Time
	from   string
	reason string
	// final: no retry can come from that decode (it speaks another
	// protocol version): the sender fails at once.
	final bool
	// attempts: per decode endpoint, the attempt its ABORT named
	// (control.AbortMsg.Attempt; 0: none named). A TRANSFER of one of
	// them is the aborted attempt's own, late (a ZeroMQ reconnect does
	// not keep a TRANSFER ahead of its ABORT): dropped, never served.
	attempts map[string]uint64
	// dropped: such TRANSFERs, for the sender's timeline.
	dropped []droppedNote
}

// droppedNote is a timeline event for a sender not created yet.
type droppedNote struct{ peer, detail string }

// abortedAttempt reports whether TRANSFER v is of an attempt its decode
// aborted early (attempts: earlyAbort.attempts or Sender.earlyAborted).
func abortedAttempt(attempts map[string]uint64, v *control.TransferMsg) bool {
	a, ok := attempts[v.Endpoint]
	return ok && a != 0 && a == v.Attempt
}

// staleTransferReason says why TRANSFER v of an early-aborted attempt is
// dropped.
func staleTransferReason(v *control.TransferMsg) string {
	return fmt.Sprintf("TRANSFER of attempt %d dropped: that decode aborted this attempt of room %d before (the TRANSFER came after its ABORT); a retry names another attempt", v.Attempt, v.Room)
}

// earlyAbortGrace is how long a sender created after an early ABORT of its
// room waits for a TRANSFER before it fails with the decode's reason. A
// TRANSFER after the ABORT that names another attempt than the ABORT's
// (control.TransferMsg.Attempt) belongs to a retry of the room (a router
// retrying a failed request keeps its bootstrap_room), which is served; one
// naming the aborted attempt is that attempt's own, late (the decode sends
// its TRANSFER before its ABORT, but a ZeroMQ reconnect can deliver them in
// either order), and is dropped. With no retry the sender is the aborted
// attempt's and fails. It is capped by the bootstrap timeout. A decode that lost the peer sends its
// ABORTs on a new control socket, so they can overtake a TRANSFER still
// on the old one; that attempt's data path is fenced and its registration
// dropped then, and a waiting TRANSFER is served only over the
// registration it came on (NewSender), so such a TRANSFER lands nothing.
const earlyAbortGrace = 2 * time.Second

// decodePeer is a decode rank that sent REGISTER to this prefill rank.
type decodePeer struct {
	reg *control.RegisterMsg
	// id is the decode's identity (the REGISTER's envelope): only that
	// rank may replace this registration (trust.go).
	id        control.PeerID
	pairs     []kvargs.BufferPair // this rank's KV buffers → the decode's (PairBuffers)
	offer     control.TransportOffer
	local     *regSet
	seg       transport.Segment
	ready     chan struct{} // closed when seg is usable or err is set
	err       error
	mu        sync.Mutex // guards seg, offer, closed and broken
	closed    bool
	readyOnce sync.Once
	// used is set once a TRANSFER of this registration was accepted: the
	// decode that registered it is the one using it (trust.go).
	used atomic.Bool
	// rooms counts the senders this decode is a destination of, until
	// they end; lastUse (Unix ns) is its registration or last TRANSFER.
	// A decode with no room is idle: at the peer cap the least recently
	// used idle one is evicted (evictIdleDecodeLocked).
	rooms   atomic.Int32
	lastUse atomic.Int64
	// regAt is when this registration was taken.
	regAt time.Time
	// broken says why the data path can no longer be trusted (a batch was
	// abandoned in flight, or the transport lost the receiver): the segment
	// is closed, later TRANSFERs of this registration are refused, and the
	// decode is told to fence the epoch and register again.
	broken string
}

// breakPath marks the data path broken (first reason wins) and closes its
// segment in the background (a tcp segment waits for its stream goroutines).
func (p *decodePeer) breakPath(why string) {
	p.mu.Lock()
	first := p.broken == ""
	if first {
		p.broken = why
	}
	p.mu.Unlock()
	if first {
		go p.close()
	}
}

// proven reports whether a TRANSFER of this registration was accepted.
func (p *decodePeer) proven() bool { return p.used.Load() }

// brokenReason returns why the data path is broken ("" when it is not).
func (p *decodePeer) brokenReason() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.broken
}

// markReady sets the connection outcome once and releases the waiters.
func (p *decodePeer) markReady(err error) {
	p.readyOnce.Do(func() {
		p.err = err
		close(p.ready)
	})
}

func (p *decodePeer) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed && p.seg != nil {
		_ = p.seg.Close()
	}
	p.closed = true
}

// setSegment installs the open segment; false (and the segment closed) when
// the peer was closed meanwhile.
func (p *decodePeer) setSegment(seg transport.Segment, o control.TransportOffer, rs *regSet) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = seg.Close()
		return false
	}
	p.seg, p.offer, p.local = seg, o, rs
	return true
}

// handleRegister records a decode rank, pairs its buffers with this rank's
// (PairBuffers), answers REGISTER_ACK (accepted, or the refusal naming both
// sides) and opens a segment to it with the highest-priority transport both
// sides have whose OpenSegment succeeds.
func (m *Manager) handleRegister(v *control.RegisterMsg, env control.Envelope) {
	m.admitRegister(v, env, nil)
}

// admitRegister is handleRegister of a REGISTER, held as held (nil: just
// read): one from another instance than a registration of its endpoint
// that is not judged gone is held, or refused once the registered instance
// proved alive (contested.go).
func (m *Manager) admitRegister(v *control.RegisterMsg, env control.Envelope, held *heldRegister) {
	now := time.Now()
	p := &decodePeer{reg: v, id: control.SenderID(env), ready: make(chan struct{}), regAt: now}
	m.mu.Lock()
	old := m.pre.dpeers[v.Endpoint]
	why, contested := m.registerRefusalLocked(v, env, old)
	if contested {
		h := held
		if h == nil {
			h = &heldRegister{v: v, env: env, since: now}
		}
		if refusal := m.contestRefusalLocked(h, old, now); refusal != "" {
			why = refusal
		} else {
			m.holdRegisterLocked(h)
			m.mu.Unlock()
			if held == nil {
				m.log.Info("REGISTER from another instance at a registered decode's address held until the registered instance is judged gone or proves alive (a restart on the same port, or a stray REGISTER)",
					"decode", v.Endpoint, "instance", control.SenderID(env).String(), "registered", old.id.String())
			}
			return
		}
		m.mu.Unlock()
		m.drop("sender", fmt.Errorf("REGISTER from decode %s (instance %s, registration epoch %d) refused: %s", v.Endpoint, control.SenderID(env), v.Epoch, why))
		ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Err: why, Geometry: *m.geo, Epoch: v.Epoch}
		go func() { _ = m.send(v.Endpoint, ack.Encode(), false) }()
		return
	}
	if why != "" {
		m.mu.Unlock()
		if old == nil {
			// At the peer cap: the decode is told at once (it would
			// otherwise report this prefill silent after its timeout).
			// The answer goes over a socket of its own, beyond the cap,
			// closed right after (sendOnce bounds how many at a time).
			m.log.Warn("refused decode rank: peer cap", "decode", v.Endpoint, "max_peers", m.cfg.MaxPeers)
			ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Err: why, Geometry: *m.geo, Epoch: v.Epoch}
			go m.sendOnce(v.Endpoint, ack.Encode())
			return
		}
		m.drop("sender", fmt.Errorf("REGISTER from decode %s (instance %s, registration epoch %d) refused: %s", v.Endpoint, control.SenderID(env), v.Epoch, why))
		return
	}
	m.pre.dpeers[v.Endpoint] = p
	if m.heldContenderLocked(v.Endpoint, p.id) {
		delete(m.pre.held, v.Endpoint)
	}
	p.lastUse.Store(now.UnixNano())
	m.lastSeen[v.Endpoint] = now
	m.mu.Unlock()
	if held != nil {
		m.log.Info("held REGISTER taken: the decode registered at its address is gone", "decode", v.Endpoint, "instance", p.id.String(), "held", now.Sub(held.since).Round(time.Millisecond))
	}
	m.watchPeer(v.Endpoint)
	if old != nil {
		go old.close() // closing a segment may wait for its streams: never in the control loop
	}
	go func() {
		pairs, err := kvargs.PairBuffers(m.geo, &v.Geometry, m.endpoint, v.Endpoint)
		ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Geometry: *m.geo, Epoch: v.Epoch}
		if err != nil {
			ack.Err = err.Error()
		}
		if serr := m.send(v.Endpoint, ack.Encode(), false); serr != nil && err == nil {
			err = serr
		}
		if err != nil {
			m.log.Warn("refused decode rank", "decode", v.Endpoint, "err", err)
			p.markReady(err)
			return
		}
		p.pairs = pairs
		if err := m.connectPeer(p); err != nil {
			m.log.Warn("cannot reach decode rank", "decode", v.Endpoint, "err", err)
			p.markReady(err)
		}
	}()
}

func (m *Manager) connectPeer(p *decodePeer) error {
	v := p.reg
	var reasons []string
	for _, rs := range m.regs {
		for _, o := range v.Transports {
			if o.Name != rs.t.Name() {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			seg, err := rs.t.OpenSegment(ctx, transport.SegmentInfo{Endpoint: o.Endpoint, Regions: o.Regions(), Epoch: v.Epoch})
			cancel()
			if err != nil {
				reasons = append(reasons, fmt.Sprintf("%s: %v", o.Name, err))
				continue
			}
			if !p.setSegment(seg, o, rs) {
				return fmt.Errorf("engine: decode %s went away while connecting", v.Endpoint)
			}
			m.log.Debug("segment open", "decode", v.Endpoint, "transport", o.Name)
			if rs.caps.Has(transport.CapHandshake) {
				reply := seg.HandshakeReply()
				if err := m.send(v.Endpoint, (&control.HandshakeMsg{Endpoint: m.endpoint, Transport: o.Name, Reply: reply, Epoch: v.Epoch}).Encode(), false); err != nil {
					return err
				}
				return nil // ready closes on HANDSHAKE_ACK
			}
			p.markReady(nil)
			return nil
		}
	}
	if len(reasons) == 0 {
		offered := make([]string, len(v.Transports))
		for i, o := range v.Transports {
			offered[i] = o.Name
		}
		return fmt.Errorf("engine: no common transport with decode %s: it offers %v, this prefill has %v", v.Endpoint, offered, m.TransportNames())
	}
	return fmt.Errorf("engine: no transport reaches decode %s: %v", v.Endpoint, reasons)
}

func (m *Manager) handleHandshakeAck(v *control.HandshakeAckMsg) {
	if m.probeHandshakeAck(v) {
		return
	}
	m.mu.Lock()
	p := m.pre.dpeers[v.Endpoint]
	m.mu.Unlock()
	if p == nil {
		return
	}
	p.mu.Lock()
	ok := p.seg != nil && p.offer.Name == v.Transport && p.reg.Epoch == v.Epoch
	p.mu.Unlock()
	if !ok {
		return
	}
	var err error
	if v.Err != "" {
		err = fmt.Errorf("engine: decode %s refused the %s handshake: %s", v.Endpoint, v.Transport, v.Err)
	}
	p.markReady(err)
}

// rejectTransfer fails the decode's room (STATUS Failed, then ABORT_ACK);
// clean false tells the decode to fence the epoch and register again
// (nothing was written for this room).
func (m *Manager) rejectTransfer(v *control.TransferMsg, reason string, clean bool) {
	m.log.Warn("rejected TRANSFER", "room", v.Room, "step", string(StepConnect), "peer", peerLabel(v.Endpoint), "reason", reason)
	go func() {
		status := (&control.StatusMsg{Room: v.Room, State: int(KVFailed), Producer: m.producerRank(), Endpoint: m.endpoint, Reason: reason, Epoch: v.Epoch}).Encode()
		ack := &control.AbortAckMsg{Room: v.Room, Endpoint: m.endpoint, Producer: m.producerRank(), Epoch: v.Epoch, Clean: clean, Detail: reason, Attempt: v.Attempt}
		if err := m.send(v.Endpoint, status, false); errors.Is(err, ErrTooManyPeers) {
			// At the socket cap, every socket to a registered decode (a
			// decode evicted for a new one is the usual case): the
			// answer goes over a socket of its own, so the decode fails
			// the room now instead of when it judges this prefill silent.
			m.sendOnce(v.Endpoint, status, ack.Encode())
			m.met.fence(RolePrefill, "abort_ack_sent")
			return
		} else if err != nil {
			m.log.Warn("could not tell the decode its TRANSFER was rejected; it fails the room when it judges this prefill silent", "room", v.Room, "peer", peerLabel(v.Endpoint), "err", err)
		}
		m.sendAbortAck(v.Endpoint, ack)
	}()
}

func (m *Manager) handleTransfer(v *control.TransferMsg) {
	m.mu.Lock()
	p := m.pre.dpeers[v.Endpoint]
	s := m.pre.senders[v.Room]
	m.mu.Unlock()
	reject := func(reason string, clean bool) { m.rejectTransfer(v, reason, clean) }
	if p == nil {
		reject("prefill got TRANSFER before REGISTER from "+v.Endpoint+" (this prefill lost the registration; the decode registers again)", false)
		return
	}
	p.lastUse.Store(time.Now().UnixNano())
	if v.Epoch != p.reg.Epoch {
		reject(fmt.Sprintf("TRANSFER names data-path epoch %d, but the decode's registration here is epoch %d (stale; the decode registers again)", v.Epoch, p.reg.Epoch), false)
		return
	}
	if why := p.brokenReason(); why != "" {
		reject(fmt.Sprintf("the data path of registration epoch %d is broken (%s); the decode registers again", v.Epoch, why), false)
		return
	}
	if !v.Dummy {
		if err := checkTransfer(v, &p.reg.Geometry, p.reg.RingSlots); err != nil {
			reject(fmt.Sprintf("decode %s: %v", v.Endpoint, err), true)
			return
		}
	}
	p.used.Store(true)
	if s != nil {
		s.addDst(v, p)
		return
	}
	m.mu.Lock()
	if ea, ok := m.pre.aborted[v.Room]; ok && m.pre.senders[v.Room] == nil && abortedAttempt(ea.attempts, v) {
		why := staleTransferReason(v)
		ea.dropped = append(ea.dropped, droppedNote{v.Endpoint, why})
		m.pre.aborted[v.Room] = ea
		m.mu.Unlock()
		m.log.Warn("dropped a TRANSFER of an attempt its decode aborted", "room", v.Room, "step", string(StepConnect), "peer", peerLabel(v.Endpoint), "attempt", v.Attempt)
		return
	}
	if memo, ok := m.pre.recent[v.Room]; ok && m.pre.senders[v.Room] == nil && abortedAttempt(memo.aborted, v) {
		m.mu.Unlock()
		m.log.Warn("dropped a TRANSFER of an attempt its decode aborted", "room", v.Room, "step", string(StepConnect), "peer", peerLabel(v.Endpoint), "attempt", v.Attempt, "reason", staleTransferReason(v))
		return
	}
	if m.pre.senders[v.Room] == nil && abortedAttempt(m.pre.doneAborted[v.Room], v) {
		// The room's sender served a retry and closed with Success: this
		// attempt was concluded on both sides before it. Left pending it
		// would wait for a sender until the bootstrap timeout.
		m.mu.Unlock()
		why := staleTransferReason(v) + "; this prefill's sender of the room closed with Success since"
		if t := m.timelines.lookup(v.Room); t != nil {
			t.event(StepConnect, v.Endpoint, why)
		}
		m.log.Warn("dropped a TRANSFER of an attempt its decode aborted", "room", v.Room, "step", string(StepConnect), "peer", peerLabel(v.Endpoint), "attempt", v.Attempt, "reason", why)
		return
	}
	if memo, ok := m.pre.recent[v.Room]; ok && m.pre.senders[v.Room] == nil && memo.retriedBy(v) {
		// A decode whose earlier attempt of this room the failed sender
		// served sends TRANSFER for another attempt: a retry with the same
		// bootstrap_room (after that attempt was concluded on both sides),
		// whose TRANSFER came before the retry's sender. It waits for that
		// sender like any early TRANSFER; the failure is forgotten.
		delete(m.pre.recent, v.Room)
	} else if ok && m.pre.senders[v.Room] == nil {
		m.mu.Unlock()
		// The room failed here before this TRANSFER arrived (or this
		// decode's STATUS was lost): nothing is written for it, so the
		// data path stays clean unless this decode was a destination.
		clean := memo.clean || !slices.Contains(memo.dsts, v.Endpoint)
		reject(fmt.Sprintf("prefill %s failed room %d %s before this TRANSFER arrived: %s", m.endpoint, v.Room, time.Since(memo.at).Round(time.Millisecond), memo.failure), clean)
		return
	}
	if why := m.pre.replaced.Load(); why != nil && m.pre.senders[v.Room] == nil {
		m.mu.Unlock()
		reject(m.replacedRefusal(v.Room, *why), true) // wrongpeer.go
		return
	}
	if m.pre.senders[v.Room] == nil {
		m.askDirectoryCheck()
		if m.pre.pending[v.Room] == nil {
			m.pre.pending[v.Room] = map[string]pendingTransfer{}
		}
		if old, ok := m.pre.pending[v.Room][v.Endpoint]; ok && v.Attempt != 0 && v.Attempt < old.msg.Attempt && old.id.SameIncarnation(p.id) {
			// A concluded attempt's TRANSFER, delivered after its
			// retry's (its ABORT lost): the same ordering rule as
			// earlierAttemptOfSameDecode, for a room with no sender yet.
			m.mu.Unlock()
			why := fmt.Sprintf("TRANSFER of attempt %d dropped: the TRANSFER of attempt %d of room %d waits for the room's sender, from the same decode process (instance %s), whose attempt numbers only grow: the TRANSFER is of an attempt that decode concluded before, delivered late (its ABORT never reached this prefill)", v.Attempt, old.msg.Attempt, v.Room, p.id)
			if t := m.timelines.lookup(v.Room); t != nil {
				t.event(StepConnect, v.Endpoint, why)
			}
			m.log.Warn("dropped a TRANSFER of an attempt its decode aborted", "room", v.Room, "step", string(StepConnect), "peer", peerLabel(v.Endpoint), "attempt", v.Attempt, "reason", why)
			return
		}
		m.pre.pending[v.Room][v.Endpoint] = pendingTransfer{msg: v, id: p.id, at: time.Now()}
		m.mu.Unlock()
		return
	}
	s = m.pre.senders[v.Room]
	m.mu.Unlock()
	s.addDst(v, p)
}

// checkTransfer validates a non-dummy TRANSFER against the decode's geometry.
func checkTransfer(v *control.TransferMsg, g *kvargs.Geometry, ringSlots int) error {
	if err := checkDstPages(v.Pages, g); err != nil {
		return err
	}
	if v.Slot >= ringSlots {
		return fmt.Errorf("metadata slot %d outside the decode's ring of %d", v.Slot, ringSlots)
	}
	if err := checkAux(v.AuxIndex, g); err != nil {
		return err
	}
	if err := checkState(v.StateIndices, g); err != nil {
		return err
	}
	if v.PrefixTokens%g.PageSize != 0 {
		return fmt.Errorf("decode_prefix_len %d is not whole pages of %d tokens", v.PrefixTokens, g.PageSize)
	}
	return nil
}

func (m *Manager) producerRank() int {
	return ProducerRank(m.geo.TPRank, m.geo.PPSize, m.geo.PPRank)
}

func (m *Manager) stageAcquire() (int, error) {
	m.pre.stageMu.Lock()
	defer m.pre.stageMu.Unlock()
	if len(m.pre.stFree) == 0 {
		return 0, fmt.Errorf("engine: all %d record staging slots in use (too many concurrent transfers)", defaultStagingSlots)
	}
	i := m.pre.stFree[len(m.pre.stFree)-1]
	m.pre.stFree = m.pre.stFree[:len(m.pre.stFree)-1]
	return i, nil
}

func (m *Manager) stageRelease(i int) {
	m.pre.stageMu.Lock()
	m.pre.stFree = append(m.pre.stFree, i)
	m.pre.stageMu.Unlock()
}

type pendingTransfer struct {
	msg *control.TransferMsg
	id  control.PeerID // the decode's identity (its registration's)
	at  time.Time
}

// handleAbort: on a prefill, a decode failed the room (its verdict): the
// sender fails with the decode's reason, stops writing and, once no batch of
// the room is in flight, answers ABORT_ACK; a room this rank does not hold
// (yet) is remembered so that a later NewSender fails at once, and is
// acknowledged at once. On a decode (older peers): the producer aborted.
func (m *Manager) handleAbort(v *control.AbortMsg) {
	if m.deferNoRoomAbort(v) {
		return
	}
	m.handleAbortNow(v)
}

// handleAbortNow is handleAbort without the wait of deferNoRoomAbort.
func (m *Manager) handleAbortNow(v *control.AbortMsg) {
	err := fmt.Errorf("%w by %s %s: %s", ErrAborted, m.otherRole(), v.Endpoint, v.Reason)
	m.mu.Lock()
	s := m.pre.senders[v.Room]
	r := m.dec.receivers[v.Room]
	var memo ackMemo
	haveMemo := false
	if m.cfg.Role == RolePrefill && s == nil {
		m.recordEarlyAbortLocked(v)
		delete(m.pre.subs, v.Room)
		memo, haveMemo = m.pre.recent[v.Room]
	}
	m.mu.Unlock()
	if s != nil {
		if held, other := s.abortOfOtherAttempt(v); other {
			// An ABORT of another attempt of this bootstrap_room by that
			// decode (one it concluded before the attempt this sender
			// serves, delivered late): this attempt goes on, and a late
			// TRANSFER of the aborted attempt is dropped (addDst).
			s.tr.event(s.tr.step(), v.Endpoint, fmt.Sprintf("ABORT of attempt %d ignored: this sender serves that decode's attempt %d (%s)", v.Attempt, held, v.Reason))
			m.log.Warn("dropped an ABORT of another attempt of the room", "room", v.Room, "peer", peerLabel(v.Endpoint), "abort_attempt", v.Attempt, "attempt", held)
			return
		}
		if s.abortBeforeDst(v) {
			// That decode is no destination yet: nothing was written
			// for it, and failing the sender would fail its retry's
			// TRANSFER when it comes (a late ABORT of an earlier
			// attempt). Recorded as an early abort of that attempt,
			// acknowledged clean at once; a decode that aborted its
			// only attempt fails the sender after the grace of an
			// early ABORT.
			grace := min(earlyAbortGrace, m.cfg.BootstrapTimeout)
			s.tr.event(s.tr.step(), v.Endpoint, fmt.Sprintf("ABORT of attempt %d before that decode's TRANSFER: its TRANSFER is dropped, another attempt's served; the sender fails unless one comes within %s (%s)", v.Attempt, grace, v.Reason))
			m.log.Warn("an ABORT before the decode's TRANSFER recorded as an early abort of its attempt", "room", v.Room, "peer", peerLabel(v.Endpoint), "abort_attempt", v.Attempt)
			m.met.fence(m.cfg.Role, "abort_received")
			go m.sendAbortAck(v.Endpoint, &control.AbortAckMsg{Room: v.Room, Endpoint: m.endpoint, Producer: m.producerRank(), Epoch: v.Epoch, Clean: true, Attempt: v.Attempt})
			m.goTracked(func() { s.failUnlessDst(v, grace) })
			return
		}
	}
	m.met.fence(m.cfg.Role, "abort_received")
	if r != nil {
		r.failLocal(err)
	}
	if m.cfg.Role != RolePrefill {
		return
	}
	ack := &control.AbortAckMsg{Room: v.Room, Endpoint: m.endpoint, Producer: m.producerRank(), Epoch: v.Epoch, Clean: true, Attempt: v.Attempt}
	if s == nil {
		if haveMemo {
			ack.Clean, ack.Detail = memo.clean, memo.detail
		}
		go m.sendAbortAck(v.Endpoint, ack)
		return
	}
	s.fail(err)
	s.tr.event(s.tr.step(), v.Endpoint, "ABORT received")
	s.mu.Lock()
	told := s.failTold[v.Endpoint]
	s.mu.Unlock()
	if told {
		// notifyFailed sends this destination its STATUS Failed and then
		// its one ABORT_ACK, in that order. A second ACK here could reach
		// the decode first, or after it closed the room, and be taken by
		// the next attempt of the same bootstrap_room for its own (a retry
		// failed, its producer counted fenced while it writes); the STATUS
		// after that ACK would be answered with a stale ABORT.
		return
	}
	go func() {
		<-s.finished
		ack.Clean, ack.Detail = s.cleanState()
		ack.Epoch = s.dstEpoch(v.Endpoint, v.Epoch)
		if m.sendAbortAck(v.Endpoint, ack) {
			detail := "ABORT_ACK sent: clean"
			if !ack.Clean {
				detail = "ABORT_ACK sent: unclean (" + ack.Detail + ")"
			}
			s.tr.event(s.tr.step(), v.Endpoint, detail)
		}
	}()
}

// recordEarlyAbortLocked (prefill, m.mu held) remembers a decode's ABORT
// of a room this rank holds no sender for (earlyAbort) and drops what
// waited for that room: the SUBSCRIBEs and the TRANSFERs, except one of
// the same decode naming another attempt (a retry whose TRANSFER came
// before this ABORT of an earlier attempt, which it concluded first).
func (m *Manager) recordEarlyAbortLocked(v *control.AbortMsg) {
	ea := m.pre.aborted[v.Room]
	ea.at, ea.from, ea.reason, ea.final = time.Now(), v.Endpoint, v.Reason, false
	if ea.attempts == nil {
		ea.attempts = map[string]uint64{}
	}
	ea.attempts[v.Endpoint] = v.Attempt
	m.pre.aborted[v.Room] = ea
	for ep, pt := range m.pre.pending[v.Room] {
		if ep != v.Endpoint || v.Attempt == 0 || pt.msg.Attempt == v.Attempt {
			delete(m.pre.pending[v.Room], ep)
		}
	}
	if len(m.pre.pending[v.Room]) == 0 {
		delete(m.pre.pending, v.Room)
	}
}

// sendAbortAck (prefill) sends ABORT_ACK to a decode (best effort: a decode
// that misses it fences the data path after its FenceTimeout). It reports
// whether the frame was handed to the control socket.
func (m *Manager) sendAbortAck(ep string, ack *control.AbortAckMsg) bool {
	if m.send(ep, ack.Encode(), false) != nil {
		return false
	}
	m.met.fence(RolePrefill, "abort_ack_sent")
	return true
}

// handleVerdict (prefill): a decode's verdict on a room (STATUS from the
// decode): Success completes the sender once every destination agreed, and
// is acknowledged (VERDICT_ACK, verdictack.go), each copy of it.
func (m *Manager) handleVerdict(v *control.StatusMsg) {
	m.mu.Lock()
	s := m.pre.senders[v.Room]
	m.mu.Unlock()
	if s == nil {
		if KVPoll(v.State) == KVSuccess {
			// Closed here (a copy of a verdict that came before, whose
			// acknowledgement was lost): acknowledged, since the decode
			// waits for that when it closes. Which attempt it was for is
			// not known here (STATUS names none; a memo of a failed
			// earlier attempt of the room says nothing about it), so it
			// names none.
			m.ackVerdict(v, 0, "")
		}
		return
	}
	switch KVPoll(v.State) {
	case KVSuccess:
		if !s.hasDst(v.Endpoint) {
			s.onVerdict(v.Endpoint) // not a destination: ignored there
			return
		}
		var failure string
		if p, err := s.st.get(); p == KVFailed && err != nil && !s.verdictFrom(v.Endpoint) {
			failure = err.Error()
		}
		s.onVerdict(v.Endpoint)
		m.ackVerdict(v, s.dstAttempt(v.Endpoint), failure)
	case KVFailed:
		s.fail(fmt.Errorf("%w by decode %s: %s", ErrAborted, v.Endpoint, v.Reason))
	}
}
