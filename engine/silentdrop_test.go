package engine_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// TestSilentDecodeRegistersAgain: a decode silent for longer than the
// prefill's peer timeout (SIGSTOPped, descheduled: here its frames to the
// prefill are dropped) loses its registration there. Once it is heard from
// again the prefill tells it so, and its next room registers again and
// succeeds. Before, that room failed on both sides with "prefill got
// TRANSFER before REGISTER" (found by a new user: stop a decode 15 s with
// SIGSTOP, continue it, send the next room).
func TestSilentDecodeRegistersAgain(t *testing.T) {
	addr := startBootstrap(t)
	var silent atomic.Bool
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, peerTmo: time.Second})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: time.Minute,
		controlFault: func(peer, msgType string) bool { return silent.Load() && peer == pre[0].m.Endpoint() }})}
	if r := transferOne(t, addr, pre, dec, 71, 2); r[0].Poll() != engine.KVSuccess {
		t.Fatalf("room 71: %s %v", r[0].Poll(), r[0].Failure())
	}
	silent.Store(true)
	waitFor(t, 30*time.Second, "the prefill drops the silent decode's registration", func() bool {
		return engine.RegisteredDecodes(pre[0].m) == 0
	})
	silent.Store(false)
	waitFor(t, 30*time.Second, "the decode, heard from again, is told its registration was dropped", func() bool {
		return !engine.RegisteredWith(dec[0].m, pre[0].m.Endpoint())
	})
	if r := transferOne(t, addr, pre, dec, 72, 2); r[0].Poll() != engine.KVSuccess {
		t.Fatalf("room 72 after the decode resumed: %s %v, want Success (it registers again)", r[0].Poll(), r[0].Failure())
	}
}

// waitFor polls cond every 10 ms until it holds, failing the test after d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting until %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
