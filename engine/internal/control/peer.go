package control

import "fmt"

// PeerID is a rank's identity: its instance id and epoch (Manager.Epoch,
// 0 when unknown), as published in a prefill's directory entry and carried
// by every control frame's envelope. The zero value is "unknown".
type PeerID struct {
	instance string
	epoch    uint64
}

// NewPeerID is the identity of the rank with this instance id and epoch (0:
// unknown), as a prefill's directory entry publishes them.
func NewPeerID(instance string, epoch uint64) PeerID { return PeerID{instance, epoch} }

// SenderID is the identity env claims for the sender of its frame.
func SenderID(env Envelope) PeerID { return PeerID{env.Instance, env.Epoch} }

// Instance is the rank's instance id ("" when unknown).
func (p PeerID) Instance() string { return p.instance }

// Known reports whether p names a rank (its instance id is set).
func (p PeerID) Known() bool { return p.instance != "" }

// Is reports whether q is the same rank as p: the same instance id and, when
// both epochs are known, the same epoch (a restart under a stable instance
// id is another rank).
func (p PeerID) Is(q PeerID) bool {
	return p.instance == q.instance && (p.epoch == 0 || q.epoch == 0 || p.epoch == q.epoch)
}

// SameIncarnation reports whether q is certainly the same running rank as
// p: the same instance id and the same known (non-zero) epoch. Unlike Is,
// an epoch unknown on either side answers false.
func (p PeerID) SameIncarnation(q PeerID) bool {
	return p.instance != "" && p.instance == q.instance && p.epoch != 0 && p.epoch == q.epoch
}

// String is the instance id and, when known, the epoch, for messages.
func (p PeerID) String() string {
	if p.epoch == 0 {
		return p.instance
	}
	return fmt.Sprintf("%s (epoch %d)", p.instance, p.epoch)
}

// SenderEndpoint returns the sender endpoint a decoded control message
// claims ("" for a type without one).
func SenderEndpoint(msg any) string {
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
	case *SubscribeMsg:
		return v.Endpoint
	case *VersionMsg:
		return v.Endpoint
	case *VerdictAckMsg:
		return v.Endpoint
	}
	return ""
}
