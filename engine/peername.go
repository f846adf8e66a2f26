package engine

import (
	"fmt"
	"strings"
)

// peerName names the peer rank at control endpoint ep for errors and logs
// as its operator knows it: role, coordinates and instance id, then the
// address ("prefill tp1/pp0 (instance 3f9a…) at 10.0.0.7:46439"); what this
// rank does not know of it (a peer it never registered with) is left out
// ("prefill at 10.0.0.7:46439").
func (m *Manager) peerName(ep string) string {
	role := m.otherRole()
	coords, inst := "", ""
	m.mu.Lock()
	if m.cfg.Role == RoleDecode {
		if pp := m.dec.ppeers[ep]; pp != nil {
			inst = pp.id.Instance()
			if pp.geo != nil {
				coords = rankCoords(0, 0, pp.geo.TPRank, pp.geo.PPRank)
			}
		}
		if coords == "" {
			for _, ii := range m.dec.bcache {
				ii.mu.Lock()
				for c, e := range ii.ranks {
					if e == ep {
						coords = rankCoords(c.DP, c.CP, c.TP, c.PP)
					}
				}
				ii.mu.Unlock()
			}
		}
	} else if dp := m.pre.dpeers[ep]; dp != nil {
		inst = dp.id.Instance()
		if dp.reg != nil {
			coords = rankCoords(0, 0, dp.reg.Geometry.TPRank, dp.reg.Geometry.PPRank)
		}
	}
	m.mu.Unlock()
	s := role
	if coords != "" {
		s += " " + coords
	}
	if inst != "" {
		s += fmt.Sprintf(" (instance %s)", inst)
	}
	return s + " at " + peerLabel(ep)
}

// enginePrefix is the prefix of the engine's own errors.
const enginePrefix = "engine: "

// onePrefix returns err with "engine: " at most once in its message, at
// its start when the message starts with it: an error wrapped at several
// layers of the engine ("engine: room 5: register with prefill …: engine:
// prefill … refused …") reads as one sentence. The chain is kept
// (errors.Is and errors.As see err).
func onePrefix(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if n := strings.Count(msg, enginePrefix); n == 0 || (n == 1 && strings.HasPrefix(msg, enginePrefix)) {
		return err
	}
	head := ""
	if strings.HasPrefix(msg, enginePrefix) {
		head, msg = enginePrefix, msg[len(enginePrefix):]
	}
	return prefixedError{msg: head + strings.ReplaceAll(msg, ": "+enginePrefix, ": "), err: err}
}

// prefixedError is err with another message (onePrefix).
type prefixedError struct {
	msg string
	err error
}

func (e prefixedError) Error() string { return e.msg }
func (e prefixedError) Unwrap() error { return e.err }
