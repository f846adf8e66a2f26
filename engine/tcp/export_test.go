package tcp

import "net"

// Abort closes the transport after setting SO_LINGER 0 on every inbound
// connection, so senders see a reset as if the process had died.
func Abort(t *Transport) {
	t.mu.Lock()
	for c := range t.inbound {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
	}
	t.mu.Unlock()
	t.Close()
}

// ResetInbound resets every inbound data connection (SO_LINGER 0, then
// close) and keeps the transport open: what `ss -K` does to a receiver's
// established connections.
func ResetInbound(t *Transport) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	for c := range t.inbound {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
	return len(t.inbound)
}

// DeadStreams returns how many of a tcp segment's streams are dead.
func DeadStreams(seg any) int {
	s := seg.(*segment)
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, st := range s.streams {
		st.mu.Lock()
		if st.dead {
			n++
		}
		st.mu.Unlock()
	}
	return n
}
