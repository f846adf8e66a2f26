package engine

import "fmt"

// peerID is a rank's identity: its instance id and epoch (Manager.Epoch,
// 0 when unknown), as published in a prefill's directory entry and carried
// by every control frame's envelope. The zero value is "unknown".
type peerID struct {
	instance string
	epoch    uint64
}

func envID(env Envelope) peerID { return peerID{env.Instance, env.Epoch} }

func (p peerID) known() bool { return p.instance != "" }

// is reports whether q is the same rank as p: the same instance id and, when
// both epochs are known, the same epoch (a restart under a stable instance
// id is another rank).
func (p peerID) is(q peerID) bool {
	return p.instance == q.instance && (p.epoch == 0 || q.epoch == 0 || p.epoch == q.epoch)
}

func (p peerID) String() string {
	if p.epoch == 0 {
		return p.instance
	}
	return fmt.Sprintf("%s (epoch %d)", p.instance, p.epoch)
}

// msgEndpoint returns the sender endpoint a decoded control message claims.
func msgEndpoint(msg any) string {
	switch v := msg.(type) {
	case *RegisterMsg:
		return v.Endpoint
	case *RegisterAckMsg:
		return v.Endpoint
	case *TransferMsg:
		return v.Endpoint
	case *AbortMsg:
		return v.Endpoint
	case *AbortAckMsg:
		return v.Endpoint
	case *StatusMsg:
		return v.Endpoint
	case *HandshakeMsg:
		return v.Endpoint
	case *HandshakeAckMsg:
		return v.Endpoint
	case *PingMsg:
		return v.Endpoint
	case *ProbeMsg:
		return v.Endpoint
	case *ProbeResultMsg:
		return v.Endpoint
	}
	return ""
}
