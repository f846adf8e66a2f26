package main

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestControlPortFlag: --control-port binds the rank's control socket on
// that port (the ready line's endpoint names it), so a rank killed and
// started again with the same flag comes back at the same control address
// and serves rooms; a port another process holds is refused at start with
// an error naming --control-port, and a port outside 0–65535 with one
// naming the range.
func TestControlPortFlag(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	port := strconv.Itoa(freePort(t, host))
	want := "tcp://" + host + ":" + port
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--control-port", port)...)
	if r := p.ready(); r.Endpoint != want {
		t.Fatalf("prefill --control-port %s: endpoint %q, want %q", port, r.Endpoint, want)
	}
	// The port is held: a decode asking for it does not start, and says
	// which flag to change.
	busy := startProc(t, "decode on a held port", nil, roleArgs("decode", b, host, "--control-port", port)...)
	if code := exitCode(busy.wait(time.Minute)); code != 1 {
		t.Fatalf("decode on the held --control-port %s: exit %d, want 1\n%s", port, code, busy.stderr.String())
	}
	for _, w := range []string{"--control-port " + port, "address already in use", "0 (the default) to pick a free one"} {
		if !strings.Contains(busy.stderr.String(), w) {
			t.Fatalf("decode on the held --control-port %s: stderr lacks %q:\n%s", port, w, busy.stderr.String())
		}
	}
	// Checked before the KV pool is allocated (a prefaulted pool of GiBs
	// takes seconds, tens under load, for each restart of a crash loop):
	// with a pool larger than the host as well, the port is what is named.
	big := startProc(t, "decode on a held port, huge pool", nil, roleArgs("decode", b, host, "--control-port", port, "--pool-mb", "1073741824")...)
	if code := exitCode(big.wait(time.Minute)); code != 1 || !strings.Contains(big.stderr.String(), "--control-port "+port) || !strings.Contains(big.stderr.String(), "address already in use") {
		t.Fatalf("decode on the held --control-port %s with a pool larger than the host: exit %d, want 1 naming the port first:\n%s", port, code, big.stderr.String())
	}
	// The same-port restart: kill the prefill, start it again on the port.
	p.kill9()
	p2 := startProc(t, "prefill restarted", nil, roleArgs("prefill", b, host, "--control-port", port)...)
	if r := p2.ready(); r.Endpoint != want {
		t.Fatalf("restarted prefill --control-port %s: endpoint %q, want %q", port, r.Endpoint, want)
	}
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--verify")...)
	d.ready()
	p2.send(requestLine{Room: 5, Tokens: 16})
	d.send(requestLine{Room: 5, Tokens: 16})
	pr, dr := p2.result(time.Minute), d.result(time.Minute)
	if !pr.OK || !dr.OK {
		t.Fatalf("room 5 through the restarted prefill: prefill %+v, decode %+v", pr.Result, dr.Result)
	}
	for _, bad := range []string{"70000", "-1"} {
		q := startProc(t, "decode --control-port "+bad, nil, roleArgs("decode", b, host, "--control-port", bad)...)
		if code := exitCode(q.wait(time.Minute)); code != 1 || !strings.Contains(q.stderr.String(), "--control-port "+bad+": want a TCP port 1–65535, or 0") {
			t.Fatalf("decode --control-port %s: exit %d, want 1 and an error naming the range:\n%s", bad, code, q.stderr.String())
		}
	}
}
