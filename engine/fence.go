package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// One outcome per room, and fencing before reuse (DESIGN.md, "Fencing").
//
// The decode is the authority on a room's outcome:
//
//   - A producer reports STATUS Success once every page and the metadata
//     record landed; it then writes nothing more for the room and waits for
//     the decode's verdict. The decode answers STATUS Success when it has
//     verified the room, or ABORT when it failed it. A prefill Sender reaches
//     Success only with a Success verdict from every decode destination, so
//     neither side reports Success for a room the other failed. A producer
//     that hears nothing asks again (it re-sends its STATUS); after its
//     waiting timeout it asks the decode to fail the room (STATUS Failed) and
//     still reports whatever verdict comes back, giving up on its own only
//     when the decode stays silent for a further peer timeout. The decode
//     remembers verdicts (see verdictTTL), so a producer that was stopped or
//     cut off still learns the real outcome when it asks.
//   - Any failure on the decode (waiting timeout, peer lost, a bad record or
//     checksum, a refused pairing, abort, close) sends ABORT to every
//     producer of the room. A producer fails the room ("aborted by decode
//     …"), stops posting writes, and once no transfer batch of the room is
//     in flight answers ABORT_ACK. Any failure on a prefill reaches the
//     decode as STATUS Failed, followed by ABORT_ACK once its batches ended.
//   - The decode hands a failed room's destination pages and metadata slot
//     back (Receiver.Close returns, the slot is released) only when every
//     producer it sent TRANSFER to is fenced: it reported Success (nothing
//     more to write), or acknowledged the abort cleanly, or its data path was
//     fenced by the transports (Fencer.FenceEpoch). The last happens when no
//     clean ABORT_ACK arrives within FenceTimeout, when the ABORT_ACK is not
//     clean (a batch was abandoned or the data path broke), or when the
//     producer is lost. Fencing an epoch also drops the registration, so the
//     next room with that producer registers again with a new epoch: a
//     broken data path is re-established on the next room.

// DefaultFenceTimeout is how long a decode waits for a producer's
// ABORT_ACK before it fences that producer's data path.
const DefaultFenceTimeout = 5 * time.Second

// fenceRetry is the pause between FenceEpoch attempts on a transport that
// could not fence yet (shm: a sender stopped in the middle of a copy).
const fenceRetry = time.Second

// verdictTTL is how long a decode remembers a finished room's verdict: at
// least 10 minutes, and twice the time a producer keeps asking
// (WaitingTimeout + PeerTimeout); maxVerdicts bounds how many it keeps (the
// oldest are forgotten first). A producer stopped longer than that before it
// asks again is told the room is unknown, and fails it.
const (
	minVerdictTTL = 10 * time.Minute
	maxVerdicts   = 200_000
)

func (m *Manager) verdictTTL() time.Duration {
	return max(minVerdictTTL, 2*(m.cfg.WaitingTimeout+m.cfg.PeerTimeout))
}

// verdict is a decode's remembered outcome of a finished room, and the
// attempt (Receiver) it was decided for.
type verdict struct {
	ok      bool
	reason  string
	attempt uint64
	at      time.Time
}

// ackMemo is a prefill's memory of a closed, failed sender: whether its
// transfer batches all ended on a healthy data path (see AbortAckMsg.Clean),
// why it failed, and which decodes had sent it TRANSFER. A TRANSFER that
// arrives after the sender was closed is answered from it at once (issue 18
// case 5: an early prefill failure is not lost), within the bootstrap
// timeout and for at most maxRecent rooms (the oldest are forgotten first).
type ackMemo struct {
	clean   bool
	detail  string
	failure string
	dsts    []string
	// served is, per decode in dsts, the attempt whose TRANSFER the sender
	// served: a TRANSFER of that decode naming a later attempt is a retry
	// of the room (handleTransfer), not a late one of the failed attempt.
	served map[string]attemptID
	// aborted: the attempts decodes aborted before the sender was created
	// (earlyAbort.attempts); a TRANSFER of one of them is dropped.
	aborted map[string]uint64
	at      time.Time
}

