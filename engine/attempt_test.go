package engine_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/workload"
)

// Issue 22 item 6, the attempt id of protocol 7: a retry of a room on the
// same decode (same bootstrap_room) and a late frame of the attempt it
// retries are told apart by the attempt each names, whatever order a
// ZeroMQ reconnect with the registration kept delivers them in. Each test
// delivers a late frame of attempt 1 (forged with the real peer's identity
// and attempt number, as the reordered original would arrive) while
// attempt 2 is pending at the prefill or held by its sender, then runs
// attempt 2 to the end: both sides must report Success with attempt 2's
// bytes. Before protocol 7 each of them failed attempt 2 (or, for the late
// TRANSFER, served attempt 1 into the pages it had handed back).

// attemptPair is a prefill and a decode registered with each other, the
// decode able to lose its TRANSFERs on purpose.
type attemptPair struct {
	addr       string
	p, d       *rank
	dropTrans  atomic.Bool
	registered uint64 // the decode's registration epoch with the prefill
	// transfers counts the TRANSFERs the prefill dispatched; pingAfter
	// is set when it dispatched a PING after pingWant of them.
	transfers, pingWant atomic.Int64
	pingAfter           atomic.Bool
}

func newAttemptPair(t *testing.T) *attemptPair {
	ap := &attemptPair{addr: startBootstrap(t)}
	ap.p = newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: ap.addr})
	ap.d = newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, controlFault: func(peer, msgType string) bool {
		return msgType == engine.MsgTransfer && ap.dropTrans.Load()
	}})
	engine.SetBeforeDispatch(ap.p.m, func(msgType string) {
		switch msgType {
		case engine.MsgTransfer:
			ap.transfers.Add(1)
		case engine.MsgPing:
			if w := ap.pingWant.Load(); w > 0 && ap.transfers.Load() >= w {
				ap.pingAfter.Store(true)
			}
		}
	})
	sendOne(t, ap.addr, ap.p, ap.d, 1) // the decode registers with the prefill
	ap.registered = engine.RegistrationEpoch(ap.d.m, ap.p.m.Endpoint())
	return ap
}

// sendLate sends frames from the decode to the prefill, as the decode
// itself (its identity, its socket), and returns once the prefill handled
// them when they are a TRANSFER: the prefill dispatched a PING sent after
// it (one receive loop, in order).
// sentinelPages allocates attempt 1's three decode pages, freed when the
// test ends, and fills them with sentinel's pattern: what they hold once
// handed back, so a write of a later attempt into them shows.
func (ap *attemptPair) sentinelPages(t *testing.T, sentinel uint64) []int32 {
	t.Helper()
	pages, err := ap.d.pool.Alloc(3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ap.d.pool.Free(pages) })
	if err := workload.FillPattern(ap.d.pool, sentinel, pages, 0); err != nil {
		t.Fatal(err)
	}
	return pages
}

// sendLateTransfer sends (sendLate) the decode's TRANSFER of room into
// pages (metadata slot 0, generation 1, one destination, no aux row) under
// attempt: the copy of an earlier attempt's TRANSFER that arrives late.
func (ap *attemptPair) sendLateTransfer(t *testing.T, room uint64, pages []int32, attempt uint64) {
	t.Helper()
	ap.sendLate(t, (&control.TransferMsg{Room: room, Endpoint: ap.d.m.Endpoint(), Pages: pages, Slot: 0, Generation: 1, RequiredDstInfoNum: 1,
		Epoch: ap.registered, AuxIndex: -1, Attempt: attempt}).Encode())
}

func (ap *attemptPair) sendLate(t *testing.T, frames [][]byte) {
	t.Helper()
	isTransfer := string(frames[2]) == engine.MsgTransfer
	if isTransfer {
		ap.pingAfter.Store(false)
		ap.pingWant.Store(ap.transfers.Load() + 1)
	}
	if err := engine.SendControl(ap.d.m, ap.p.m.Endpoint(), frames); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); isTransfer && !ap.pingAfter.Load(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the prefill did not handle the late TRANSFER within 20 s")
		}
		if err := engine.SendControl(ap.d.m, ap.p.m.Endpoint(), (&control.PingMsg{Endpoint: ap.d.m.Endpoint()}).Encode()); err != nil {
			t.Fatal(err)
		}
	}
}

