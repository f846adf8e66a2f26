package engine

import (
	"fmt"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// A decode silent for PeerTimeout (SIGSTOPped, descheduled, a partitioned
// host) loses its registration on the prefill (peerLost, hung true); the
// prefill still waits for its verdicts on the rooms it had written. When
// the decode resumes it does not know: its next room's TRANSFER would meet
// no registration and fail ("TRANSFER before REGISTER"), a healthy room
// lost to a stall that had ended. So the prefill remembers the dropped
// registration's epoch, and the first PING or STATUS it hears from that
// decode once no room of this rank still waits for the decode's verdict
// is answered with the same notice an evicted idle decode gets (a
// REGISTER_ACK of that epoch with EvictedPrefix): the decode drops that
// registration and its next room registers again.

// maxSilentDropped bounds silentDropped (a fleet of decodes that all went
// silent and never came back must not grow it without end).
const maxSilentDropped = 1024

// rememberSilentDropLocked notes that decode ep's registration of epoch
// was dropped for silence; m.mu held.
func (m *Manager) rememberSilentDropLocked(ep string, epoch uint64) {
	if len(m.pre.silentDropped) >= maxSilentDropped {
		for k := range m.pre.silentDropped {
			delete(m.pre.silentDropped, k)
			break
		}
	}
	m.pre.silentDropped[ep] = epoch
}

// noticeSilentDrop tells a decode that is heard from again (PING, STATUS)
// that its registration here was dropped while it was silent, once no
// room of this prefill still waits for its verdict (the notice makes it
// fence that registration's data path). A REGISTER from it forgets the
// drop.
func (m *Manager) noticeSilentDrop(msg any) {
	var ep string
	register := false
	switch v := msg.(type) {
	case *control.PingMsg:
		ep = v.Endpoint
	case *control.StatusMsg:
		ep = v.Endpoint
	case *control.RegisterMsg:
		ep, register = v.Endpoint, true
	default:
		return
	}
	m.mu.Lock()
	epoch, dropped := m.pre.silentDropped[ep]
	if dropped && (register || m.pre.dpeers[ep] != nil) {
		delete(m.pre.silentDropped, ep)
		dropped = false
	}
	var ss []*Sender
	if dropped {
		for _, s := range m.pre.senders {
			ss = append(ss, s)
		}
	}
	m.mu.Unlock()
	if !dropped {
		return
	}
	for _, s := range ss {
		if s.hasDst(ep) && !s.verdictFrom(ep) {
			return // told after its verdicts, so no room in flight is fenced
		}
	}
	m.mu.Lock()
	if e, still := m.pre.silentDropped[ep]; !still || e != epoch || m.pre.dpeers[ep] != nil {
		m.mu.Unlock()
		return
	}
	delete(m.pre.silentDropped, ep)
	geo := *m.geo
	m.mu.Unlock()
	m.log.Info("decode heard from again after its registration was dropped for silence; telling it to register again",
		"decode", peerLabel(ep), "epoch", epoch, "peer_timeout", m.cfg.PeerTimeout)
	ack := &control.RegisterAckMsg{Endpoint: m.endpoint, Geometry: geo, Epoch: epoch,
		Err: fmt.Sprintf("%s: prefill %s heard nothing from this decode for more than its peer timeout (%s) and dropped its registration; the next room registers again",
			EvictedPrefix, m.endpoint, m.cfg.PeerTimeout)}
	m.goTracked(func() { _ = m.send(ep, ack.Encode(), false) })
}