// attemptID names one attempt of a room on a decode: the registration
// epoch its TRANSFER came over and the decode's attempt number
// (control.TransferMsg.Attempt).
type attemptID struct {
	epoch   uint64
	attempt uint64
}

// retriedBy reports whether TRANSFER v is a new attempt of the memo's room
// by a decode whose earlier attempt the failed sender served, on a clean
// data path: over the same registration (one decode manager, which numbers
// its attempts in order) a later attempt; over another, any other attempt
// (a TRANSFER of the served attempt carries the old epoch and was refused
// before this). A TRANSFER of a decode the sender never heard from may be
// the failed attempt's own, late: it is answered from the memo, as is any
// after an unclean end.
func (a ackMemo) retriedBy(v *control.TransferMsg) bool {
	id, ok := a.served[v.Endpoint]
	if !a.clean || !ok {
		return false
	}
	if id.epoch == v.Epoch {
		return v.Attempt > id.attempt
	}
	return v.Attempt != id.attempt
}

// maxRecent bounds the closed-sender memos a prefill keeps.
const maxRecent = 100_000

// rememberDoneAbortedLocked records, for a sender of room that closed
// with Success, the attempts decodes aborted before it was created
// (Sender.earlyAborted; nothing when none); m.mu held. A memo of an
// earlier failed sender of the room is kept: each answers its own
// attempts.
func (m *Manager) rememberDoneAbortedLocked(room uint64, aborted map[string]uint64) {
	if len(aborted) == 0 {
		return
	}
	if _, ok := m.pre.doneAborted[room]; !ok {
		m.pre.doneOrder = append(m.pre.doneOrder, room)
	}
	m.pre.doneAborted[room] = maps.Clone(aborted)
	for len(m.pre.doneAborted) > maxRecent && len(m.pre.doneOrder) > 0 {
		delete(m.pre.doneAborted, m.pre.doneOrder[0])
		m.pre.doneOrder = m.pre.doneOrder[1:]
	}
}

// rememberClosedLocked records a closed, failed sender's memo; m.mu held.
func (m *Manager) rememberClosedLocked(room uint64, a ackMemo) {
	if _, ok := m.pre.recent[room]; !ok {
		m.pre.recentOrder = append(m.pre.recentOrder, room)
	}
	m.pre.recent[room] = a
	for len(m.pre.recent) > maxRecent && len(m.pre.recentOrder) > 0 {
		delete(m.pre.recent, m.pre.recentOrder[0])
		m.pre.recentOrder = m.pre.recentOrder[1:]
	}
}

// epochKey names one registration's data path: the prefill control
// endpoint and the epoch.
type epochKey struct {
	peer  string
	epoch uint64
}

// rememberVerdict records a decode room's outcome, decided for attempt,
// for answering a producer that asks again after the room was closed.
func (m *Manager) rememberVerdict(room uint64, ok bool, reason string, attempt uint64) {
	m.mu.Lock()
	if _, ok := m.dec.verdicts[room]; !ok {
		m.dec.verdictOrder = append(m.dec.verdictOrder, room)
	}
	m.dec.verdicts[room] = verdict{ok: ok, reason: reason, attempt: attempt, at: time.Now()}
	for len(m.dec.verdicts) > maxVerdicts && len(m.dec.verdictOrder) > 0 {
		delete(m.dec.verdicts, m.dec.verdictOrder[0])
		m.dec.verdictOrder = m.dec.verdictOrder[1:]
	}
	m.mu.Unlock()
}

// sendVerdict tells a producer the decode's outcome of room: STATUS Success,
// or ABORT with the reason naming no attempt (sendAbort names one). It
// reports whether the frame was handed to the control socket.
func (m *Manager) sendVerdict(ep string, room uint64, ok bool, reason string, epoch uint64) bool {
	if !ok {
		return m.sendAbort(ep, room, reason, epoch, 0)
	}
	frames := (&control.StatusMsg{Room: room, State: int(KVSuccess), Producer: m.geo.TPRank, Endpoint: m.endpoint, Epoch: epoch}).Encode()
	if err := m.send(ep, frames, false); err != nil {
		m.log.Debug("verdict not sent", "room", room, "peer", peerLabel(ep), "err", err)
		return false
	}
	return true
}

