package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// TestStaleFailedStatusIgnored (issue 22, same-room retry): a STATUS Failed
// from the room's prefill rank naming another registration epoch than the
// room's (a rejection of an earlier attempt, arriving late) is put on the
// room's timeline and dropped, and the room then succeeds on both sides;
// before, any Failed failed the room whatever its epoch. A STATUS Failed of
// the current registration still fails the room at once on both sides (the
// decode aborts the prefill's sender long before its bootstrap timeout).
func TestStaleFailedStatusIgnored(t *testing.T) {
	addr, p, d, cur := registeredPair(t)
	start := func(ctx context.Context, room uint64) (*engine.Receiver, *engine.Sender, []int32) {
		return startHeldRoom(ctx, t, addr, p, d, room)
	}
	failed := func(room, epoch uint64, reason string) [][]byte {
		return (&control.StatusMsg{Room: room, State: int(engine.KVFailed), Producer: 0, Endpoint: p.m.Endpoint(), Reason: reason, Epoch: epoch}).Encode()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const room = 7
	r, s, dp := start(ctx, room)
	if err := engine.SendControl(p.m, d.m.Endpoint(), failed(room, cur-1, "rejection of an earlier attempt")); err != nil {
		t.Fatal(err)
	}
	waitTimeline(t, d.m, room, "stale STATUS Failed ignored")
	if st := r.Poll(); st == engine.KVFailed {
		t.Fatalf("room %d failed by a STATUS Failed of epoch %d (registration epoch %d): %v", room, cur-1, cur, r.Failure())
	}
	sendPattern(ctx, t, p, d, r, s, room, dp) // the stale Failed dropped
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("prefill of room %d: %s %v, want Success", room, st, s.Failure())
	}

	const room2 = 8
	r2, s2, _ := start(ctx, room2)
	if err := engine.SendControl(p.m, d.m.Endpoint(), failed(room2, cur, "rejected for this attempt")); err != nil {
		t.Fatal(err)
	}
	if st := r2.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r2.Failure().Error(), "rejected for this attempt") {
		t.Fatalf("decode of room %d: %s %v, want Failed naming the current attempt's rejection", room2, st, r2.Failure())
	}
	if st := s2.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(s2.Failure(), engine.ErrAborted) {
		t.Fatalf("prefill of room %d: %s %v, want Failed (aborted by the decode) well before its bootstrap timeout", room2, st, s2.Failure())
	}
}

// registeredPair starts a bootstrap server, a prefill and a decode rank
// and runs one room so that the decode registers with the prefill; it
// returns the decode's registration epoch there (> 1).
func registeredPair(t *testing.T) (addr string, p, d *rank, epoch uint64) {
	t.Helper()
	addr = startBootstrap(t)
	p = newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	d = newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	sendOne(t, addr, p, d, 1)
	epoch = engine.RegistrationEpoch(d.m, p.m.Endpoint())
	if epoch <= 1 {
		t.Fatalf("registration epoch %d after a room, want > 1", epoch)
	}
	return addr, p, d, epoch
}

// startHeldRoom creates room's receiver on d (3 pages) and sender on p and
// waits until the prefill holds the decode's TRANSFER (the receiver knows
// its producer). Both are closed and the pages freed when the test ends.
func startHeldRoom(ctx context.Context, t *testing.T, addr string, p, d *rank, room uint64) (*engine.Receiver, *engine.Sender, []int32) {
	t.Helper()
	dp, _ := d.pool.Alloc(3)
	t.Cleanup(func() { d.pool.Free(dp) })
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if err := r.Init(dp); err != nil {
		t.Fatal(err)
	}
	s, err := p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("room %d sender %s %v", room, st, s.Failure())
	}
	return r, s, dp
}

// TestStaleSuccessStatusIgnored (issue 22, the stop-30 decision): a STATUS
// Success from the room's prefill rank naming another registration epoch
// than the room's (a late answer for an earlier attempt, or a producer that
// wrote through a registration the decode has replaced) says nothing about
// this attempt: it is put on the room's timeline and dropped, as a stale
// Failed is, and the room then succeeds on both sides with the real
// transfer. Before, the decode checked the record at once and failed the
// room (slot not committed, or a stale writer's record).
func TestStaleSuccessStatusIgnored(t *testing.T) {
	addr, p, d, cur := registeredPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const room = 9
	r, s, dp := startHeldRoom(ctx, t, addr, p, d, room)
	for _, epoch := range []uint64{cur - 1, cur + 1} {
		stale := (&control.StatusMsg{Room: room, State: int(engine.KVSuccess), Producer: 0, Endpoint: p.m.Endpoint(), Epoch: epoch}).Encode()
		if err := engine.SendControl(p.m, d.m.Endpoint(), stale); err != nil {
			t.Fatal(err)
		}
		waitTimeline(t, d.m, room, fmt.Sprintf("stale STATUS Success ignored: it names registration epoch %d", epoch))
		if st := r.Poll(); st == engine.KVFailed || st == engine.KVSuccess {
			t.Fatalf("room %d decided (%s) by a STATUS Success of epoch %d (registration epoch %d): %v", room, st, epoch, cur, r.Failure())
		}
	}
	sendPattern(ctx, t, p, d, r, s, room, dp) // the stale Success dropped
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("prefill of room %d: %s %v, want Success", room, st, s.Failure())
	}
}
