package main

import (
	"testing"
	"time"
)

// TestCLISameRoomTwice: two request lines with the same bootstrap_room (a
// router retrying a request keeps it) reach both ranks back to back: each
// rank serves the second once the first attempt is concluded there (result
// written, pages released), so both attempts succeed on both sides (before:
// the second failed at once, "bootstrap_room already active").
func TestCLISameRoomTwice(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--digest")...)
	p.ready()
	d.ready()
	for range 2 {
		p.send(requestLine{Room: 95, Tokens: 64})
		d.send(requestLine{Room: 95, Tokens: 64})
	}
	for i := range 2 {
		pr, dr := p.result(time.Minute), d.result(time.Minute)
		agree(t, 95, pr, dr)
		if !pr.OK || !dr.OK {
			t.Fatalf("attempt %d of room 95: prefill %+v, decode %+v", i+1, pr, dr)
		}
		if want := expectedDigest(t, 95, 64); dr.Digest != want {
			t.Fatalf("attempt %d: digest %s, want %s", i+1, dr.Digest, want)
		}
	}
}

// TestCLIPatternRoom: a prefill request line's "pattern_room" makes the
// prefill send that room's test pattern (kvxfer chaos gives a retried
// room's two attempts different bytes this way): the decode receives room
// 96 with room 97's bytes, and another room's digest than its own.
func TestCLIPatternRoom(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--digest")...)
	p.ready()
	d.ready()
	p.send(requestLine{Room: 96, Tokens: 64, PatternRoom: new(uint64(97))})
	d.send(requestLine{Room: 96, Tokens: 64})
	pr, dr := p.result(time.Minute), d.result(time.Minute)
	agree(t, 96, pr, dr)
	if !pr.OK || !dr.OK {
		t.Fatalf("room 96: prefill %+v, decode %+v", pr, dr)
	}
	if want := expectedDigest(t, 97, 64); dr.Digest != want {
		t.Fatalf("digest %s, want room 97's pattern %s (room 96's: %s)", dr.Digest, want, expectedDigest(t, 96, 64))
	}
}