// sendAbort tells a producer that attempt (a Receiver's, 0: none named) of
// room failed here (ABORT with the reason). It reports whether the frame
// was handed to the control socket.
func (m *Manager) sendAbort(ep string, room uint64, reason string, epoch, attempt uint64) bool {
	frames := (&control.AbortMsg{Room: room, Endpoint: m.endpoint, Reason: reason, Epoch: epoch, Attempt: attempt}).Encode()
	if err := m.send(ep, frames, false); err != nil {
		m.log.Debug("verdict not sent", "room", room, "peer", peerLabel(ep), "err", err)
		return false
	}
	m.met.fence(RoleDecode, "abort_sent")
	return true
}

// handleAbortAck (decode): a producer will write nothing more for the room.
func (m *Manager) handleAbortAck(v *control.AbortAckMsg) {
	m.met.fence(RoleDecode, "abort_ack_received")
	m.mu.Lock()
	r := m.dec.receivers[v.Room]
	m.mu.Unlock()
	stale := r != nil && v.Attempt != 0 && v.Attempt != r.attempt
	if stale {
		// An acknowledgement of an earlier attempt of this bootstrap_room
		// (its receiver was closed; the frame came late): it says nothing
		// about what this attempt's producer still writes.
		r.tr.event(r.tr.step(), v.Endpoint, fmt.Sprintf("stale ABORT_ACK ignored: it acknowledges attempt %d, this receiver is attempt %d", v.Attempt, r.attempt))
		r.tr.log(v.Endpoint).Warn("ABORT_ACK of an earlier attempt of the room ignored", "ack_attempt", v.Attempt, "attempt", r.attempt, "clean", v.Clean)
	}
	if r == nil || stale {
		if !v.Clean && v.Epoch != 0 {
			// A room (attempt) already handed back: its producer fenced
			// itself uncleanly; fence the data path anyway so nothing late
			// lands.
			m.fenceEpochAsync(v.Endpoint, v.Epoch, fmt.Sprintf("prefill %s reported an unclean abort of room %d (attempt %d) after that attempt was closed: %s", v.Endpoint, v.Room, v.Attempt, v.Detail))
		}
		return
	}
	r.onAbortAck(v)
}

// fenceEpochAsync fences the data path (peer, epoch) on every transport
// unless a fence of it is already running or done, fails the rooms still
// using it, and drops the registration so the next room registers again.
func (m *Manager) fenceEpochAsync(peer string, epoch uint64, why string) {
	m.fenceEpoch(peer, epoch, why, false)
}

// fenceEpoch is fenceEpochAsync; routine (a peer that left with no room on
// this data path, e.g. a rank that exited cleanly) logs the fence at INFO
// instead of WARN when no active room uses the epoch.
func (m *Manager) fenceEpoch(peer string, epoch uint64, why string, routine bool) {
	if epoch == 0 {
		return
	}
	k := epochKey{peer, epoch}
	m.mu.Lock()
	if m.closed || m.dec.fenceOps[k] != nil {
		m.mu.Unlock()
		return
	}
	done := make(chan struct{})
	m.dec.fenceOps[k] = done
	if p := m.dec.ppeers[peer]; p != nil && p.epoch == epoch {
		delete(m.dec.ppeers, peer)
	}
	var rs []*Receiver
	for _, r := range m.dec.receivers {
		rs = append(rs, r)
	}
	m.wg.Add(1) // under m.mu with closed false: never concurrent with teardown's Wait
	m.mu.Unlock()
	var using []*Receiver
	for _, r := range rs {
		if r.usesEpoch(peer, epoch) {
			using = append(using, r)
		}
	}
	if routine && len(using) == 0 {
		m.log.Info("fencing the data path of a prefill rank that left (no room uses it)", "peer", peerLabel(peer), "epoch", epoch, "why", why)
	} else {
		m.log.Warn("fencing the data path of a prefill rank", "peer", peerLabel(peer), "epoch", epoch, "rooms", len(using), "why", why)
	}
	cause := fmt.Errorf("%w: data path to prefill %s (epoch %d) fenced: %s", transport.ErrPeerLost, peer, epoch, why)
	for _, r := range using {
		r.failLocal(cause)
	}
	go func() {
		defer m.wg.Done()
		defer close(done)
		for attempt := 0; ; attempt++ {
			err := m.fenceTransports(peer, epoch)
			if err == nil {
				break
			}
			if attempt == 0 || attempt%30 == 0 {
				m.log.Warn("data path not fenced yet; the rooms that used it stay quarantined", "peer", peerLabel(peer), "epoch", epoch, "err", err)
			}
			select {
			case <-m.done:
				return
			case <-time.After(fenceRetry):
			}
		}
		m.met.fence(RoleDecode, "fenced")
		m.mu.Lock()
		rs = rs[:0]
		for _, r := range m.dec.receivers {
			rs = append(rs, r)
		}
		m.mu.Unlock()
		for _, r := range rs {
			r.epochFenced(peer, epoch)
		}
		m.log.Info("data path fenced", "peer", peerLabel(peer), "epoch", epoch)
	}()
}

