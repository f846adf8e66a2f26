package main

import (
	"strings"
	"testing"
	"time"
)

// TestCLIPrefillCompletePolicy: kvxfer prefill and decode both run with
// --decode-allocation-policy prefill_complete: the prefill marks each
// request computed after filling it, the decode takes its pages only then,
// and the room succeeds on both sides with every byte verified; a decode
// under prefill_complete against a prefill declaring early fails the room
// on both sides, naming both policies.
func TestCLIPrefillCompletePolicy(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	pc := []string{"--decode-allocation-policy", "prefill_complete"}
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, pc...)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, append(pc, "--verify", "--digest")...)...)
	p.ready()
	d.ready()
	d.send(requestLine{Room: 12, Tokens: 48})
	p.send(requestLine{Room: 12, Tokens: 48})
	dr, pr := d.result(time.Minute), p.result(time.Minute)
	agree(t, 12, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 12, 48) {
		t.Fatalf("prefill_complete room: prefill %+v decode %+v", pr, dr)
	}

	_, b2 := startBootstrapProc(t, host, 0)
	p2 := startProc(t, "prefill-early", nil, roleArgs("prefill", b2, host)...)
	d2 := startProc(t, "decode-pc", nil, roleArgs("decode", b2, host, pc...)...)
	p2.ready()
	d2.ready()
	p2.send(requestLine{Room: 13, Tokens: 16})
	time.Sleep(200 * time.Millisecond)
	d2.send(requestLine{Room: 13, Tokens: 16})
	dr, pr = d2.result(time.Minute), p2.result(time.Minute)
	agree(t, 13, pr, dr)
	for _, e := range []string{dr.Error, pr.Error} {
		if !strings.Contains(e, "decode allocation policy mismatch") || !strings.Contains(e, `declares "early"`) {
			t.Fatalf("policy mismatch: prefill %q decode %q, want both naming the mismatch", pr.Error, dr.Error)
		}
	}
}
