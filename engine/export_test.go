package engine

// SetBeforeDispatch installs a hook the manager's receive loop runs before
// dispatching each control message (tests only: to block the control loop).
func SetBeforeDispatch(m *Manager, f func(msgType string)) { m.beforeDispatch.Store(&f) }
