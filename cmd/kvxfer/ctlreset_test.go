package main

import (
	"net/url"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// resetControlConns resets (ss -K) every established TCP connection to or
// from the control ports of the given endpoints (ZeroMQ's PUSH → PULL
// connections, both directions), as an operator or a middlebox would, and
// returns how many sockets were reset; it skips the test where ss -K
// cannot.
func resetControlConns(t *testing.T, endpoints ...string) int {
	t.Helper()
	if _, err := exec.LookPath("ss"); err != nil {
		t.Skip("ss (iproute2) not installed: cannot reset connections")
	}
	var filter []string
	for _, ep := range endpoints {
		u, err := url.Parse(ep)
		if err != nil {
			t.Fatal(err)
		}
		filter = append(filter, "sport = :"+u.Port(), "dport = :"+u.Port())
	}
	out, err := exec.Command("ss", "-HK", "state", "established", "( "+strings.Join(filter, " or ")+" )").CombinedOutput()
	if err != nil {
		t.Skipf("ss -K cannot reset sockets here (%v: %s): needs root and CONFIG_INET_DIAG_DESTROY", err, out)
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		if strings.TrimSpace(line) != "" && !strings.Contains(line, "RTNETLINK") {
			n++
		}
	}
	return n
}

// Issue 22 case 3: the control connections between a decode and its
// prefill ranks are reset (ss -K, both directions) while the pair is idle.
// Both processes stay up, so this is no peer loss: ZeroMQ reconnects, and
// the next room, started at once, succeeds on both sides, every time.
func TestCLIControlConnectionReset(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if syscall.Geteuid() != 0 {
		t.Skip("ss -K needs root (CAP_NET_ADMIN)")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--digest")...)
	pready, dready := p.ready(), d.ready()
	ok := func(id uint64) {
		t.Helper()
		p.send(requestLine{Room: id, Tokens: 64})
		d.send(requestLine{Room: id, Tokens: 64})
		dr, pr := d.result(time.Minute), p.result(time.Minute)
		agree(t, id, pr, dr)
		if !dr.OK || dr.Digest != expectedDigest(t, id, 64) {
			t.Fatalf("room %d: prefill %+v, decode %+v", id, pr, dr)
		}
	}
	ok(1)
	for i, c := range []struct {
		what string
		eps  []string
	}{
		{"both directions", []string{pready.Endpoint, dready.Endpoint}},
		{"prefill to decode", []string{dready.Endpoint}},
		{"decode to prefill", []string{pready.Endpoint}},
		{"both directions again", []string{pready.Endpoint, dready.Endpoint}},
	} {
		n := resetControlConns(t, c.eps...)
		if n == 0 {
			t.Fatalf("%s: ss -K reset no control connection", c.what)
		}
		start := time.Now()
		ok(10 + uint64(i))
		t.Logf("%s (%d sockets reset): the next room succeeded %s after it", c.what, n, time.Since(start).Round(time.Millisecond))
	}
}