// concludedAttempt returns the attempt number of a receiver of room the
// decode created and closed without any frame of it reaching the prefill
// (its bootstrap address refuses connections, so it never found a
// producer): attempt 1, whose late ABORT or ABORT_ACK the tests deliver.
func (ap *attemptPair) concludedAttempt(t *testing.T, room uint64) uint64 {
	t.Helper()
	r1, err := ap.d.m.NewReceiver(unreachableBootstrap, room)
	if err != nil {
		t.Fatal(err)
	}
	a1 := engine.ReceiverAttempt(r1)
	r1.Refuse(errors.New("no KV pages free"))
	r1.Close()
	return a1
}

// unreachableBootstrap is a bootstrap address nothing listens on.
const unreachableBootstrap = "127.0.0.1:1"

// waitPending waits until the prefill holds a TRANSFER of room naming
// attempt, for a sender not created yet.
func (ap *attemptPair) waitPending(t *testing.T, room, attempt uint64) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()] == attempt {
			return
		}
	}
	t.Fatalf("room %d: the prefill holds no TRANSFER of attempt %d (holds %v)", room, attempt, engine.PendingTransferAttempts(ap.p.m, room))
}

// bothOrders runs test (on a new attemptPair, with a minute's context)
// once with attempt 2's TRANSFER pending at the prefill (senderFirst
// false) and once with the room's sender created first, holding it.
func bothOrders(t *testing.T, test func(t *testing.T, ctx context.Context, ap *attemptPair, senderFirst bool)) {
	for _, senderFirst := range []bool{false, true} {
		name := "attempt 2 pending"
		if senderFirst {
			name = "sender holds attempt 2"
		}
		t.Run(name, func(t *testing.T) {
			ap := newAttemptPair(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			test(t, ctx, ap, senderFirst)
		})
	}
}

// startRetry starts attempt 2 of room: a receiver into 3 new pages and,
// when senderFirst, the room's sender created before it (returned once it
// holds the receiver's TRANSFER; else nil, once the prefill holds that
// TRANSFER pending). Closed and freed when the test ends.
func (ap *attemptPair) startRetry(t *testing.T, ctx context.Context, room uint64, senderFirst bool) (*engine.Receiver, *engine.Sender, []int32) {
	t.Helper()
	var s *engine.Sender
	if senderFirst {
		var err error
		if s, err = ap.p.m.NewSender(room); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
	}
	dp, _ := ap.d.pool.Alloc(3)
	t.Cleanup(func() { ap.d.pool.Free(dp) })
	r, err := ap.d.m.NewReceiver(ap.addr, room)
	if err != nil {
		t.Fatalf("attempt 2: %v", err)
	}
	t.Cleanup(r.Close)
	if err := r.Init(dp); err != nil {
		t.Fatal(err)
	}
	if senderFirst {
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("sender %s %v", st, s.Failure())
		}
	} else {
		ap.waitPending(t, room, engine.ReceiverAttempt(r))
	}
	return r, s, dp
}

// finish runs attempt 2 (receiver r into pages dp) to the end with sender
// s (created now when nil) and checks both sides and the bytes.
func (ap *attemptPair) finish(t *testing.T, ctx context.Context, room uint64, r *engine.Receiver, s *engine.Sender, dp []int32) {
	t.Helper()
	if s == nil {
		var err error
		if s, err = ap.p.m.NewSender(room); err != nil {
			t.Fatal(err)
		}
		defer s.Close()
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("room %d attempt 2: sender %s %v, want WaitingForInput", room, st, s.Failure())
	}
	sp, err := ap.p.pool.Alloc(len(dp))
	if err != nil {
		t.Fatal(err)
	}
	defer ap.p.pool.Free(sp)
	_ = workload.FillPattern(ap.p.pool, room, sp, 0)
	if err := s.Send(sp, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("room %d attempt 2: decode %s %v, want Success", room, st, r.Failure())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("room %d attempt 2: prefill %s %v, want Success", room, st, s.Failure())
	}
	if err := workload.VerifyPattern(ap.d.pool, room, dp, 0); err != nil {
		t.Fatalf("room %d attempt 2: %v", room, err)
	}
}

