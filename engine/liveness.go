package engine

import (
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// Control-channel liveness. A peer is alive while its control loop answers:
// every HeartbeatInterval each rank PINGs every peer it has rooms or a
// registration with, and a peer from which nothing arrived for PeerTimeout
// is lost (its rooms fail). Two rules keep a slow but alive process from
// being taken for a hung one, and keep a starved process from blaming its
// peers for its own stall (issue 18: under load average 10–15 on two cores,
// rooms failed with "silent for more than 10s" on both sides):
//
//   - Silence is judged against the inbox, not the wall clock. A peer is
//     silent only when nothing came from it for PeerTimeout before the last
//     moment this rank's receive loop found its inbox empty (drainedAt). A
//     process that was itself descheduled, or whose receive loop was busy,
//     first reads what its peers sent meanwhile; until it has, it judges
//     nobody (and warns once the stall exceeds PeerTimeout).
//   - A rank PINGs only while its own receive loop makes progress (it
//     returned from a receive or a dispatch within PeerTimeout/2), from a
//     goroutine of its own, so pings are never queued behind other work
//     and never claim liveness for a control loop that is stuck. A
//     SIGSTOPped or hung peer therefore still fails its rooms within about
//     PeerTimeout.
//
// What must not starve the loop: control handlers do no blocking work inline
// (segment opening, closing and ring reads run on their own goroutines), and
// bulk copies yield the processor between pieces (engine/shm), since a
// runtime.memmove cannot be preempted and copy goroutines as many as
// GOMAXPROCS would otherwise hold every P for a whole batch.

// inboxDrained returns when the receive loop last found the inbox empty, and
// logs when that is longer ago than PeerTimeout (this process is starved or
// a handler blocks), once per stall, and when the loop catches up again.
func (m *Manager) inboxDrained(now time.Time) time.Time {
	d := time.Unix(0, m.drainedAt.Load())
	stalled := now.Sub(d) > m.cfg.PeerTimeout
	switch {
	case stalled && !m.stallLogged:
		m.stallLogged = true
		m.log.Warn("control loop has not emptied its inbox for longer than the peer timeout: this process is starved of CPU or a control handler blocks; no peer is declared silent until it catches up",
			"behind", now.Sub(d).Round(time.Millisecond), "peer_timeout", m.cfg.PeerTimeout, "last_progress", time.Unix(0, m.progressAt.Load()).Format(time.RFC3339Nano))
	case !stalled && m.stallLogged:
		m.stallLogged = false
		m.log.Info("control loop caught up with its inbox")
	}
	return d
}

// silent reports whether a peer last heard from at seen is lost: nothing
// came from it for more than PeerTimeout before drained (inboxDrained).
func (m *Manager) silent(seen, drained time.Time) bool {
	return drained.Sub(seen) > m.cfg.PeerTimeout
}

// responsive reports whether this rank's receive loop made progress within
// PeerTimeout/2, i.e. whether its PINGs may vouch for it.
func (m *Manager) responsive(now time.Time) bool {
	return now.Sub(time.Unix(0, m.progressAt.Load())) <= m.cfg.PeerTimeout/2
}

// pingLoop PINGs every peer in lastSeen each HeartbeatInterval while this
// rank's control loop is responsive; it runs apart from monitorLoop, whose
// timeout checks and peer-loss handling may take a while.
func (m *Manager) pingLoop() {
	defer m.wg.Done()
	t := time.NewTicker(m.cfg.HeartbeatInterval)
	defer t.Stop()
	ping := (&control.PingMsg{Endpoint: m.endpoint}).Encode()
	quiet := false
	for {
		select {
		case <-m.done:
			return
		case <-t.C:
		}
		now := time.Now()
		if !m.responsive(now) {
			if !quiet {
				quiet = true
				m.log.Warn("control loop stuck for longer than half the peer timeout: not answering peers' liveness until it moves again (they fail its rooms after the peer timeout)",
					"since", time.Unix(0, m.progressAt.Load()).Format(time.RFC3339Nano))
			}
			continue
		}
		quiet = false
		m.mu.Lock()
		peers := make([]string, 0, len(m.lastSeen))
		for ep := range m.lastSeen {
			peers = append(peers, ep)
		}
		m.mu.Unlock()
		for _, ep := range peers {
			_ = m.send(ep, ping, true)
		}
	}
}
