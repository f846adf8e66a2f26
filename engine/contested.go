package engine

import (
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// Contested registrations (prefill). A REGISTER from another instance than
// the one registered at its endpoint replaces that registration only once
// the registered instance is gone (trust.go: a stray or forged REGISTER must
// not take a live decode's state, issue 22 case 4). But "gone" is often not
// known yet when the REGISTER is read: a decode restarted on the same fixed
// control port (a pod or systemd restart) registers within milliseconds of
// its old incarnation's exit, and the prefill may read that REGISTER before
// its monitor reported the old connection's drop, or while the drop is still
// being judged (ctlreset.go); the old instance was heard from moments ago. A
// REGISTER refused then used to be dropped without an answer and never looked
// at again, so the new incarnation's first room failed at its bootstrap
// timeout ("did not answer REGISTER").
//
// So such a REGISTER is held (the latest one per endpoint) and decided
// again each heartbeat, whenever a dropped connection to the endpoint has
// been judged, and when the endpoint's peer is lost:
//
//   - taken, as a REGISTER of a new decode, once the registration it
//     contests is gone (peer lost: disconnected, silent for PeerTimeout,
//     replaced);
//   - taken, replacing the registration, once the registered instance is
//     judged gone: its control connection was reset and nothing came from
//     it since (resetUnheardLocked), or its connection dropped after it
//     registered and nothing came from it for contestQuiet since the drop
//     (judged against the drained inbox, as silence is: a loaded prefill
//     first reads what is queued). Frames of the contender itself never
//     count for the registered instance (checkSender drops them, quietly
//     while its REGISTER is held);
//   - refused with a REGISTER_ACK that says why, once the registered
//     instance was heard from more than contestQuiet after both the hold
//     began and its last drop, in a frame read after the inbox had been
//     emptied since the hold began (not one its exited process queued
//     before): it is alive and talking, and two processes claim the
//     address. A live decode PINGs every HeartbeatInterval, so a
//     forged REGISTER is refused within a few heartbeats, and the decode it
//     claims keeps its pair;
//   - refused, in any case, after the prefill's BootstrapTimeout.
//
// A decode restarted on the same port thus gets its REGISTER_ACK about as
// soon as the prefill has judged the old connection's drop (at most about
// PeerTimeout when no drop is seen at all), and a refused one fails its room
// at once naming both instances.

// heldRegister is a REGISTER from another instance than the one registered
// at its endpoint, held while that one may be gone (see above).
type heldRegister struct {
	v   *control.RegisterMsg
	env control.Envelope
	// since is when it was read; drained, once set, a moment after it at
	// which the receive loop had emptied its inbox: a frame of the
	// registered instance dispatched later was not already queued when
	// the REGISTER was read (a loaded loop may read an exited process's
	// last frames long after its successor's REGISTER).
	since, drained time.Time
}

// contestQuiet is how long a registered decode whose control connection
// dropped must stay unheard before a REGISTER of another instance at its
// endpoint replaces it, and how long after a hold began a registered
// decode heard from again counts as alive: three heartbeats (a live decode
// PINGs every HeartbeatInterval), at least 100 ms.
func (m *Manager) contestQuiet() time.Duration {
	return max(3*m.cfg.HeartbeatInterval, 100*time.Millisecond)
}

// registeredGoneLocked reports whether the registered decode old at ep is
// judged gone although it was heard from within the peer timeout: its
// connection was reset and nothing came from it since, or its connection
// dropped after it registered and nothing came from it for contestQuiet
// after the drop, before the inbox was last drained; m.mu held.
func (m *Manager) registeredGoneLocked(ep string, old *decodePeer) bool {
	if m.resetUnheardLocked(ep) {
		return true
	}
	dropped := m.droppedAtLocked(ep)
	if dropped.IsZero() || dropped.Before(old.regAt) {
		return false
	}
	last := m.lastSeen[ep]
	if last.Before(dropped) {
		last = dropped
	}
	drained := time.Unix(0, m.drainedAt.Load())
	return drained.Sub(last) > m.contestQuiet()
}

// droppedAtLocked returns when the control connection to ep last dropped
// (zero when it did not, or there is no socket); m.mu held.
func (m *Manager) droppedAtLocked(ep string) time.Time {
	ps := m.push[ep]
	if ps == nil {
		return time.Time{}
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return ps.droppedAt
}

// contestRefusalLocked says why the held REGISTER of h is refused now ("" to
// hold it on), with the registration old it contests, and sets h.drained
// once the inbox was emptied after h.since; m.mu held.
func (m *Manager) contestRefusalLocked(h *heldRegister, old *decodePeer, now time.Time) string {
	ep := h.v.Endpoint
	quiet := m.contestQuiet()
	if d := time.Unix(0, m.drainedAt.Load()); h.drained.IsZero() && d.After(h.since) {
		h.drained = d
	}
	from := h.since
	if d := m.droppedAtLocked(ep); d.After(from) {
		from = d
	}
	if seen := m.lastSeen[ep]; !h.drained.IsZero() && seen.After(h.drained) && seen.Sub(from) > quiet {
		return fmt.Sprintf("decode endpoint %s is registered on prefill %s by instance %s, which is alive: it was heard from %s after this REGISTER from instance %s arrived (held %s). Two processes claim that address (a stray or forged REGISTER, or two decode ranks with the same control address): give each decode rank its own control address (ManagerConfig.ControlPort and AdvertiseHost, kvx_kv_config.control_port, --advertise-host), or stop the other process; a REGISTER from another instance replaces a registration only once its instance is gone",
			ep, m.endpoint, old.id, seen.Sub(h.since).Round(time.Millisecond), control.SenderID(h.env), now.Sub(h.since).Round(time.Millisecond))
	}
	if now.Sub(h.since) > m.cfg.BootstrapTimeout {
		return fmt.Sprintf("decode endpoint %s is registered on prefill %s by instance %s, which was not judged gone within the prefill's bootstrap timeout %s (this REGISTER is from instance %s): stop the other process, or give each decode rank its own control address",
			ep, m.endpoint, old.id, m.cfg.BootstrapTimeout, control.SenderID(h.env))
	}
	return ""
}

// holdRegisterLocked holds h (see above); a held REGISTER of the same
// instance with a newer epoch is kept instead; m.mu held.
func (m *Manager) holdRegisterLocked(h *heldRegister) {
	ep := h.v.Endpoint
	if o := m.pre.held[ep]; o != nil && control.SenderID(o.env).Is(control.SenderID(h.env)) && o.v.Epoch > h.v.Epoch {
		return
	}
	m.pre.held[ep] = h
}

// heldContenderLocked reports whether id is the instance whose REGISTER for
// ep is held; m.mu held.
func (m *Manager) heldContenderLocked(ep string, id control.PeerID) bool {
	h := m.pre.held[ep]
	return h != nil && control.SenderID(h.env).Is(id)
}

// reviewHeldRegisters decides the held REGISTERs again, of endpoint ep, or
// all when ep is "" (see above). Safe from any goroutine but the caller's
// holding m.mu.
func (m *Manager) reviewHeldRegisters(ep string) {
	if m.cfg.Role != RolePrefill {
		return
	}
	m.mu.Lock()
	var hs []*heldRegister
	for e, h := range m.pre.held {
		if ep == "" || e == ep {
			hs = append(hs, h)
			delete(m.pre.held, e)
		}
	}
	closed := m.closed
	m.mu.Unlock()
	if closed {
		return
	}
	for _, h := range hs {
		m.admitRegister(h.v, h.env, h)
	}
}