// TestLateAbortOfEarlierAttemptIgnored: the decode refused attempt 1 of a
// room before sending TRANSFER (its pages were never handed out, so the
// receiver closed at once) and its ABORT is delivered only after attempt
// 2's TRANSFER. The prefill must not apply it to attempt 2: neither drop
// the pending TRANSFER (before: the retry's sender then failed after
// earlyAbortGrace, the decode waited its timeout) nor fail the sender that
// holds it; and its ABORT_ACK, naming attempt 1, must not fence or fail
// attempt 2 on the decode (before: "stopped writing").
func TestLateAbortOfEarlierAttemptIgnored(t *testing.T) {
	bothOrders(t, func(t *testing.T, ctx context.Context, ap *attemptPair, senderFirst bool) {
		const room = 41
		a1 := ap.concludedAttempt(t, room)

		r2, s, dp := ap.startRetry(t, ctx, room, senderFirst)
		a2 := engine.ReceiverAttempt(r2)
		if a2 <= a1 {
			t.Fatalf("attempt 2 is numbered %d, attempt 1 %d: want a larger number", a2, a1)
		}
		ap.sendLate(t, (&control.AbortMsg{Room: room, Endpoint: ap.d.m.Endpoint(), Reason: "no KV pages free", Attempt: a1}).Encode())
		if senderFirst {
			waitTimeline(t, ap.p.m, room, "ABORT of attempt")
		} else {
			// The prefill acknowledges an early ABORT at once; the
			// decode puts the acknowledgement of attempt 1 aside.
			waitTimeline(t, ap.d.m, room, "stale ABORT_ACK ignored")
			if got := engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()]; got != a2 {
				t.Fatalf("after attempt 1's ABORT the prefill holds TRANSFER of attempt %d, want attempt 2's (%d)", got, a2)
			}
		}
		ap.finish(t, ctx, room, r2, s, dp)
	})
}

// TestLateTransferOfAbortedAttemptDropped: attempt 1's TRANSFER reaches
// the prefill only after its ABORT (the prefill held no sender: it
// acknowledged the ABORT at once, so the decode handed attempt 1's pages
// back) and after attempt 2's TRANSFER. It must be dropped, not served as
// the retry: no byte may land in attempt 1's pages, and attempt 2 succeeds
// (before: it replaced attempt 2's TRANSFER and the sender wrote attempt
// 1's pages).
func TestLateTransferOfAbortedAttemptDropped(t *testing.T) {
	bothOrders(t, func(t *testing.T, ctx context.Context, ap *attemptPair, senderFirst bool) {
		const room, sentinel = 42, 1<<40 + 42
		dp1 := ap.sentinelPages(t, sentinel) // what attempt 1's pages hold once handed back
		a1 := ap.abortedBeforeTransfer(t, ctx, room, dp1)

		r2, s, dp2 := ap.startRetry(t, ctx, room, senderFirst)
		ap.sendLateTransfer(t, room, dp1, a1)
		if !senderFirst {
			if got := engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()]; got != engine.ReceiverAttempt(r2) {
				t.Errorf("after attempt 1's late TRANSFER the prefill holds TRANSFER of attempt %d, want attempt 2's (%d)", got, engine.ReceiverAttempt(r2))
			}
		}
		ap.finish(t, ctx, room, r2, s, dp2)
		if err := workload.VerifyPattern(ap.d.pool, sentinel, dp1, 0); err != nil {
			t.Fatalf("attempt 1's pages, handed back at its ABORT_ACK, were written: %v", err)
		}
		waitTimeline(t, ap.p.m, room, "TRANSFER of attempt")
	})
}

