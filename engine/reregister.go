package engine

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// DefaultDirectoryCheckInterval is how often a prefill rank checks that its
// bootstrap directory still names it (GET /v1/entry), jittered by ±20 %.
const DefaultDirectoryCheckInterval = 2 * time.Second

// newInstanceID returns a random 24-hex-character instance id.
func newInstanceID() (string, error) {
	var b [12]byte
	if _, err := crand.Read(b[:]); err != nil {
		return "", fmt.Errorf("engine: instance id: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// InstanceID returns this rank's instance id: random per Manager (or
// ManagerConfig.InstanceID), published in a prefill's directory entry
// (instance_id) and used to make its deregistration conditional. Peers use
// it to tell this process from another at the same endpoint.
func (m *Manager) InstanceID() string { return m.instanceID }

// Epoch returns this rank's epoch: its start time in Unix nanoseconds, so
// an instance that replaces another at the same coordinates (a rolling
// restart) has the higher one. Published in the directory entry.
func (m *Manager) Epoch() uint64 { return m.epoch }

// checkDeclarations validates (and canonicalises) what a prefill rank
// declares in its registration besides its place: the decode allocation
// policy, the HTTP API port and the DSpark layout.
func checkDeclarations(cfg *ManagerConfig) error {
	switch cfg.DecodeAllocationPolicy {
	case "", bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete:
	default:
		return fmt.Errorf("engine: manager: decode allocation policy %q: want %q (the default) or %q, as the decode's --disaggregation-decode-allocation-policy",
			cfg.DecodeAllocationPolicy, bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete)
	}
	if cfg.PrefillHTTPPort < 0 || cfg.PrefillHTTPPort > 65535 {
		return fmt.Errorf("engine: manager: prefill HTTP port (prefill_http_port) %d: want 1–65535 (SGLang's --port), or 0 for none", cfg.PrefillHTTPPort)
	}
	l, err := bootstrap.CanonicalSpecLayout(cfg.DSV41SpecLayout)
	if err != nil {
		return fmt.Errorf("engine: manager: DSpark layout (dsv41_spec_layout): %w", err)
	}
	cfg.DSV41SpecLayout = l
	return nil
}

// registerRequest is this prefill rank's PUT /route body.
func (m *Manager) registerRequest() bootstrap.RegisterRequest {
	l := m.geo
	dtype := m.cfg.KVCacheDtype
	r := bootstrap.RegisterRequest{
		AttnTPSize: l.TPSize, AttnTPRank: l.TPRank, AttnCPSize: 1, AttnCPRank: 0,
		AttnDPSize: m.cfg.DPSize, AttnDPRank: m.cfg.DPRank, PPSize: l.PPSize, PPRank: l.PPRank,
		SystemDPSize: 1, SystemDPRank: m.cfg.DPRank, // as SGLang files DP attention
		RankIP: m.host, RankPort: m.port, PageSize: l.PageSize, KVCacheDtype: &dtype,
		InstanceID: m.instanceID, Epoch: m.epoch,
		DecodeAllocationPolicy: m.cfg.DecodeAllocationPolicy, DSV41SpecLayout: m.cfg.DSV41SpecLayout,
	}
	if port := m.cfg.PrefillHTTPPort; port > 0 {
		r.PrefillHTTPPort = &port
	}
	if every := m.cfg.DirectoryCheckInterval; every > 0 {
		// The directory check (watchDirectory) is the check-in.
		r.HeartbeatMS = int(min(max(every/time.Millisecond, 1), bootstrap.MaxHeartbeatMS))
	}
	return r
}

// coord is this prefill rank's directory coordinates.
func (m *Manager) coord() bootstrap.Coord {
	return bootstrap.Coord{DP: m.cfg.DPRank, CP: 0, TP: m.geo.TPRank, PP: m.geo.PPRank}
}

func (m *Manager) registerBootstrap(ctx context.Context) error {
	if err := m.pre.dir.Register(ctx, m.registerRequest()); err != nil {
		return fmt.Errorf("engine: prefill rank tp=%d pp=%d: %w", m.geo.TPRank, m.geo.PPRank, err)
	}
	return nil
}

// startDirectoryWatch starts the prefill's directory check (see
// watchDirectory) unless disabled.
func (m *Manager) startDirectoryWatch() {
	m.pre.watchStop, m.pre.watchDone = make(chan struct{}), make(chan struct{})
	if m.cfg.DirectoryCheckInterval < 0 {
		close(m.pre.watchDone)
		return
	}
	go m.watchDirectory()
}

// stopDirectoryWatch stops the check and waits for it (idempotent), so a
// deregistration that follows cannot be undone by a re-registration.
func (m *Manager) stopDirectoryWatch() {
	if m.pre.watchStop == nil {
		return
	}
	select {
	case <-m.pre.watchStop:
	default:
		close(m.pre.watchStop)
	}
	<-m.pre.watchDone
}

// watchDirectory makes a prefill rank notice a directory that lost it and
// register again (issue 18): every DirectoryCheckInterval (±20 %) it reads
// its entry (GET /v1/entry), naming its instance so that the read is also
// its check-in (the heartbeat its registration declared). An absent entry (the directory restarted, or
// the entry was removed) or one naming an older instance is re-registered
// at once; one naming a newer instance means this rank was replaced (a
// rolling restart): it says so and stops checking, leaving the successor
// in place. A directory without /v1/entry (SGLang's) is re-registered once
// each time it answers again after failing, i.e. after a restart.
func (m *Manager) watchDirectory() {
	defer close(m.pre.watchDone)
	every := m.cfg.DirectoryCheckInterval
	down := false // the last check could not reach the directory
	var last time.Time
	for {
		t := time.NewTimer(time.Duration(float64(every) * (0.8 + 0.4*rand.Float64())))
		select {
		case <-m.pre.watchStop:
			t.Stop()
			return
		case <-m.done:
			t.Stop()
			return
		case <-m.pre.checkNow:
			// Brought forward (wrongpeer.go), at most every
			// checkNowSpacing however many TRANSFERs ask.
			t.Stop()
			t = time.NewTimer(max(checkNowSpacing-time.Since(last), 0))
			select {
			case <-m.pre.watchStop:
				t.Stop()
				return
			case <-m.done:
				t.Stop()
				return
			case <-t.C:
			}
		case <-t.C:
		}
		last = time.Now()
		ctx, cancel := context.WithTimeout(m.life, max(2*every, 2*time.Second))
		stop, reached := m.checkDirectory(ctx, down)
		cancel()
		down = !reached
		if stop {
			return
		}
	}
}

// checkDirectory runs one check; it reports whether to stop checking (this
// rank was replaced) and whether the directory answered.
func (m *Manager) checkDirectory(ctx context.Context, wasDown bool) (stop, reached bool) {
	at := m.coord()
	e, err := m.pre.dir.CheckIn(ctx, at, m.instanceID)
	switch {
	case err == nil && e.InstanceID == m.instanceID:
		if wasDown {
			m.log.Info("bootstrap directory answers again and still names this rank", "bootstrap", m.pre.dir.Addr())
		}
		return false, true
	case err == nil && e.Epoch > m.epoch:
		m.log.Warn("this rank was replaced in the bootstrap directory by a newer instance; it gets no new rooms and stops re-registering (stop this process)",
			"bootstrap", m.pre.dir.Addr(), "rank", at.String(), "successor", e.InstanceID, "successor_epoch", e.Epoch,
			"successor_endpoint", e.Endpoint(), "instance", m.instanceID, "epoch", m.epoch)
		m.markReplaced(fmt.Sprintf("its bootstrap directory %s names instance %s at %s for rank %s", m.pre.dir.Addr(), e.InstanceID, e.Endpoint(), at))
		return true, true
	case err == nil:
		return m.reregister(ctx, fmt.Sprintf("the entry names an older instance %q at %s", e.InstanceID, e.Endpoint())), true
	case errors.Is(err, bootstrap.ErrNotFound):
		return m.reregister(ctx, "the directory has no entry for this rank (restarted, or the entry was removed)"), true
	case errors.Is(err, bootstrap.ErrUnsupported):
		if wasDown {
			return m.reregister(ctx, "the directory (without GET /v1/entry) answers again after failing: it may have restarted"), true
		}
		return false, true
	}
	var se *bootstrap.StatusError
	if errors.As(err, &se) {
		m.log.Warn("bootstrap directory check failed", "bootstrap", m.pre.dir.Addr(), "err", err)
		return false, true
	}
	if !wasDown {
		m.log.Warn("bootstrap directory unreachable; will register again when it answers", "bootstrap", m.pre.dir.Addr(), "err", err)
	}
	return false, false
}

// reregister PUTs this rank's entry again; it reports whether to stop
// checking (the directory says a newer instance holds the coordinates).
func (m *Manager) reregister(ctx context.Context, why string) (stop bool) {
	t := time.Now()
	err := m.pre.dir.Register(ctx, m.registerRequest())
	switch {
	case err == nil:
		m.log.Info("registered again with the bootstrap directory", "bootstrap", m.pre.dir.Addr(), "why", why, "took", time.Since(t).Round(time.Millisecond))
		m.pre.reregs.Add(1)
		return false
	case errors.Is(err, bootstrap.ErrReplaced):
		m.log.Warn("this rank was replaced in the bootstrap directory by a newer instance; it stops re-registering (stop this process)",
			"bootstrap", m.pre.dir.Addr(), "err", err)
		m.markReplaced(fmt.Sprintf("its bootstrap directory %s holds a newer instance for rank %s (%v)", m.pre.dir.Addr(), m.coord(), err))
		return true
	}
	m.log.Warn("registering again with the bootstrap directory failed; retrying at the next check", "bootstrap", m.pre.dir.Addr(), "why", why, "err", err)
	return false
}

// Reregistrations returns how many times this prefill rank registered again
// after noticing the directory had lost it.
func (m *Manager) Reregistrations() int64 { return m.pre.reregs.Load() }
