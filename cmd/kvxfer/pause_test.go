package main

import (
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestStoppedDecodeBlamesItsOwnPause: a decode stopped with SIGSTOP for
// longer than the peer timeout while its room waits, then continued, is
// dropped by the prefill meanwhile; the room then fails on both sides, and
// the error says the decode itself was paused (and what pauses a process)
// instead of only blaming the prefill as silent.
func TestStoppedDecodeBlamesItsOwnPause(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--peer-timeout", "2s")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--peer-timeout", "2s")...)
	p.ready()
	d.ready()
	d.send(requestLine{Room: 1, Tokens: 16})
	// The decode's TRANSFER reaches the prefill, which holds it until the
	// room's prefill request comes.
	time.Sleep(500 * time.Millisecond)
	if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * 2 * time.Second) // three peer timeouts: the prefill drops the decode
	if err := d.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	p.send(requestLine{Room: 1, Tokens: 16})
	dr, pr := d.result(time.Minute), p.result(time.Minute)
	agree(t, 1, pr, dr)
	if dr.OK {
		t.Skipf("room 1 succeeded after the decode's pause (the prefill kept it): %+v", dr.Result)
	}
	for _, want := range []string{"this decode rank tp0/pp0 itself ran nothing for", "SIGSTOP", "not at the peer"} {
		if !strings.Contains(dr.Error, want) {
			t.Fatalf("decode's error %q: want it to say the decode was paused (%q)\n%s", dr.Error, want, d.stderr.String())
		}
	}
}
