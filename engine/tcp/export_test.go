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
