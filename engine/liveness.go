package engine

import (
	"fmt"
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

// Pauses of this process. A process that ran nothing for a while (SIGSTOP,
// a VM pause, swapping, a host starved of CPU) is taken for dead by its
// peers: they drop its registration and stop pinging it. Once it runs
// again, the silence it then sees is their doing but its own fault, so it
// must not blame them. pauseWatch does nothing but tick every
// HeartbeatInterval and compare the clock (monotonic) with the last tick:
// a tick much later than due means the process did not run.

// selfPause is the last stretch in which this process ran nothing (zero:
// none seen).
type selfPause struct{ from, to time.Time }

// pauseWatch records this process's pauses (notePause) until the manager
// closes.
func (m *Manager) pauseWatch() {
	defer m.wg.Done()
	t := time.NewTicker(m.cfg.HeartbeatInterval)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-m.done:
			return
		case <-t.C:
		}
		now := time.Now()
		m.notePause(last, now)
		last = now
	}
}

// notePause records a tick at now whose previous one was at prev as a
// pause of this process when it came more than PeerTimeout/2 (below that no
// peer can have taken this rank for dead) and 4 ticks late, and logs it.
func (m *Manager) notePause(prev, now time.Time) {
	late := now.Sub(prev) - m.cfg.HeartbeatInterval
	if prev.IsZero() || late <= m.cfg.PeerTimeout/2 || late <= 4*m.cfg.HeartbeatInterval {
		return
	}
	m.pauseMu.Lock()
	m.pause = selfPause{from: prev.Add(m.cfg.HeartbeatInterval), to: now}
	m.pauseMu.Unlock()
	if m.log != nil {
		m.log.Warn("this process ran nothing for longer than half the peer timeout (stopped with SIGSTOP, a paused VM, swapping or a host starved of CPU): its peers may have taken it for dead and dropped its rooms meanwhile",
			"paused", late.Round(time.Millisecond), "from", prev.Add(m.cfg.HeartbeatInterval).Format(time.RFC3339Nano), "peer_timeout", m.cfg.PeerTimeout)
	}
}

// pauseNote is what a peer-loss error declared at now adds when this
// process was itself paused (notePause) shortly before, so the silence is
// most likely the peer's answer to that pause: "" when not.
func (m *Manager) pauseNote(now time.Time) string {
	m.pauseMu.Lock()
	p := m.pause
	m.pauseMu.Unlock()
	if p.to.IsZero() || now.Sub(p.to) > 3*m.cfg.PeerTimeout || now.Before(p.to) {
		return ""
	}
	return fmt.Sprintf("; but this %s rank %s itself ran nothing for %s just before (until %s: stopped with SIGSTOP, a paused VM, swapping or a host starved of CPU), so the peer most likely took it for dead and dropped it: look at what paused this process, not at the peer, and retry the room",
		m.cfg.Role, m.rankName, p.to.Sub(p.from).Round(100*time.Millisecond), p.to.Format("15:04:05.000"))
}
