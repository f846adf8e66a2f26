package engine_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// TestPeerCapEvictsIdleDecodes: at its peer cap (MaxPeers 2) a prefill
// evicts the least recently used decode with no room to admit a new one, and
// tells it, so the evicted decode's next room registers again and succeeds
// (before: live idle decodes were never evicted and the new one was
// refused). A decode with a room in flight is never evicted: then the new
// one is refused, naming the cap.
func TestPeerCapEvictsIdleDecodes(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, maxPeers: 2})}
	var decs []*rank
	for range 3 {
		decs = append(decs, newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1}))
	}
	room := uint64(40)
	serve := func(i int) {
		t.Helper()
		room++
		if r := transferOne(t, addr, pre, decs[i:i+1], room, 2); r[0].Poll() != engine.KVSuccess {
			t.Fatalf("decode %d, room %d: %s %v", i, room, r[0].Poll(), r[0].Failure())
		}
	}
	for _, i := range []int{0, 1, 2, 0, 1, 2, 2, 0} {
		serve(i)
	}

	// Both registered decodes busy (a receiver each, its TRANSFER waiting
	// for a sender): the third is refused, naming the cap.
	busy := func(d *rank, room uint64) *engine.Receiver {
		t.Helper()
		r, err := d.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		pages, _ := d.pool.Alloc(2)
		if err := r.Init(pages); err != nil {
			t.Fatal(err)
		}
		return r
	}
	a, b := busy(decs[0], 60), busy(decs[2], 61) // decs[2] and decs[0] are the registered ones
	deadline := time.Now().Add(30 * time.Second)
	for a.Poll() < engine.KVTransferring || b.Poll() < engine.KVTransferring {
		if time.Now().After(deadline) {
			t.Fatalf("busy rooms: %s %v, %s %v", a.Poll(), a.Failure(), b.Poll(), b.Failure())
		}
		time.Sleep(5 * time.Millisecond)
	}
	c := busy(decs[1], 62)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if st := c.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(c.Failure().Error(), "--max-peers") {
		t.Fatalf("a third decode while both registered ones have rooms: %s %v, want the peer-cap refusal", st, c.Failure())
	}
}
