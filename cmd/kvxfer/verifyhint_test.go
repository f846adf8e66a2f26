package main

import (
	"strings"
	"testing"
	"time"
)

// TestVerifyMismatchNamesFillAndVerifiedKey: a decode run with --verify
// against a prefill run with --fill=false fails the room with the
// mismatch and a hint naming --fill=false (the pattern --verify checks is
// the prefill's --fill); every decode result line carries "verified":
// false without --verify (the room succeeded, its bytes unchecked) and on
// the failed room, true once a --verify room matched; prefill lines carry
// no such key. The failed room reports the bytes that landed with their
// transfer time.
func TestVerifyMismatchNamesFillAndVerifiedKey(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, unfilled := startBootstrapProc(t, host, 0)
	_, filled := startBootstrapProc(t, host, 0)
	pu := startProc(t, "prefill --fill=false", nil, roleArgs("prefill", unfilled, host, "--fill=false")...)
	pf := startProc(t, "prefill", nil, roleArgs("prefill", filled, host)...)
	dv := startProc(t, "decode --verify", nil, roleArgs("decode", unfilled, host, "--verify")...)
	dn := startProc(t, "decode", nil, roleArgs("decode", unfilled, host)...)
	for _, p := range []*proc{pu, pf, dv, dn} {
		p.ready()
	}
	verified := func(r replyLine) string {
		if r.Verified == nil {
			return "absent"
		}
		if *r.Verified {
			return "true"
		}
		return "false"
	}

	// --verify against unfilled pages: the mismatch, and the hint.
	pu.send(requestLine{Room: 81, Tokens: 16})
	dv.send(requestLine{Room: 81, Tokens: 16})
	dr, pr := dv.result(time.Minute), pu.result(time.Minute)
	agree(t, 81, pr, dr)
	if dr.OK {
		t.Fatalf("room 81: --verify passed on pages the prefill never filled: %+v", dr)
	}
	for _, want := range []string{"KV verification failed for room 81", "differs from the pattern", "--fill=false", "without --verify"} {
		if !strings.Contains(dr.Error, want) {
			t.Errorf("room 81: decode error %q lacks %q", dr.Error, want)
		}
	}
	if verified(dr) != "false" || verified(pr) != "absent" {
		t.Errorf("room 81: verified decode=%s prefill=%s, want false and absent", verified(dr), verified(pr))
	}
	// The bytes landed before the check refused them: the result says
	// how many and how long they took (not bytes with transfer_us 0).
	if dr.Bytes == 0 || dr.TransferUS <= 0 {
		t.Errorf("room 81: decode reports bytes %d, transfer_us %d: want both > 0 (the KV landed, then --verify refused it)", dr.Bytes, dr.TransferUS)
	}

	// No --verify: the room succeeds, and says its bytes were not checked.
	pu.send(requestLine{Room: 82, Tokens: 16})
	dn.send(requestLine{Room: 82, Tokens: 16})
	dr, pr = dn.result(time.Minute), pu.result(time.Minute)
	if !dr.OK || !pr.OK {
		t.Fatalf("room 82 without --verify: prefill %+v, decode %+v", pr, dr)
	}
	if verified(dr) != "false" || verified(pr) != "absent" {
		t.Errorf("room 82: verified decode=%s prefill=%s, want false and absent", verified(dr), verified(pr))
	}

	// --verify against a filling prefill: checked, and says so.
	pf.send(requestLine{Room: 83, Tokens: 16})
	dv.send(requestLine{Room: 83, Tokens: 16, Bootstrap: filled})
	dr, pr = dv.result(time.Minute), pf.result(time.Minute)
	if !dr.OK || !pr.OK {
		t.Fatalf("room 83 with --fill and --verify: prefill %+v, decode %+v", pr, dr)
	}
	if verified(dr) != "true" {
		t.Errorf("room 83: verified decode=%s, want true", verified(dr))
	}
}
