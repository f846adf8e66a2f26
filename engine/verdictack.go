package engine

import (
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// Acknowledged Success verdicts (protocol 8, issue 22 case 1). A decode's
// Success verdict (STATUS Success to each producer) can be lost: a dropped
// frame, a control reset, a re-answer still in its goroutine when the
// decode's process exits. A producer that misses it asks again every
// verdictAsk, which is enough while the decode lives, but not when the
// decode closes right after deciding: the prefill then fails the room
// ("peer lost", after verdictGrace) while the decode reported Success.
//
//   - A decode records every Success verdict it sends, per room and
//     producer, until the producer's VERDICT_ACK for it comes (decodeSide
//     unacked). A producer that asks again refreshes the record.
//   - A prefill answers every Success verdict it receives with VERDICT_ACK
//     (duplicates too: its acknowledgement may be lost as well), saying
//     whether the verdict counted or the room had already failed there.
//   - Manager.Close, after the verdicts decided before it were handed to
//     their sockets and while its receive loop still runs, re-sends the
//     unacknowledged verdicts every verdictResend until each is
//     acknowledged, for at most verdictAckWait. A verdict still
//     unacknowledged then is logged at Error: its producer may already be
//     gone (killed before the decode noticed); if it is alive, it fails
//     the room (peer lost, after verdictGrace) unless a copy still
//     reaches it.
//
// A verdict whose record was not refreshed for verdictAckKeep is no longer
// waited for: its producer stopped asking (it received the verdict and its
// acknowledgement was lost, gave up, or went away). Neither are those of a
// producer the decode saw go (Manager.peerLost).

// verdictAckWait bounds how long Close waits for the acknowledgements of
// the Success verdicts it sent (after waiting up to verdictFlush for their
// sends).
const verdictAckWait = verdictFlush

// verdictResend is how often Close re-sends an unacknowledged verdict.
const verdictResend = 100 * time.Millisecond

// verdictAckKeep is how long an unacknowledged verdict is kept after it
// was last sent (a producer that still waits asks again every verdictAsk).
const verdictAckKeep = 10 * verdictAsk

// maxUnacked bounds the unacknowledged verdicts a decode keeps.
const maxUnacked = 100_000

// verdictKey names one producer's verdict of one room.
type verdictKey struct {
	room uint64
	ep   string
}

// unackedVerdict is a Success verdict sent and not yet acknowledged: the
// registration epoch and decode attempt it was sent for, when it was first
// and last sent.
type unackedVerdict struct {
	epoch, attempt uint64
	first, last    time.Time
}

// sendSuccessVerdict (decode) records room's Success verdict for producer
// ep as unacknowledged and sends it; epoch is the registration the verdict
// names, attempt the decode attempt that decided it. It reports whether the
// frame was handed to the control socket.
func (m *Manager) sendSuccessVerdict(ep string, room, epoch, attempt uint64) bool {
	m.noteUnacked(ep, room, epoch, attempt)
	return m.sendVerdict(ep, room, true, "", epoch)
}

// noteUnacked records (or refreshes) an unacknowledged Success verdict.
func (m *Manager) noteUnacked(ep string, room, epoch, attempt uint64) {
	now := time.Now()
	k := verdictKey{room, ep}
	m.mu.Lock()
	defer m.mu.Unlock()
	if u := m.dec.unacked[k]; u != nil && u.epoch == epoch && u.attempt == attempt {
		u.last = now
		return
	}
	if m.dec.unacked[k] == nil {
		m.dec.unackedOrder = append(m.dec.unackedOrder, k)
	}
	m.dec.unacked[k] = &unackedVerdict{epoch: epoch, attempt: attempt, first: now, last: now}
	// Expire from the front: the oldest first sends.
	for len(m.dec.unackedOrder) > 0 {
		f := m.dec.unackedOrder[0]
		u := m.dec.unacked[f]
		if u != nil && len(m.dec.unacked) <= maxUnacked && now.Sub(u.last) < verdictAckKeep {
			break
		}
		m.dec.unackedOrder = m.dec.unackedOrder[1:]
		if u != nil {
			delete(m.dec.unacked, f)
		}
	}
}

// handleVerdictAck (decode): producer v.Endpoint received room v.Room's
// Success verdict. An acknowledgement of another registration or attempt
// than the verdict recorded (a late one of an earlier attempt of the room)
// clears nothing.
func (m *Manager) handleVerdictAck(v *control.VerdictAckMsg) {
	k := verdictKey{v.Room, v.Endpoint}
	m.mu.Lock()
	u := m.dec.unacked[k]
	match := u != nil && (v.Epoch == 0 || u.epoch == 0 || v.Epoch == u.epoch) && (v.Attempt == 0 || u.attempt == 0 || v.Attempt == u.attempt)
	if match {
		delete(m.dec.unacked, k) // its unackedOrder entry goes when it reaches the front
	}
	m.mu.Unlock()
	if !v.Accepted {
		m.log.Error("a prefill had already failed a room this decode verified: the two sides disagree (the decode reported Success)",
			"room", v.Room, "peer", peerLabel(v.Endpoint), "prefill_failure", v.Detail)
	}
	if !match {
		m.log.Debug("VERDICT_ACK of no unacknowledged verdict (a duplicate, or of another attempt)", "room", v.Room, "peer", peerLabel(v.Endpoint), "epoch", v.Epoch, "attempt", v.Attempt)
	}
}

// forgetUnackedLocked (m.mu held) drops the unacknowledged verdicts of
// producer ep, a peer that is gone, and returns how many there were: a
// closing decode does not wait for them.
func (m *Manager) forgetUnackedLocked(ep string) int {
	n := 0
	for k := range m.dec.unacked {
		if k.ep == ep {
			delete(m.dec.unacked, k)
			n++
		}
	}
	return n
}

// pendingAcks returns the unacknowledged verdicts sent within
// verdictAckKeep.
func (m *Manager) pendingAcks(now time.Time) map[verdictKey]unackedVerdict {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[verdictKey]unackedVerdict{}
	for k, u := range m.dec.unacked {
		if now.Sub(u.last) < verdictAckKeep {
			out[k] = *u
		}
	}
	return out
}

// awaitVerdictAcks (decode, Close, receive loop still running) re-sends
// the unacknowledged Success verdicts every verdictResend until each is
// acknowledged or limit passed, and logs each one left at Error. It
// reports whether every one was acknowledged.
func (m *Manager) awaitVerdictAcks(limit time.Duration) bool {
	if m.cfg.Role != RoleDecode {
		return true
	}
	start := time.Now()
	deadline := start.Add(limit)
	for {
		now := time.Now()
		left := m.pendingAcks(now)
		if len(left) == 0 {
			return true
		}
		if !now.Before(deadline) {
			for k, u := range left {
				m.log.Error("closing with a Success verdict its prefill never acknowledged: the prefill may already be gone (killed, or its control connection lost before this decode noticed); if it is alive and no copy of the verdict still reaches it, it reports the room failed (peer lost, after its verdict grace) while this decode reported Success",
					"room", k.room, "peer", peerLabel(k.ep), "epoch", u.epoch, "first_sent", now.Sub(u.first).Round(time.Millisecond).String()+" ago",
					"waited", now.Sub(start).Round(time.Millisecond))
			}
			return false
		}
		for k, u := range left {
			m.sendVerdict(k.ep, k.room, true, "", u.epoch)
		}
		t := time.NewTimer(min(verdictResend, time.Until(deadline)))
		<-t.C
	}
}

// ackVerdict (prefill) answers decode v.Endpoint's Success verdict of
// v.Room with VERDICT_ACK: accepted unless failure (the room's failure here
// before the verdict came, "" when none) says otherwise; attempt is the
// decode attempt the room served (0: none known). Best effort: the decode
// re-sends while it waits.
func (m *Manager) ackVerdict(v *control.StatusMsg, attempt uint64, failure string) {
	ack := &control.VerdictAckMsg{Room: v.Room, Endpoint: m.endpoint, Epoch: v.Epoch, Attempt: attempt, Accepted: failure == "", Detail: failure}
	if !ack.Accepted {
		m.log.Error("the decode's Success verdict came after this prefill failed the room: the two sides disagree",
			"room", v.Room, "peer", peerLabel(v.Endpoint), "failure", failure)
	}
	go func() {
		if err := m.send(v.Endpoint, ack.Encode(), true); err != nil {
			m.log.Debug("VERDICT_ACK not sent (the decode re-sends the verdict while it waits)", "room", v.Room, "peer", peerLabel(v.Endpoint), "err", err)
		}
	}()
}

// goReanswer runs a re-answer of a producer's STATUS (its verdict again)
// from a goroutine of its own, counted in verdictFlight, so that Close
// waits for it too.
func (m *Manager) goReanswer(f func()) {
	m.verdictFlight.add(1)
	go func() {
		defer m.verdictFlight.done(1)
		f()
	}()
}
