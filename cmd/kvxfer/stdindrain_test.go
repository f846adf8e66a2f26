package main

import (
	"strings"
	"testing"
	"time"
)

// TestStdinEndDrainTimeout: --drain-timeout bounds a rank whose stdin
// ended, as it bounds one stopped by a signal. A prefill whose room is
// still writing (every batch held back by --inject-write-delay) when its
// stdin ends fails the room at the drain timeout naming --drain-timeout,
// the decode's room fails too with that reason, and the prefill exits
// (status 1) instead of waiting for the room without bound. A decode whose
// stdin ended while its room waits for a prefill that never got the line
// fails it the same way and exits.
func TestStdinEndDrainTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	const want = "--drain-timeout 1s passed after stdin's end"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--drain-timeout", "1s", "--inject-write-delay", "1m")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--drain-timeout", "1s")...)
	p.ready()
	d.ready()
	d.send(requestLine{Room: 61, Tokens: 16})
	p.send(requestLine{Room: 61, Tokens: 16})
	time.Sleep(300 * time.Millisecond) // the TRANSFER reaches the prefill, its writes are posted (and held)
	start := time.Now()
	_ = p.stdin.Close()
	pr := p.result(30 * time.Second)
	if took := time.Since(start); pr.OK || !strings.Contains(pr.Error, want) || took > 10*time.Second {
		t.Fatalf("prefill room 61 after stdin's end: ok=%v error %q after %s; want it failed naming %q within seconds\n%s", pr.OK, pr.Error, took, want, p.stderr.String())
	}
	if code := exitCode(p.wait(30 * time.Second)); code != 1 {
		t.Fatalf("prefill exit %d after its room was cancelled, want 1\n%s", code, p.stderr.String())
	}
	dr := d.result(30 * time.Second)
	if dr.OK || !strings.Contains(dr.Error, "--drain-timeout") {
		t.Fatalf("decode room 61: ok=%v error %q; want it failed with the prefill's reason naming --drain-timeout\n%s", dr.OK, dr.Error, d.stderr.String())
	}

	// A decode whose stdin ended with a room no prefill serves.
	d.send(requestLine{Room: 62, Tokens: 16})
	time.Sleep(200 * time.Millisecond)
	start = time.Now()
	_ = d.stdin.Close()
	dr = d.result(30 * time.Second)
	if took := time.Since(start); dr.OK || !strings.Contains(dr.Error, want) || took > 10*time.Second {
		t.Fatalf("decode room 62 after stdin's end: ok=%v error %q after %s; want it failed naming %q within seconds\n%s", dr.OK, dr.Error, took, want, d.stderr.String())
	}
	if code := exitCode(d.wait(30 * time.Second)); code != 1 {
		t.Fatalf("decode exit %d, want 1\n%s", code, d.stderr.String())
	}
}
