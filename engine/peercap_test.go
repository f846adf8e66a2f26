package engine_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// TestPeerCapRefusalIsTold: a prefill at its peer cap (MaxPeers 2, two live
// decodes registered) refuses a third decode's REGISTER and tells it, naming
// the cap and the flag, instead of dropping it (before: the decode waited
// and reported the prefill silent).
func TestPeerCapRefusalIsTold(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, maxPeers: 2})}
	var decs []*rank
	for i := range 3 {
		decs = append(decs, newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1}))
		if i < 2 {
			if r := transferOne(t, addr, pre, decs[i:i+1], uint64(20+i), 2); r[0].Poll() != engine.KVSuccess {
				t.Fatalf("decode %d: %s %v", i, r[0].Poll(), r[0].Failure())
			}
		}
	}
	r, err := decs[2].m.NewReceiver(addr, 30)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pages, _ := decs[2].pool.Alloc(2)
	if err := r.Init(pages); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("third decode at the cap: %s, want Failed", st)
	}
	msg := r.Failure().Error()
	// The refusal crosses the wire as text; a room's error carries the
	// "engine:" prefix once, at its start.
	cause := strings.TrimPrefix(engine.ErrTooManyPeers.Error(), "engine: ")
	if !strings.Contains(msg, cause) || !strings.Contains(msg, "--max-peers") || strings.Contains(msg, "silent") {
		t.Fatalf("third decode's failure %q: want the prefill's peer-cap refusal naming --max-peers", msg)
	}
}