// abortedBeforeTransfer runs attempt 1 of room into pages dp: its
// TRANSFER is held back (sent, not delivered), the decode aborts it, the
// prefill (no sender yet) acknowledges the ABORT clean and the receiver is
// closed. It returns attempt 1's number, whose TRANSFER a test delivers
// late.
func (ap *attemptPair) abortedBeforeTransfer(t *testing.T, ctx context.Context, room uint64, dp []int32) uint64 {
	t.Helper()
	ap.dropTrans.Store(true)
	r1, err := ap.d.m.NewReceiver(ap.addr, room)
	if err != nil {
		t.Fatal(err)
	}
	a1 := engine.ReceiverAttempt(r1)
	if err := r1.Init(dp); err != nil {
		t.Fatal(err)
	}
	if st := r1.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("attempt 1: %s %v", st, r1.Failure())
	}
	waitTimeline(t, ap.d.m, room, "TRANSFER sent")
	ap.dropTrans.Store(false)
	r1.Abort()
	select {
	case <-r1.Fenced(): // the prefill's clean ABORT_ACK: attempt 1's pages are the caller's again
	case <-ctx.Done():
		t.Fatal("attempt 1 never fenced")
	}
	r1.Close()
	return a1
}

// TestLateTransferAfterRetrySucceededDropped: attempt 1's TRANSFER reaches
// the prefill after its ABORT and after attempt 2 of the room succeeded
// and its sender closed. It is a concluded attempt of a room this prefill
// finished: dropped at once, with a timeline event (before: it waited in
// the pending TRANSFER table until the bootstrap timeout, then was
// rejected with a STATUS Failed for a room the decode may be using again).
func TestLateTransferAfterRetrySucceededDropped(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const room = 44
	dp1, _ := ap.d.pool.Alloc(3)
	defer ap.d.pool.Free(dp1)
	a1 := ap.abortedBeforeTransfer(t, ctx, room, dp1)

	r2, _, dp2 := ap.startRetry(t, ctx, room, false)
	ap.finish(t, ctx, room, r2, nil, dp2) // its sender is closed when it returns

	ap.sendLateTransfer(t, room, dp1, a1)
	if got, held := engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()]; held {
		t.Fatalf("the prefill holds attempt %d's late TRANSFER of room %d (closed with Success) until its bootstrap timeout; want it dropped at once", got, room)
	}
	waitTimeline(t, ap.p.m, room, "closed with Success since")
}

