package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// TestDecodeClosesBeforeSenderMarkedWritten: issue 22 case 1 on another
// path (kvxfer chaos's exit fault found it: the decode reported Success and
// closed at once, the prefill reported "peer lost"). The prefill's STATUS
// Success reaches the decode, which decides and closes its manager at once,
// while the sender goroutine that sent that STATUS is descheduled before it
// records that it now awaits the verdict. The prefill sees the decode's
// control connection drop meanwhile (its control loop, busy, reads the
// verdict later); it must wait for the verdict on its way, not fail the
// room at once as one still writing. Before: "peer lost".
func TestDecodeClosesBeforeSenderMarkedWritten(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	// The prefill's control loop reads the verdict late (busy), so that
	// it notices the decode's drop first.
	engine.SetBeforeDispatch(pre.m, func(typ string) {
		if typ == engine.MsgStatus {
			time.Sleep(300 * time.Millisecond)
		}
	})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	const room = 1200
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	// The decode closes the moment its room is Success; the sender stays
	// descheduled after its STATUS Success until then and a while after
	// (the prefill notices the drop within milliseconds).
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Errorf("receiver %s %v", st, r.Failure())
		}
		dec.m.Close()
	}()
	engine.SetAfterStatusSuccess(pre.m, func() {
		<-closed
		time.Sleep(time.Second)
	})
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	<-closed
	if ps := s.Wait(ctx, engine.KVSuccess); ps != engine.KVSuccess {
		t.Fatalf("decode Success then closed; prefill %s: %v", ps, s.Failure())
	}
}

// TestSuccessBeforeStatusLoopEndsHasLatency: a verdict that reaches the
// prefill while its sender is still sending STATUS Success moves the room to
// Success from the verdict path; the sender's TransferMetric must carry the
// transfer's latency then, not 0 (before: Latency was set only after the
// STATUS loop, so TestAuxRowAndPrefixReuse read "Latency:0s" under load).
func TestSuccessBeforeStatusLoopEndsHasLatency(t *testing.T) {
	addr, pre, dec := verdictPair(t, rankOpts{}, rankOpts{})
	const room = 1201
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	// Right after its STATUS Success the sender waits until the decode's
	// verdict made the room Success on the verdict path, and reads the
	// metric there.
	seen := make(chan engine.TransferMetric, 1)
	engine.SetAfterStatusSuccess(pre.m, func() {
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Errorf("receiver %s %v", st, r.Failure())
		}
		deadline := time.Now().Add(10 * time.Second)
		for s.Poll() != engine.KVSuccess && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if s.Poll() != engine.KVSuccess {
			t.Errorf("the verdict did not make the sender Success while its STATUS loop waited: %s", s.Poll())
		}
		seen <- s.TransferMetric()
	})
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if ps := s.Wait(ctx, engine.KVSuccess); ps != engine.KVSuccess {
		t.Fatalf("prefill %s: %v", ps, s.Failure())
	}
	if mt := <-seen; mt.Latency <= 0 {
		t.Fatalf("sender Success with TransferMetric.Latency %v, want the transfer's latency (> 0)", mt.Latency)
	}
}

// verdictPair starts a bootstrap server, a prefill rank on it and a decode
// rank (smallGQA, one rank each side): preOpts and decOpts, their role,
// model, sizes and the prefill's bootstrap address filled in.
func verdictPair(t *testing.T, preOpts, decOpts rankOpts) (addr string, pre, dec *rank) {
	t.Helper()
	addr = startBootstrap(t)
	preOpts.role, preOpts.model, preOpts.tp, preOpts.pp, preOpts.addr = engine.RolePrefill, smallGQA, 1, 1, addr
	decOpts.role, decOpts.model, decOpts.tp, decOpts.pp = engine.RoleDecode, smallGQA, 1, 1
	return addr, newRank(t, preOpts), newRank(t, decOpts)
}

// sendSucceeded sends src as room's last chunk through s and checks that
// both sides report Success (the prefill once the decode's verdict
// counted); what names the room in the failures.
func sendSucceeded(ctx context.Context, t *testing.T, what string, r *engine.Receiver, s *engine.Sender, src []int32) {
	t.Helper()
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("%s: sender %s %v", what, st, s.Failure())
	}
	if st := r.Poll(); st != engine.KVSuccess {
		t.Fatalf("%s: receiver %s %v", what, st, r.Failure())
	}
}

// bootstrappedRoom sets up room between prefill pre and decode dec (4 pages
// each side, the decode's receiver initialised, the prefill's sender in
// WaitingForInput, the source pages filled with the room's test pattern):
// the step both verdict tests start from. The sender is closed and the
// source pages freed when the test ends.
func bootstrappedRoom(ctx context.Context, t *testing.T, pre, dec *rank, addr string, room uint64) (*engine.Receiver, *engine.Sender, []int32) {
	t.Helper()
	dst, err := dec.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	r, err := dec.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Init(dst); err != nil {
		t.Fatal(err)
	}
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
	src, err := pre.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pre.pool.Free(src) })
	if err := workload.FillPattern(pre.pool, room, src, 0); err != nil {
		t.Fatal(err)
	}
	return r, s, src
}
