package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// TestRetryAfterMidWriteAbort: the decode aborts a room while the prefill
// writes it; once both sides concluded that attempt (the prefill's sender
// failed and closed, the decode's receiver closed: its producer fenced),
// the same bootstrap_room is sent again between the same two ranks into
// the same pages. The retry must succeed with its own bytes, whether its
// TRANSFER reaches the prefill before or after the retry's sender exists.
// Before: 12 of 20 retries failed (kvxfer chaos's retry fault found it):
// a TRANSFER before the retry's sender was refused with the first
// attempt's failure (the closed-sender memo took it for that attempt's,
// late), and the prefill answered the decode's one ABORT with two
// ABORT_ACKs, the second taken by the retry's receiver for its own
// ("stopped writing"), or the STATUS Failed behind the first one reaching
// the decode after it closed the room and answered with a stale ABORT.
func TestRetryAfterMidWriteAbort(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport {
			return faulty.Wrap(tr, faulty.DelayWrites(30*time.Millisecond))
		}})}
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const pages = 4
	dp, err := dec.pool.Alloc(pages)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(dp)
	sp, err := pre[0].pool.Alloc(pages)
	if err != nil {
		t.Fatal(err)
	}
	defer pre[0].pool.Free(sp)
	for i := 0; i < 20; i++ {
		room := uint64(700 + i)
		// The first attempt, aborted by the decode while the prefill writes.
		r, err := dec.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Init(dp); err != nil {
			t.Fatal(err)
		}
		s, err := pre[0].m.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("room %d: first sender %s %v", room, st, s.Failure())
		}
		_ = workload.FillPattern(pre[0].pool, room^1<<40, sp, 0)
		if err := s.Send(sp, true); err != nil {
			t.Fatal(err)
		}
		r.Abort()
		if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
			t.Fatalf("room %d: first sender %s after the decode's abort, want Failed", room, st)
		}
		s.Close()
		r.Close()

		// The retry: the decode's TRANSFER may reach the prefill before
		// or after its sender is created.
		r2, err := dec.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatalf("room %d: retry receiver: %v", room, err)
		}
		if err := r2.Init(dp); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			r2.Wait(ctx, engine.KVTransferring)
			time.Sleep(20 * time.Millisecond) // the TRANSFER reaches the prefill first
		}
		s2, err := pre[0].m.NewSender(room)
		if err != nil {
			t.Fatalf("room %d: retry sender: %v", room, err)
		}
		_ = workload.FillPattern(pre[0].pool, room, sp, 0)
		if st := s2.Wait(ctx, engine.KVWaitingForInput); st == engine.KVWaitingForInput {
			if err := s2.Send(sp, true); err != nil {
				t.Fatal(err)
			}
		}
		st, st2 := r2.Wait(ctx, engine.KVSuccess), s2.Wait(ctx, engine.KVSuccess)
		if st != st2 {
			t.Errorf("room %d retry: decode %s (%v), prefill %s (%v)", room, st, r2.Failure(), st2, s2.Failure())
		}
		if st != engine.KVSuccess {
			t.Errorf("room %d retry (TRANSFER first: %v): decode %s: %v; prefill %s: %v", room, i%2 == 0, st, r2.Failure(), st2, s2.Failure())
		} else if err := workload.VerifyPattern(dec.pool, room, dp, 0); err != nil {
			t.Errorf("room %d retry: %v", room, err)
		}
		s2.Close()
		r2.Close()
	}
}
