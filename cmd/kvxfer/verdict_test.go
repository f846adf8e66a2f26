package main

import (
	"fmt"
	"testing"
	"time"
)

// Issue 22 case 1: a decode that verifies a room and exits at once (its
// stdin closed right after the request line: it serves the line, prints its
// result and closes its manager) must deliver its Success verdict before it
// goes, and the prefill must take that verdict over the disconnection that
// follows it. Repeated with a fresh decode each time, as the race between
// the verdict and the connection's end showed up in a fraction of the runs
// (8 runs, ~1.7 s each: 24 took 42-77 s of CI; the same race is repeated
// more cheaply in one process by engine's TestDecodeClosesRightAfterSuccess
// and TestLostVerdictDeliveredAtDecodeClose).
func TestCLIDecodeExitsAfterSuccess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	p.ready()
	const runs = 8
	for i := range uint64(runs) {
		room := 700 + i
		d := startProc(t, fmt.Sprintf("decode %d", i), nil, roleArgs("decode", b, host, "--digest", "--verify")...)
		d.ready()
		p.send(requestLine{Room: room, Tokens: 16})
		d.send(requestLine{Room: room, Tokens: 16})
		_ = d.stdin.Close() // exit as soon as the room is served
		dr := d.result(time.Minute)
		if err := d.wait(time.Minute); err != nil {
			t.Fatalf("run %d: decode exit: %v\n%s", i, err, d.stderr.String())
		}
		pr := p.result(time.Minute)
		agree(t, room, pr, dr)
		if !dr.OK || dr.Digest != expectedDigest(t, room, 16) {
			t.Fatalf("run %d: room %d: decode %+v", i, room, dr)
		}
	}
}
