package main

import (
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestStoppedDecodeBlamesItsOwnPause: a decode stopped with SIGSTOP for
// longer than the peer timeout while its room waits, then continued, is
// dropped by the prefill meanwhile. Both sides must agree on the room. The
// decode logs its own pause; when the room fails, its error says the decode
// itself was paused (and what pauses a process) instead of only blaming the
// prefill as silent. (With only a TRANSFER held at the prefill the room
// normally recovers: the prefill tells the decode it was dropped and the
// decode registers again; engine's TestPauseNote covers the error's text.)
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
		// The usual end: the prefill only held the room's TRANSFER, dropped
		// the silent decode, and told it so at its first PING after the
		// pause (REGISTER_ACK with EvictedPrefix): the decode registered
		// again, moved the room and it succeeded on both sides. The decode
		// must still have noticed its own pause.
		if !strings.Contains(d.stderr.String(), "this process ran nothing for longer than half the peer timeout") {
			t.Fatalf("room 1 succeeded, but the decode did not log its own pause:\n%s", d.stderr.String())
		}
		return
	}
	for _, want := range []string{"this decode rank tp0/pp0 itself ran nothing for", "SIGSTOP", "not at the peer"} {
		if !strings.Contains(dr.Error, want) {
			t.Fatalf("decode's error %q: want it to say the decode was paused (%q)\n%s", dr.Error, want, d.stderr.String())
		}
	}
}
