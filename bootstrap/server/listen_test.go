package server

import (
	"context"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestListenErrors: Start's bind error says what is wrong — a port in use
// gets the other-server hint, a host that is not an address of this machine
// says so and lists the hosts that work, and neither gets the other's hint.
// The port hint names Options.PortFlag (kvxfer bootstrap's --port), and no
// flag at all when it is empty: an embedder's port (a Python example's
// argument, SGLang's --disaggregation-bootstrap-port) is not set by --port.
func TestListenErrors(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyPort := busy.Addr().(*net.TCPAddr).Port
	ipv6 := false
	if ln, err := net.Listen("tcp", "[::1]:0"); err == nil {
		ipv6 = true
		ln.Close()
	}
	const hostWords = "not an address of this machine"
	cases := []struct {
		host string
		port int
		flag string
		want []string
		not  []string
	}{
		{"127.0.0.1", busyPort, "--port", []string{"listen on 127.0.0.1:" + strconv.Itoa(busyPort), "another bootstrap server", "pick another with --port, or 0 for a free one"}, []string{hostWords, "0.0.0.0"}},
		{"127.0.0.1", busyPort, "", []string{"another bootstrap server", "pick another port, or 0 for a free one"}, []string{"--", hostWords}},
		{"999.1.1.1", 0, "", []string{"999.1.1.1", "neither an IP address", "127.0.0.1", "0.0.0.0", "::", "interfaces"}, []string{"another bootstrap server"}},
		{"01.02.03.04", 0, "", []string{"01.02.03.04", "leading zeros", "127.0.0.1"}, []string{"another bootstrap server"}},
		{"192.0.2.1", 0, "", []string{"192.0.2.1", hostWords, "127.0.0.1", "0.0.0.0", "::"}, []string{"another bootstrap server"}}, // TEST-NET-1
		{"[2001:db8::1]", 0, "", []string{"2001:db8::1", hostWords}, []string{"another bootstrap server"}},                         // documentation prefix
	}
	for _, tc := range cases {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := New(Options{Host: tc.host, Port: tc.port, PortFlag: tc.flag, Logger: quiet}).Start(ctx)
		cancel()
		if err == nil {
			t.Errorf("host %s port %d: Start succeeded", tc.host, tc.port)
			continue
		}
		msg := err.Error()
		if strings.Contains(tc.host, ":") && !ipv6 {
			t.Logf("host %s: %v (no IPv6 on this machine; not checked)", tc.host, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(msg, w) {
				t.Errorf("host %s port %d: %q lacks %q", tc.host, tc.port, msg, w)
			}
		}
		for _, w := range tc.not {
			if strings.Contains(msg, w) {
				t.Errorf("host %s port %d: %q should not say %q", tc.host, tc.port, msg, w)
			}
		}
	}
}
