package engine

// SetBeforeDispatch installs a hook the manager's receive loop runs before
// dispatching each control message (tests only: to block the control loop).
func SetBeforeDispatch(m *Manager, f func(msgType string)) { m.beforeDispatch.Store(&f) }

// DecodeSegmentReply decodes a segment RPC reply (tests outside the package
// speak the wire protocol to a listener).
var DecodeSegmentReply = decodeSegmentReply

// PushSockets returns how many control PUSH sockets the manager holds.
func PushSockets(m *Manager) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.push)
}
