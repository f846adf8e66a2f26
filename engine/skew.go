package engine

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// ErrVersionSkew is wrapped when a room fails because a peer speaks another
// control protocol version (engine/internal/control, version.go); the error
// names both versions and both endpoints.
var ErrVersionSkew = errors.New("engine: control protocol version mismatch")

// ControlVersion is the control protocol version this build speaks (frame
// 1 of every control frame; engine/internal/control documents what each
// version changed). Ranks of different versions do not pair: both fail
// the room at once with ErrVersionSkew.
const ControlVersion = control.ControlVersion

// versionAnswerEvery bounds how often a rank answers one endpoint's frames
// of another version with VERSION.
const versionAnswerEvery = time.Second

// version is the control protocol version this rank speaks
// (control.ControlVersion; tests may make a rank speak another).
func (m *Manager) version() int {
	if v := m.ctlVersion.Load(); v != 0 {
		return int(v)
	}
	return control.ControlVersion
}

// skewError words a version mismatch with peer ep speaking v.
func (m *Manager) skewError(ep string, v int) error {
	return fmt.Errorf("%w: %s %s speaks kvxfer control protocol version %d, this %s (%s) speaks version %d; run the same kvxfer release on every prefill and decode rank (upgrade the older side)",
		ErrVersionSkew, m.otherRole(), ep, v, m.cfg.Role, m.endpoint, m.version())
}

// handleForeign handles a control frame of another protocol version (see
// engine/internal/control, version.go): both sides fail at once naming both
// versions, instead of waiting for each other in silence.
//
//   - Unless it is VERSION itself, the sender is answered with VERSION (at
//     most once per versionAnswerEvery per endpoint, and only a REGISTER's
//     sender or a known peer, so frames naming endpoints at random open no
//     sockets).
//   - A decode loses the peer (peerLost with the version error): a
//     registration waiting for its REGISTER_ACK and every room with that
//     producer fail now, and tell the producer.
//   - A prefill fails the room a TRANSFER, ABORT or STATUS names (a room
//     not created yet fails when it is: NewSender), and loses a registered
//     decode that speaks another version.
//
// With control authentication the frame must carry a tag that verifies
// with this rank's key (the envelope of versions 5 and later); anything
// else is dropped as unauthenticated.
func (m *Manager) handleForeign(parts [][]byte, v int) {
	f, err := control.DecodeForeign(parts, v)
	if err != nil {
		m.drop("malformed", err)
		return
	}
	if m.ctlKey != nil && !control.ForeignTagValid(parts, m.ctlKey) {
		m.drop("unauthenticated", fmt.Errorf("%w: %s of protocol version %d from %s: no tag that verifies with this rank's token", control.ErrUnauthenticated, f.Type, v, f.Endpoint))
		return
	}
	if f.Endpoint == "" {
		m.drop("malformed", fmt.Errorf("%w: a %q frame of protocol version %d (this rank speaks %d): type unknown here, nobody to tell", control.ErrBadFrame, f.Type, v, m.version()))
		return
	}
	skew := m.skewError(f.Endpoint, v)
	m.drop("malformed", skew)
	m.mu.Lock()
	known := m.lastSeen[f.Endpoint] != (time.Time{}) || m.pre.dpeers[f.Endpoint] != nil || m.dec.ppeers[f.Endpoint] != nil
	answer := f.Type != control.MsgVersion && (known || f.Type == control.MsgRegister) && time.Since(m.versionTold[f.Endpoint]) >= versionAnswerEvery
	if answer {
		if len(m.versionTold) >= m.cfg.MaxPeers {
			clear(m.versionTold)
		}
		m.versionTold[f.Endpoint] = time.Now()
	}
	var s *Sender
	if m.cfg.Role == RolePrefill && f.HasRoom {
		if s = m.pre.senders[f.Room]; s == nil {
			m.pre.aborted[f.Room] = earlyAbort{at: time.Now(), from: f.Endpoint, reason: skew.Error(), final: true}
			delete(m.pre.pending, f.Room)
		}
	}
	registered := m.pre.dpeers[f.Endpoint] != nil
	m.mu.Unlock()
	if answer {
		m.log.Warn("peer speaks another control protocol version; telling it and failing its rooms", "peer", peerLabel(f.Endpoint), "peer_version", v, "version", m.version(), "frame", f.Type)
		go func() {
			_ = m.send(f.Endpoint, (&control.VersionMsg{Endpoint: m.endpoint, Reason: m.skewErrorFor(f.Endpoint, v)}).Encode(), false)
		}()
	}
	if m.cfg.Role == RoleDecode {
		go m.peerLost(f.Endpoint, false, skew)
		return
	}
	if s != nil {
		if s.fail(fmt.Errorf("room %d: %w", f.Room, skew)) {
			s.tr.event(s.tr.step(), f.Endpoint, "peer speaks protocol version "+strconv.Itoa(v))
		}
	}
	if registered {
		go m.peerLost(f.Endpoint, false, skew)
	}
}

// skewErrorFor is the reason a VERSION frame to ep (speaking v) carries,
// worded from ep's side.
func (m *Manager) skewErrorFor(ep string, v int) string {
	return fmt.Sprintf("%s %s speaks kvxfer control protocol version %d, %s %s speaks version %d; run the same kvxfer release on every prefill and decode rank (upgrade the older side)",
		m.cfg.Role, m.endpoint, m.version(), m.otherRole(), ep, v)
}
