package engine

import (
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Control connections that are reset (issue 22 case 3). A rank's PUSH
// socket to a peer reports EVENT_DISCONNECTED both when the peer's process
// died and when only the TCP connection was reset while both processes live
// (ss -K, a middlebox's idle timeout, a NAT rebinding). ZeroMQ reconnects
// the second on its own within its reconnect interval (100 ms), so it must
// not cost a room: treating it as a lost peer dropped the decode's
// registration on the prefill while the decode kept using it, and its next
// room failed with "TRANSFER before REGISTER". connectionDropped tells the
// two apart:
//
//   - it dials the peer's control endpoint once: refused, unreachable or
//     timed out (1 s) means the process is gone, and the peer is lost at
//     once, as before (its rooms fail, a prefill's written rooms wait for a
//     verdict already on its way, verdicts.go);
//   - a peer that accepts the dial is alive; the drop is a reset if ZeroMQ
//     reconnects within resetReconnectWait: registrations, data paths and
//     rooms stay as they are, the frames ZeroMQ still queues go out on the
//     new connection, and the frames the reset destroyed are the ones a room
//     already repairs (a STATUS or verdict is asked for again, a PING lost
//     costs nothing). A decode drops its cached directory entries naming the
//     peer so that the next room looks the rank up again: a process that
//     took over the address is then told apart by its instance id
//     (ensureRegistered). A peer that does not reconnect in time is lost.
//
// A REGISTER from another instance for an endpoint whose connection was
// reset and that was not heard from since replaces the registration at once
// (registerRefusalLocked): the old process may have been replaced at the
// same port, which the dial cannot tell from a reset. One read while the
// drop is still being judged is held and decided again once it is
// (contested.go).

// resetReconnectWait bounds how long a dropped control connection to a peer
// that still listens may take to reconnect before the peer is lost.
const resetReconnectWait = 2 * time.Second

// connectionDropped judges a dropped control connection to ep (see above)
// and reports whether the peer was declared lost.
func (m *Manager) connectionDropped(ep string, ps *pushSock) bool {
	lost := func(why string) bool {
		m.met.peerLost(m.cfg.Role, "disconnected")
		m.peerLost(ep, false, fmt.Errorf("%w: %s disconnected (process exited or was killed%s)", transport.ErrPeerLost, m.peerName(ep), why))
		return true
	}
	// A reset of the probe's own dial is no sign the process is gone: it
	// leaves the peer the reconnect wait below (a chaos soak's ss -K reset
	// a probe, and a live decode's room was failed on the prefill alone).
	if why, gone := dialProbeGone(ep); gone {
		return lost(": " + why)
	}
	ps.mu.Lock()
	dropped := ps.droppedAt
	ps.mu.Unlock()
	deadline := time.NewTimer(resetReconnectWait)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		ps.mu.Lock()
		healed := ps.connectedAt.After(dropped)
		closed := ps.sock == nil
		ps.mu.Unlock()
		if closed {
			return false
		}
		if healed {
			break
		}
		select {
		case <-m.done:
			return false
		case <-deadline.C:
			return lost(fmt.Sprintf(": it accepted a connection, but the control socket did not reconnect within %s", resetReconnectWait))
		case <-tick.C:
		}
	}
	m.mu.Lock()
	m.resetAt[ep] = time.Now()
	for addr, inst := range m.dec.bcache {
		if inst.names(ep) {
			delete(m.dec.bcache, addr)
		}
	}
	m.mu.Unlock()
	m.log.Info("control connection reset and reconnected; the peer stays (its rooms and registration are kept)", "peer", peerLabel(ep), "took", time.Since(dropped).Round(time.Millisecond))
	return false
}

// resetUnheardLocked reports whether the control connection to ep was reset
// and nothing came from ep since; m.mu held.
func (m *Manager) resetUnheardLocked(ep string) bool {
	at, ok := m.resetAt[ep]
	return ok && !m.lastSeen[ep].After(at)
}
