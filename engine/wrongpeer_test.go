package engine_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// Issue 22 case 5: a decode whose directory lookup (its cache, warmed by a
// room with P1) points at a live prefill, P1, while the room's request went
// to P1's successor P2 (a rolling restart: P2 registered P1's coordinates).
// P1 never gets that request: it checks its directory at once (its own
// checks are an hour apart here), sees it was replaced, and refuses the
// TRANSFER; the decode fails the room naming the cause and tells P2, so
// both sides fail at once, not at P1's bootstrap timeout (60 s here,
// beyond the test's 20 s wait). The next room is served by P2.
func TestStaleLookupToReplacedPrefillFailsAtOnce(t *testing.T) {
	addr := startBootstrap(t)
	opts := func(role engine.Role) rankOpts {
		return rankOpts{role: role, model: smallGQA, tp: 1, pp: 1, addr: addr, dirCheck: time.Hour, bootTmo: time.Minute, waiting: time.Minute}
	}
	p1 := newRank(t, opts(engine.RolePrefill))
	dec := newRank(t, opts(engine.RoleDecode))
	sendOne(t, addr, p1, dec, 1) // the decode now caches P1's entry
	p2 := newRank(t, opts(engine.RolePrefill))
	if p2.m.Epoch() <= p1.m.Epoch() {
		t.Fatal("the successor must have the higher epoch")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := p2.m.NewSender(2)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r, err := dec.m.NewReceiver(addr, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := dec.pool.Alloc(2)
	defer dec.pool.Free(pg)
	start := time.Now()
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), "was replaced") {
		t.Fatalf("decode: %s %v, want Failed at once naming the replaced prefill", st, r.Failure())
	}
	t.Logf("decode failed %s after Init: %v", time.Since(start).Round(time.Millisecond), r.Failure())
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(s.Failure().Error(), "aborted by decode") {
		t.Fatalf("successor prefill: %s %v, want Failed at once, aborted by the decode", st, s.Failure())
	}
	t.Logf("successor failed %s after Init: %v", time.Since(start).Round(time.Millisecond), s.Failure())
	sendOne(t, addr, p2, dec, 3)
}
