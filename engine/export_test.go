package engine

import (
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// SetBeforeDispatch installs a hook the manager's receive loop runs before
// dispatching each control message (tests only: to block the control loop).
func SetBeforeDispatch(m *Manager, f func(msgType string)) { m.beforeDispatch.Store(&f) }

// PushSockets returns how many control PUSH sockets the manager holds.
func PushSockets(m *Manager) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.push)
}

// LockManager holds the manager's lock until the returned function is called
// (tests only: to delay the work that needs it, such as peer-loss handling
// on a loaded host).
func LockManager(m *Manager) (release func()) {
	m.mu.Lock()
	return m.mu.Unlock
}

// SendControl sends control frames to endpoint as the manager sends any
// control message (tests only).
func SendControl(m *Manager, endpoint string, frames [][]byte) error {
	return m.send(endpoint, frames, true)
}

// FailMonitorReaders makes the manager's next control sockets fail to open
// their monitor's reader, as a ZeroMQ context out of sockets does (tests
// only).
func FailMonitorReaders(m *Manager) { m.failMonitorReader.Store(true) }

// SetBeforeVerdict installs a hook each decided verdict's send runs first
// (tests only: a verdict goroutine descheduled while the caller closes).
func SetBeforeVerdict(m *Manager, f func()) { m.beforeVerdict.Store(&f) }

// SetAfterStatusSuccess installs a hook a prefill's sender runs right after
// handing a destination its STATUS Success (tests only).
func SetAfterStatusSuccess(m *Manager, f func()) { m.afterStatusSuccess.Store(&f) }

// SetAfterVerdictFlush installs a hook Manager.Close runs right after it
// waited for the decided verdicts (tests only: a Close descheduled there
// while a room is decided).
func SetAfterVerdictFlush(m *Manager, f func()) { m.afterVerdictFlush.Store(&f) }

// SetControlVersion makes the manager speak control protocol version v
// instead of this build's (tests only: a peer of another release, whose
// frames keep this build's layout, as versions 5 and 6 do).
func SetControlVersion(m *Manager, v int) { m.ctlVersion.Store(int64(v)) }

// RegisteredWith reports whether the decode manager holds a registration
// with the prefill at endpoint (tests only).
func RegisteredWith(m *Manager, endpoint string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dec.ppeers[endpoint] != nil
}

// RegisteredDecodes returns how many decode registrations the prefill
// manager holds (tests only).
func RegisteredDecodes(m *Manager) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.pre.dpeers)
}

// RegistrationEpoch returns the epoch of the decode manager's registration
// with the prefill at endpoint (0 when there is none; tests only).
func RegistrationEpoch(m *Manager, endpoint string) uint64 { return m.currentEpoch(endpoint) }

// SetBeforeDropJudged installs a hook run before a dropped control
// connection to a peer is judged (reset or lost), with the peer's endpoint
// (tests only: to hold back a rank's notice of a peer's disconnect).
func SetBeforeDropJudged(m *Manager, f func(ep string)) { m.beforeDropJudged.Store(&f) }

// SetBeforeHeartbeatLoss installs a hook run after the heartbeat judged a
// peer silent and released the manager's lock, before that peer's loss is
// handled, with the peer's endpoint (tests only: to let a REGISTER in
// there).
func SetBeforeHeartbeatLoss(m *Manager, f func(ep string)) { m.beforeHeartbeatLoss.Store(&f) }

// DispatchFrom seals frames as from seals its control messages (its
// instance id and epoch) and dispatches them on to as a received message
// (tests only: a frame of a closed incarnation that reaches its peer late).
func DispatchFrom(to, from *Manager, frames [][]byte) {
	to.dispatch(control.SealControl(frames, from.instanceID, from.epoch, from.ctlSeq.Add(1), time.Now(), from.ctlKey))
}

// ReceiverAttempt returns the attempt number the receiver names in its
// TRANSFER, ABORT and the ABORT_ACKs it takes (tests only).
func ReceiverAttempt(r *Receiver) uint64 { return r.attempt }

// SenderDstAttempt returns the attempt of the TRANSFER the sender holds as
// decode endpoint ep's destination (0: ep is none; tests only).
func SenderDstAttempt(s *Sender, ep string) uint64 { return s.dstAttempt(ep) }

// PendingTransferAttempts returns, per decode endpoint, the attempt of the
// TRANSFER of room the prefill manager holds for a sender not created yet
// (tests only).
func PendingTransferAttempts(m *Manager, room uint64) map[string]uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]uint64{}
	for ep, pt := range m.pre.pending[room] {
		out[ep] = pt.msg.Attempt
	}
	return out
}

// UnackedVerdicts returns how many Success verdicts the decode manager sent
// that no producer acknowledged yet (VERDICT_ACK; tests only).
func UnackedVerdicts(m *Manager) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.dec.unacked)
}
