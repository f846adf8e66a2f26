package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// TestRingSlotWait: a decode with one metadata ring slot. Room B, initialized
// while room A holds the slot, waits (WaitingForInput) instead of failing and
// transfers once A is closed. Room C, initialized while B holds the slot and
// B is never closed, fails after the waiting timeout naming the ring, and its
// prefill learns the same outcome (issue 18 case 6).
func TestRingSlotWait(t *testing.T) {
	const waiting = 1500 * time.Millisecond
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	decReg := prometheus.NewRegistry()
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, ringSlots: 1, waiting: waiting, metrics: decReg})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	type room struct {
		r   *engine.Receiver
		s   *engine.Sender
		pg  []int32
		src []int32
	}
	start := func(id uint64) *room {
		t.Helper()
		x := &room{}
		var err error
		if x.r, err = d.m.NewReceiver(addr, id); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(x.r.Close)
		x.pg, _ = d.pool.Alloc(2)
		if err := x.r.Init(x.pg); err != nil {
			t.Fatal(err)
		}
		if x.s, err = p.m.NewSender(id); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(x.s.Close)
		return x
	}
	send := func(x *room) {
		t.Helper()
		if st := x.s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("sender of room %d: %s %v", x.r.Room(), st, x.s.Failure())
		}
		x.src, _ = p.pool.Alloc(x.s.DstPages())
		if err := workload.FillPattern(p.pool, x.r.Room(), x.src, 0); err != nil {
			t.Fatal(err)
		}
		if err := x.s.Send(x.src, true); err != nil {
			t.Fatal(err)
		}
	}
	done := func(x *room) {
		t.Helper()
		if st := x.r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Fatalf("room %d: %s %v", x.r.Room(), st, x.r.Failure())
		}
		if st := x.s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Fatalf("room %d sender: %s %v", x.r.Room(), st, x.s.Failure())
		}
		if err := workload.VerifyPattern(d.pool, x.r.Room(), x.pg, 0); err != nil {
			t.Fatal(err)
		}
	}
	a := start(1)
	send(a)
	done(a)
	b := start(2)
	// B waits for A's slot past its waiting timeout's first half: still
	// WaitingForInput, its sender not told anything.
	time.Sleep(waiting / 2)
	if st := b.r.Poll(); st != engine.KVWaitingForInput {
		t.Fatalf("room B while the only slot is held: %s %v, want WaitingForInput", st, b.r.Failure())
	}
	waitSample(t, decReg, engine.MetricRingWaiters, nil, 1)
	a.r.Close()
	send(b)
	done(b)
	if tl, _ := d.m.RoomTimeline(2); !timelineHas(tl, "for a metadata ring slot (all 1 in use)") {
		t.Errorf("room B's timeline does not say it waited for a ring slot: %s", tl)
	}
	c := start(3)
	failStart := time.Now()
	if st := c.r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("room C with the only slot held: %s", st)
	}
	err := c.r.Failure()
	if !errors.Is(err, engine.ErrRingFull) || !errors.Is(err, engine.ErrTimeout) || !strings.Contains(err.Error(), "1 slots") {
		t.Fatalf("room C failure %v: want ErrRingFull and ErrTimeout naming the ring", err)
	}
	if st := c.s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(c.s.Failure().Error(), "metadata ring full") {
		t.Fatalf("room C's prefill: %s %v, want Failed naming the decode's full ring", st, c.s.Failure())
	}
	t.Logf("room C failed %s after Init (waiting timeout %s): %v; prefill: %v", time.Since(failStart).Round(time.Millisecond), waiting, err, c.s.Failure())
}

// TestEarlyFailureAnswered: a decode's TRANSFER is answered at once with the
// prefill's reason when the prefill's sender for the room failed and was
// closed before it arrived (AbortWith), and a TRANSFER for a room the
// prefill never gets is answered when its bootstrap timeout expires, not
// left to the decode's waiting timeout (issue 18 case 5).
func TestEarlyFailureAnswered(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: 1500 * time.Millisecond})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, waiting: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := p.m.NewSender(5)
	if err != nil {
		t.Fatal(err)
	}
	s.AbortWith(errors.New("out of KV pages"))
	s.Close()
	for _, c := range []struct {
		room uint64
		want string
	}{
		{5, "out of KV pages"},
		{6, "got no request for room 6 within its bootstrap timeout"},
	} {
		r, err := d.m.NewReceiver(addr, c.room)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		pg, _ := d.pool.Alloc(2)
		if err := r.Init(pg); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), c.want) {
			t.Fatalf("room %d: %s %v, want Failed naming %q", c.room, st, r.Failure(), c.want)
		}
		t.Logf("room %d failed %s after Init: %v", c.room, time.Since(start).Round(time.Millisecond), r.Failure())
	}
}
