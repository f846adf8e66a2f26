package main

import (
	"strings"
	"testing"
	"time"
)

// TestCLILostPrefixSidesAgree: room B reuses the prefix blocks of room A,
// still in flight on the decode (its prefix cache); A then fails (its
// prefill never gets A's request, so the decode fails A at its waiting
// timeout, 6 s). B's own pages all arrive, but its prompt is not whole: the
// decode fails B, and so does the prefill (before: the prefill reported
// ok:true while the decode failed B, and the decode's metrics counted a
// success). The failed result carries the bytes that did land.
func TestCLILostPrefixSidesAgree(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--waiting-timeout", "30s")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--prefix-cache-blocks", "8", "--prefix-block-tokens", "16",
		"--waiting-timeout", "6s", "--bootstrap-timeout", "6s")...)
	p.ready()
	d.ready()
	// A: 48 tokens in blocks [1, 2, 3]; only the decode gets its line.
	d.send(requestLine{Room: 80, Tokens: 48, HashIDs: []int64{1, 2, 3}})
	// B a second later, so that A fails (at its waiting timeout) well
	// before B's own one, and B's pages have landed by then: with both
	// sent at once, a loaded run (load 15) timed B out on its own at the
	// same moment, before its pages landed, and neither side named the
	// prefix.
	time.Sleep(time.Second)
	// B: the same first two blocks, then its own; both sides get it.
	p.send(requestLine{Room: 81, Tokens: 64, HashIDs: []int64{1, 2, 9, 10}})
	d.send(requestLine{Room: 81, Tokens: 64, HashIDs: []int64{1, 2, 9, 10}})
	res := map[uint64]replyLine{}
	for len(res) < 2 {
		r := d.result(time.Minute)
		res[*r.Room] = r
	}
	pr := p.result(time.Minute)
	if res[80].OK {
		t.Fatalf("room 80 (no prefill) succeeded: %+v", res[80])
	}
	if res[81].PrefixTokens != 32 && !strings.Contains(res[81].Error, "prefix") {
		t.Fatalf("room 81 did not reuse room 80's prefix (prefix tokens %d): %+v", res[81].PrefixTokens, res[81])
	}
	agree(t, 81, pr, res[81])
	if res[81].OK {
		t.Fatalf("room 81 succeeded though its held prefix (room 80's) was lost: %+v", res[81])
	}
	if !strings.Contains(res[81].Error, "prefix") || !strings.Contains(pr.Error, "prefix") {
		t.Fatalf("room 81 errors: decode %q, prefill %q: want both to name the lost prefix", res[81].Error, pr.Error)
	}
	t.Logf("decode: %s (bytes %d); prefill: %s", res[81].Error, res[81].Bytes, pr.Error)
	if res[81].Bytes == 0 {
		t.Errorf("room 81's failed result says bytes 0, though its own pages landed: %+v", res[81])
	}
}