// TestStaleAbortAckIgnored: an ABORT_ACK naming attempt 1 of a room reaches
// the decode while attempt 2 is transferring. It must neither fence
// attempt 2's producer nor fail the room (before: the decode took it for
// its own, failed the room "stopped writing" and handed its pages back
// while the producer was about to write them).
func TestStaleAbortAckIgnored(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const room = 43
	a1 := ap.concludedAttempt(t, room)
	s, err := ap.p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	dp, _ := ap.d.pool.Alloc(3)
	defer ap.d.pool.Free(dp)
	r2, err := ap.d.m.NewReceiver(ap.addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.Init(dp); err != nil {
		t.Fatal(err)
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
	for _, epoch := range []uint64{0, ap.registered} {
		ack := (&control.AbortAckMsg{Room: room, Endpoint: ap.p.m.Endpoint(), Producer: 0, Epoch: epoch, Clean: true, Detail: "attempt 1 acknowledged", Attempt: a1}).Encode()
		if err := engine.SendControl(ap.p.m, ap.d.m.Endpoint(), ack); err != nil {
			t.Fatal(err)
		}
	}
	waitTimeline(t, ap.d.m, room, "stale ABORT_ACK ignored", "stale ABORT_ACK ignored")
	select {
	case <-r2.Fenced():
		t.Fatalf("attempt 2 counted fenced by attempt 1's ABORT_ACK (state %s %v)", r2.Poll(), r2.Failure())
	default:
	}
	ap.finish(t, ctx, room, r2, s, dp)
}

// TestLateTransferAfterIgnoredAbortDropped: attempt 2 of a room is held by
// its sender when attempt 1's ABORT arrives late (the sender ignores it:
// it serves attempt 2), and then attempt 1's TRANSFER, later still. That
// ABORT reached the sender, not the prefill before the sender existed, so
// it is in no early-abort record; the TRANSFER must still be dropped, not
// replace attempt 2's destination: no byte may land in attempt 1's pages
// (which the decode may have handed to another room) and attempt 2
// succeeds with its own bytes (before: the sender took attempt 1's pages,
// aux row and slot as the decode's destination and wrote there, and the
// decode failed attempt 2 "metadata slot not committed"). After the sender
// closed with Success, a copy of that TRANSFER is dropped too.
func TestLateTransferAfterIgnoredAbortDropped(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const room, sentinel = 45, 1<<40 + 45
	dp1 := ap.sentinelPages(t, sentinel) // what attempt 1's pages hold once handed back
	a1 := ap.concludedAttempt(t, room)

	r2, s, dp2 := ap.startRetry(t, ctx, room, true)
	ap.sendLate(t, (&control.AbortMsg{Room: room, Endpoint: ap.d.m.Endpoint(), Reason: "no KV pages free", Attempt: a1}).Encode())
	waitTimeline(t, ap.p.m, room, "ABORT of attempt")
	ap.sendLateTransfer(t, room, dp1, a1)
	if got, want := engine.SenderDstAttempt(s, ap.d.m.Endpoint()), engine.ReceiverAttempt(r2); got != want {
		t.Errorf("after attempt 1's late TRANSFER the sender's destination is attempt %d, want attempt 2's (%d)", got, want)
	}
	ap.finish(t, ctx, room, r2, s, dp2)
	if err := workload.VerifyPattern(ap.d.pool, sentinel, dp1, 0); err != nil {
		t.Fatalf("attempt 1's pages were written by attempt 2's sender: %v", err)
	}
	waitTimeline(t, ap.p.m, room, "ABORT of attempt", "TRANSFER of attempt")

	// Once the sender closed with Success the prefill still knows
	// attempt 1 as aborted: a copy of its TRANSFER is dropped at once, not
	// left pending for the room's next sender to serve.
	s.Close()
	ap.sendLateTransfer(t, room, dp1, a1)
	if got, held := engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()]; held {
		t.Fatalf("after room %d closed with Success the prefill holds attempt %d's late TRANSFER for its next sender; want it dropped", room, got)
	}
	waitTimeline(t, ap.p.m, room, "closed with Success since")
}

// TestLateTransferOfEarlierAttemptSameDecodeDropped: attempt 1's ABORT
// never reached the prefill (here: no frame of attempt 1 did), and its
// TRANSFER arrives late while the sender holds attempt 2 of the same room
// from the same decode process. Within one decode process attempt numbers
// only grow, so the smaller one is a concluded attempt: dropped, not made
// the destination (before: it replaced attempt 2's destination and the
// sender wrote attempt 2's KV into attempt 1's pages, which the decode may
// have handed to another room).
func TestLateTransferOfEarlierAttemptSameDecodeDropped(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const room, sentinel = 46, 1<<40 + 46
	dp1 := ap.sentinelPages(t, sentinel) // what attempt 1's pages hold once handed back
	a1 := ap.concludedAttempt(t, room)

	r2, s, dp2 := ap.startRetry(t, ctx, room, true)
	ap.sendLateTransfer(t, room, dp1, a1)
	if got, want := engine.SenderDstAttempt(s, ap.d.m.Endpoint()), engine.ReceiverAttempt(r2); got != want {
		t.Errorf("after attempt 1's late TRANSFER the sender's destination is attempt %d, want attempt 2's (%d)", got, want)
	}
	ap.finish(t, ctx, room, r2, s, dp2)
	if err := workload.VerifyPattern(ap.d.pool, sentinel, dp1, 0); err != nil {
		t.Fatalf("attempt 1's pages were written by attempt 2's sender: %v", err)
	}
	waitTimeline(t, ap.p.m, room, "from the same decode process")
}

// TestAbortBeforeDstIsEarlyAbort: the room's sender exists (the prefill's
// own request came first) and attempt 1's ABORT reaches it before any
// TRANSFER of that decode; then attempt 1's TRANSFER, late, then attempt
// 2's. The ABORT must not fail the sender: it is an early abort of
// attempt 1 (acknowledged clean), so attempt 1's TRANSFER is dropped (no
// byte in its pages) and attempt 2 is served to Success (before: the
// sender failed "aborted by decode", and attempt 2 with it).
func TestAbortBeforeDstIsEarlyAbort(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const room, sentinel = 47, 1<<40 + 47
	dp1 := ap.sentinelPages(t, sentinel) // what attempt 1's pages hold once handed back
	a1 := ap.concludedAttempt(t, room)
	s, err := ap.p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ap.sendLate(t, (&control.AbortMsg{Room: room, Endpoint: ap.d.m.Endpoint(), Reason: "no KV pages free", Attempt: a1}).Encode())
	waitTimeline(t, ap.p.m, room, "before that decode's TRANSFER")
	if st := s.Poll(); st == engine.KVFailed {
		t.Fatalf("attempt 1's ABORT, before any TRANSFER of that decode, failed the sender: %v", s.Failure())
	}
	ap.sendLateTransfer(t, room, dp1, a1)
	if got := engine.SenderDstAttempt(s, ap.d.m.Endpoint()); got != 0 {
		t.Fatalf("the sender took aborted attempt %d's late TRANSFER as its destination", got)
	}
	dp2, _ := ap.d.pool.Alloc(3)
	defer ap.d.pool.Free(dp2)
	r2, err := ap.d.m.NewReceiver(ap.addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.Init(dp2); err != nil {
		t.Fatal(err)
	}
	ap.finish(t, ctx, room, r2, s, dp2)
	if err := workload.VerifyPattern(ap.d.pool, sentinel, dp1, 0); err != nil {
		t.Fatalf("attempt 1's pages were written: %v", err)
	}
	waitTimeline(t, ap.p.m, room, "before that decode's TRANSFER", "TRANSFER of attempt")
}

// TestAbortBeforeDstOfOnlyAttemptFails: the decode aborts the only
// attempt of a room before its TRANSFER reached the live sender, and
// sends none after: the sender still ends Failed, naming the ABORT, within
// the grace of an early ABORT (earlyAbortGrace), not the bootstrap
// timeout.
func TestAbortBeforeDstOfOnlyAttemptFails(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	const room = 48
	a1 := ap.concludedAttempt(t, room)
	s, err := ap.p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start := time.Now()
	ap.sendLate(t, (&control.AbortMsg{Room: room, Endpoint: ap.d.m.Endpoint(), Reason: "no KV pages free", Attempt: a1}).Encode())
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("sender %s after the decode aborted its only attempt, want Failed", st)
	}
	if err := s.Failure(); !errors.Is(err, engine.ErrAborted) || !strings.Contains(err.Error(), "no KV pages free") {
		t.Fatalf("sender failure %v: want ErrAborted naming the decode's reason", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the sender failed %s after the ABORT: want about earlyAbortGrace", d)
	}
}

// TestLateTransferOfEarlierAttemptSameDecodeNotPending: as
// TestLateTransferOfEarlierAttemptSameDecodeDropped, with attempt 2's
// TRANSFER waiting for the room's sender: attempt 1's late TRANSFER must
// not replace it (before: it did, and the sender, once created, wrote
// attempt 1's pages and failed attempt 2).
func TestLateTransferOfEarlierAttemptSameDecodeNotPending(t *testing.T) {
	ap := newAttemptPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const room, sentinel = 49, 1<<40 + 49
	dp1 := ap.sentinelPages(t, sentinel) // what attempt 1's pages hold once handed back
	a1 := ap.concludedAttempt(t, room)

	r2, _, dp2 := ap.startRetry(t, ctx, room, false)
	ap.sendLateTransfer(t, room, dp1, a1)
	if got, want := engine.PendingTransferAttempts(ap.p.m, room)[ap.d.m.Endpoint()], engine.ReceiverAttempt(r2); got != want {
		t.Errorf("after attempt 1's late TRANSFER the prefill holds TRANSFER of attempt %d, want attempt 2's (%d)", got, want)
	}
	ap.finish(t, ctx, room, r2, nil, dp2)
	if err := workload.VerifyPattern(ap.d.pool, sentinel, dp1, 0); err != nil {
		t.Fatalf("attempt 1's pages were written: %v", err)
	}
}
