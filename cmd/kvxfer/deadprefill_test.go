package main

import (
	"strings"
	"testing"
	"time"
)

// TestDecodeRegisterTimeoutNamesDeadPrefill: a decode whose room reaches a
// prefill rank that was killed (kill -9: its directory entry stays) and whose
// bootstrap timeout ends before its peer timeout fails the room saying no
// connection to that control socket succeeded, with the dial's answer
// (connection refused), not advising a control-auth token that has nothing
// to do with it.
func TestDecodeRegisterTimeoutNamesDeadPrefill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	p.ready()
	p.kill9()
	// 8 s: the decode's ZMQ connection attempts must have failed and its dial
	// probe answered before the bootstrap timeout, also on a loaded machine.
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--bootstrap-timeout", "8s", "--peer-timeout", "60s")...)
	d.ready()
	d.send(requestLine{Room: 5, Tokens: 16})
	r := d.result(time.Minute)
	for _, want := range []string{"did not answer REGISTER", "no connection to its control socket succeeded", "connection refused", "kvxfer bootstrap table"} {
		if r.OK || !strings.Contains(r.Error, want) {
			t.Fatalf("decode's room with a killed prefill: %+v\nwant an error containing %q\n%s", r.Result, want, d.stderr.String())
		}
	}
	if strings.Contains(r.Error, "control frames") || strings.Contains(r.Error, "--control-auth") {
		t.Fatalf("decode's room with a killed prefill blames control authentication: %s", r.Error)
	}
}