// fenceTransports calls FenceEpoch on every transport (each may have carried
// the epoch's segment). A transport that does not implement Fencer (none of
// kvxfer's) cannot be fenced: it is skipped with a warning, so for it the
// producer's ABORT_ACK is the only protection.
func (m *Manager) fenceTransports(peer string, epoch uint64) error {
	var errs []error
	for _, rs := range m.regs {
		f, ok := rs.t.(transport.Fencer)
		if !ok {
			m.log.Warn("transport cannot fence a data path (no engine.Fencer); a failed room's pages are reused without it", "transport", rs.t.Name(), "peer", peerLabel(peer), "epoch", epoch)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), fenceRetry)
		err := f.FenceEpoch(ctx, peer, epoch)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", rs.t.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// epochFencing reports whether the data path (peer, epoch) is being (or was)
// fenced.
func (m *Manager) epochFencing(peer string, epoch uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dec.fenceOps[epochKey{peer, epoch}] != nil
}

// admitEpoch admits a new registration's epoch on transport t when it
// fences, before REGISTER names it.
func (m *Manager) admitEpoch(t transport.Transport, peer string, epoch uint64) error {
	if f, ok := t.(transport.Fencer); ok {
		if err := f.AdmitEpoch(peer, epoch); err != nil {
			return fmt.Errorf("engine: %s: admit data-path epoch %d for prefill %s: %w", t.Name(), epoch, peer, err)
		}
	}
	return nil
}

// goTracked runs f in a goroutine the manager's Close waits for; it does
// nothing once the manager is closing.
func (m *Manager) goTracked(f func()) {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		f()
	}()
}

// pruneFenceState drops remembered verdicts, closed-sender memos and
// finished fence operations older than their time to live; m.mu held.
func (m *Manager) pruneFenceStateLocked(now time.Time) {
	ttl := m.verdictTTL()
	for len(m.dec.verdictOrder) > 0 {
		room := m.dec.verdictOrder[0]
		if v, ok := m.dec.verdicts[room]; ok && now.Sub(v.at) <= ttl {
			break // in order of first decision
		}
		delete(m.dec.verdicts, room)
		m.dec.verdictOrder = m.dec.verdictOrder[1:]
	}
	if cap(m.dec.verdictOrder) > 2*len(m.dec.verdictOrder)+1024 {
		m.dec.verdictOrder = append([]uint64(nil), m.dec.verdictOrder...)
	}
	for len(m.pre.recentOrder) > 0 {
		room := m.pre.recentOrder[0]
		if a, ok := m.pre.recent[room]; ok && now.Sub(a.at) <= m.cfg.BootstrapTimeout {
			break // in order of closing (a room closed again moves nothing)
		}
		delete(m.pre.recent, room)
		m.pre.recentOrder = m.pre.recentOrder[1:]
	}
	if cap(m.pre.recentOrder) > 2*len(m.pre.recentOrder)+1024 {
		m.pre.recentOrder = append([]uint64(nil), m.pre.recentOrder...)
	}
	for k, done := range m.dec.fenceOps {
		select {
		case <-done:
			delete(m.dec.fenceOps, k)
		default:
		}
	}
}
