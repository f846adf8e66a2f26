package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Decode heartbeat to the bootstrap servers (spec §4.4, SGLang's
// _start_heartbeat_checker_thread): every resolved bootstrap address gets
// GET /health each interval; after MaxFailure consecutive failures the
// address is treated as dead.
const (
	// DefaultBootstrapHeartbeatInterval is SGLang's
	// SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL default (5 s).
	DefaultBootstrapHeartbeatInterval = 5 * time.Second
	// DefaultBootstrapHeartbeatMaxFailure is SGLang's
	// SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE default (2).
	DefaultBootstrapHeartbeatMaxFailure = 2
	// maxHealthTimeout bounds one GET /health (SGLang: connect 2 s, read 3 s).
	maxHealthTimeout = 3 * time.Second
	// minHealthTimeout keeps a short test interval from timing out a
	// healthy but loaded server.
	minHealthTimeout = 500 * time.Millisecond
)

// ErrBootstrapLost: the decode's heartbeat to a bootstrap server failed
// MaxFailure times in a row, so the prefill instance behind it is treated
// as dead (its cached bootstrap info is dropped and its waiting rooms
// fail). Errors wrapping it also wrap ErrPeerLost.
var ErrBootstrapLost = errors.New("engine: bootstrap server lost")

// bootstrapHeartbeatSettings fills the heartbeat interval and failure
// threshold: a zero interval is DefaultBootstrapHeartbeatInterval (5 s), a
// negative one disables the heartbeat (returned as is); a zero threshold is
// DefaultBootstrapHeartbeatMaxFailure (2), a negative one 1. The SGLang environment
// variables are read by the callers' edges (internal/sglangenv).
func bootstrapHeartbeatSettings(interval time.Duration, maxFail int) (time.Duration, int) {
	if interval == 0 {
		interval = DefaultBootstrapHeartbeatInterval
	}
	if maxFail == 0 {
		maxFail = DefaultBootstrapHeartbeatMaxFailure
	}
	return interval, max(maxFail, 1)
}

// startHeartbeatLocked runs the bootstrap heartbeat for inst, which the caller
// has just put in m.dec.bcache; the caller holds m.mu and has checked that the
// manager is not closed.
func (m *Manager) startHeartbeatLocked(inst *instanceInfo) {
	if m.cfg.BootstrapHeartbeatInterval < 0 {
		return
	}
	m.dec.hbWG.Add(1)
	go m.heartbeat(inst)
}

// heartbeat checks inst's bootstrap server every interval until the manager
// closes or inst leaves the cache (dropped on peer loss, or by this loop
// after MaxFailure consecutive failures).
func (m *Manager) heartbeat(inst *instanceInfo) {
	defer m.dec.hbWG.Done()
	every := m.cfg.BootstrapHeartbeatInterval
	timeout := min(max(every, minHealthTimeout), maxHealthTimeout)
	t := time.NewTicker(every)
	defer t.Stop()
	// base ends when the manager closes, so Close never waits out a check.
	base, stopBase := context.WithCancel(context.Background())
	defer stopBase()
	go func() {
		select {
		case <-m.done:
			stopBase()
		case <-base.Done():
		}
	}()
	fails := 0
	for {
		select {
		case <-m.done:
			return
		case <-t.C:
		}
		m.mu.Lock()
		current := m.dec.bcache[inst.addr] == inst
		m.mu.Unlock()
		if !current {
			return
		}
		ctx, cancel := context.WithTimeout(base, timeout)
		err := inst.client.Health(ctx)
		cancel()
		if err == nil {
			if fails > 0 {
				m.log.Info("bootstrap server answers again", "bootstrap", inst.addr, "failed_checks", fails)
			}
			fails = 0
			continue
		}
		select {
		case <-m.done:
			return
		default:
		}
		fails++
		m.met.heartbeatFailed("bootstrap")
		m.log.Debug("bootstrap health check failed", "bootstrap", inst.addr, "consecutive", fails, "err", err)
		if fails >= m.cfg.BootstrapHeartbeatMaxFailure {
			m.met.peerLost(m.cfg.Role, "bootstrap")
			m.bootstrapLost(inst, fails, err)
			return
		}
	}
}

// bootstrapLost handles a dead bootstrap address like SGLang's
// _handle_node_failure (spec §4.4): the address's cached bootstrap info and
// its connection keys (the registrations with the prefill ranks it named)
// are dropped, so a later request resolves and registers afresh, and every
// receiver of that address not yet Success fails (sticky) with an error
// wrapping ErrBootstrapLost and ErrPeerLost; their producers get a
// best-effort ABORT so they stop writing into the pages.
func (m *Manager) bootstrapLost(inst *instanceInfo, fails int, last error) {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	if m.dec.bcache[inst.addr] == inst {
		delete(m.dec.bcache, inst.addr)
	}
	inst.mu.Lock()
	for _, ep := range inst.ranks {
		delete(m.dec.ppeers, ep)
	}
	inst.mu.Unlock()
	var rs []*Receiver
	for _, r := range m.dec.receivers {
		if r.addr == inst.addr {
			rs = append(rs, r)
		}
	}
	m.mu.Unlock()
	failed := 0
	for _, r := range rs {
		err := fmt.Errorf("%w (%w): room %d: bootstrap server %s failed %d consecutive health checks (GET /health every %s); last error: %v; the prefill instance is treated as dead: retry the request once it is back",
			ErrBootstrapLost, transport.ErrPeerLost, r.room, inst.addr, fails, m.cfg.BootstrapHeartbeatInterval, last)
		if r.failLocal(err) {
			failed++
			r.mu.Lock()
			ts := r.targets
			r.mu.Unlock()
			for _, t := range ts {
				// After a TRANSFER being sent to it (Receiver.sendMu), as
				// failLocal's own ABORTs.
				r.sendMu.Lock()
				_ = m.send(t.endpoint, (&control.AbortMsg{Room: r.room, Endpoint: m.endpoint, Reason: "decode lost the bootstrap server " + inst.addr, Attempt: r.attempt}).Encode(), true)
				r.sendMu.Unlock()
			}
		}
	}
	m.log.Warn("bootstrap server lost: cached bootstrap info dropped", "bootstrap", inst.addr, "consecutive_failures", fails, "failed_rooms", failed, "err", last)
}
