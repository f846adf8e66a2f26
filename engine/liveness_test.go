package engine_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// TestStalledControlLoopNoFalsePeerLoss: the decode's control loop is
// blocked for 1.25 × PeerTimeout while a room waits on its prefill (as when
// the process is starved of CPU). The prefill's PINGs queue in the decode's
// inbox meanwhile, so the decode must not declare it silent, and the
// decode's own PINGs pause for less than PeerTimeout, so the prefill must
// not declare the decode silent either: the room completes on both sides.
func TestStalledControlLoopNoFalsePeerLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a multi-second stall")
	}
	const peerTimeout = 6 * time.Second
	const stall = peerTimeout * 5 / 4
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, peerTmo: peerTimeout, waiting: time.Minute})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: peerTimeout, waiting: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	const room = 77
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := d.pool.Alloc(4)
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	s, err := p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s: %v", st, s.Failure())
	}

	// Block the decode's receive loop on the next message (a PING).
	var armed atomic.Bool
	blocked := make(chan struct{})
	armed.Store(true)
	engine.SetBeforeDispatch(d.m, func(string) {
		if armed.CompareAndSwap(true, false) {
			close(blocked)
			time.Sleep(stall)
		}
	})
	select {
	case <-blocked:
	case <-ctx.Done():
		t.Fatal("the decode received nothing to block on")
	}
	start := time.Now()
	// While the decode's loop is stuck, the prefill writes the room.
	src, _ := p.pool.Alloc(s.DstPages())
	if err := workload.FillPattern(p.pool, room, src, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("decode after a %s control-loop stall (peer timeout %s): %s %v", stall, peerTimeout, st, r.Failure())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("prefill after the decode's %s control-loop stall: %s %v", stall, st, s.Failure())
	}
	if el := time.Since(start); el < stall*3/4 {
		t.Fatalf("room finished %s into a %s stall: the hook did not block the loop", el, stall)
	}
	if err := workload.VerifyPattern(d.pool, room, pg, 0); err != nil {
		t.Fatal(err)
	}
}

// TestStoppedPeerStillLost: a prefill process that is SIGSTOPped mid-room is
// still declared lost (silent) and the decode's room fails, within a few
// PeerTimeouts, not at its waiting timeout.
func TestStoppedPeerStillLost(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	const peerTimeout = 2 * time.Second
	addr := startBootstrap(t)
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, pages: 256, peerTmo: peerTimeout, waiting: 5 * time.Minute})
	cmd, r := helperPrefillStarted(t, addr, d, 515151)
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := r.Wait(ctx, engine.KVSuccess)
	if st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) || !strings.Contains(r.Failure().Error(), "silent") {
		t.Fatalf("receiver after SIGSTOP of its prefill: %s %v, want Failed: peer lost … silent", st, r.Failure())
	}
	t.Logf("decode failed the room %s after SIGSTOP of the prefill (peer timeout %s): %v", time.Since(start).Round(time.Millisecond), peerTimeout, r.Failure())
}
