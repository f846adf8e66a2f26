package engine_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// TestAbortDuringTransferSendNotServed: the decode fails a room while it is
// sending TRANSFER to a prefill that does not hold the room yet (the room's
// ABORT is sent from another goroutine). The ABORT must reach the prefill
// after the TRANSFER: the prefill serves a TRANSFER that comes after an early
// ABORT as a retry of the room (retry with the same bootstrap_room), so an
// ABORT that overtook its TRANSFER let the aborted attempt's TRANSFER be
// served into pages the decode had already handed back once the prefill
// acknowledged the ABORT: a stale writer into reused pages, the chaos
// soak's silent corruption (bench/RESULTS.md). Before the fix the ABORT went
// first, the prefill's sender reached WaitingForInput and overwrote the
// next room's bytes.
//
// Each way a decode fails a room is tried: the caller's Abort (failLocal's
// ABORT), and the bootstrap heartbeat giving up on the prefill instance
// (which also sends its own ABORT to every producer). In both the TRANSFER
// is released well within the fence timeout (a minute here), so the pages
// can only come back by the prefill's clean ABORT_ACK: the path where the
// order matters.
//
// "held past the fence timeout" is the third way: the TRANSFER (and so the
// ABORT after it) is held until the decode gave up waiting for the
// acknowledgement and fenced the data path, then released. The prefill
// cannot tell that TRANSFER from a live one and may serve it, but the
// fenced epoch admits no byte: its sender must fail and the reused pages
// must keep the next room's bytes. (The heartbeat case used to hold the
// TRANSFER ten seconds, past the default fence timeout, and then asserted
// that the sender never reached WaitingForInput; it failed about one run in
// three while no byte ever landed.)
func TestAbortDuringTransferSendNotServed(t *testing.T) {
	for _, how := range []string{"abort", "bootstrap lost", "held past the fence timeout"} {
		t.Run(how, func(t *testing.T) { abortDuringTransferSend(t, how) })
	}
}

func abortDuringTransferSend(t *testing.T, how string) {
	const room = 31
	addr, stopBootstrap := stoppableBootstrap(t, 0)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: 10 * time.Second})
	var (
		recv      atomic.Pointer[engine.Receiver]
		armed     atomic.Bool
		abortSeen = make(chan struct{}, 16)
	)
	fenceTmo := time.Minute
	if how == "held past the fence timeout" {
		fenceTmo = 300 * time.Millisecond
	}
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootHB: 100 * time.Millisecond, fenceTmo: fenceTmo, controlFault: func(peer, msgType string) bool {
		switch msgType {
		case engine.MsgAbort:
			select {
			case abortSeen <- struct{}{}:
			default:
			}
		case engine.MsgTransfer:
			if r := recv.Load(); r != nil && armed.CompareAndSwap(true, false) {
				// The room fails while its TRANSFER is on its way out:
				// give the ABORT every chance to overtake it.
				wait := time.Second
				switch how {
				case "abort":
					r.Abort()
				case "bootstrap lost":
					stopBootstrap() // the heartbeat gives up after its failures
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					r.Wait(ctx, engine.KVSuccess) // Failed once it gave up
					cancel()
				default:
					r.Abort()
					select { // the data path fenced: the pages are reusable
					case <-r.Fenced():
					case <-time.After(20 * time.Second):
					}
					return false
				}
				select {
				case <-abortSeen:
					time.Sleep(200 * time.Millisecond) // let it reach the socket
				case <-time.After(wait):
				}
			}
		}
		return false
	}})

	pages, err := dec.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(pages)
	r, err := dec.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	recv.Store(r)
	armed.Store(true)
	if err := r.Init(pages); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("decode room: %s (%v), want Failed (%s)", st, r.Failure(), how)
	}
	select {
	case <-r.Fenced():
	case <-ctx.Done():
		t.Fatal("the aborted room's pages were never handed back")
	}
	// The pages are reusable: the next room's bytes land in them.
	const next = 32
	if err := workload.FillPattern(dec.pool, next, pages, 0); err != nil {
		t.Fatal(err)
	}

	// The prefill only now creates the room (its request came late).
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st == engine.KVWaitingForInput {
		// The aborted attempt's TRANSFER is being served: write as a
		// prefill would, and see whether it reaches the reused pages.
		// Past the fence timeout that is allowed (the ABORT comes after
		// it), as long as nothing lands.
		src, err := pre.pool.Alloc(s.DstPages())
		if err != nil {
			t.Fatal(err)
		}
		defer pre.pool.Free(src)
		if err := workload.FillPattern(pre.pool, room, src, 0); err != nil {
			t.Fatal(err)
		}
		_ = s.Send(src, true)
		s.Wait(ctx, engine.KVSuccess)
		if how != "held past the fence timeout" {
			t.Errorf("the prefill served the aborted attempt's TRANSFER (sender reached WaitingForInput, then %s)", s.Poll())
		}
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Errorf("the aborted attempt's sender: %s, want Failed", st)
	}
	if err := workload.VerifyPattern(dec.pool, next, pages, 0); err != nil {
		t.Errorf("reused pages overwritten by the aborted attempt's producer: %v", err)
	}
}

// TestStaleTransferNotServedOnNewRegistration: a TRANSFER that waits on the
// prefill for a room it does not hold yet belongs to the registration (data
// path epoch) it came on. When the decode gave up on that attempt (its
// ABORT lost, the data path fenced at the fence timeout, the pages handed
// back) and registered again for its next room, the late NewSender must not
// serve the old TRANSFER over the new registration: that wrote the failed
// attempt's bytes through the new, admitted epoch into pages another room
// held (the chaos soak's silent corruption: a stale writer whose bytes
// land after the reused pages were handed out).
func TestStaleTransferNotServedOnNewRegistration(t *testing.T) {
	const room, next, other = 41, 42, 43
	addr, _ := stoppableBootstrap(t, 0)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: 2 * time.Second})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, fenceTmo: 300 * time.Millisecond,
		controlFault: func(peer, msgType string) bool { return msgType == engine.MsgAbort }}) // every ABORT lost
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	pages, err := dec.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(pages)
	r, err := dec.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Init(pages); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("decode room %d: %s (%v), want Transferring", room, st, r.Failure())
	}
	// The prefill has not created the room yet: its TRANSFER waits there.
	// The decode gives up; the ABORT never arrives, so the fence timeout
	// fences the data path and drops the registration.
	r.Abort()
	select {
	case <-r.Fenced():
	case <-ctx.Done():
		t.Fatal("the aborted room's pages were never handed back")
	}
	// The decode's next room registers again (a new epoch) ...
	pages2, err := dec.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(pages2)
	r2, err := dec.m.NewReceiver(addr, other)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.Init(pages2); err != nil {
		t.Fatal(err)
	}
	if st := r2.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("decode room %d: %s (%v), want Transferring", other, st, r2.Failure())
	}
	// ... and the first room's pages hold another room's bytes now.
	if err := workload.FillPattern(dec.pool, next, pages, 0); err != nil {
		t.Fatal(err)
	}

	// The prefill only now creates the first room (its request came late).
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st == engine.KVWaitingForInput {
		src, err := pre.pool.Alloc(s.DstPages())
		if err != nil {
			t.Fatal(err)
		}
		defer pre.pool.Free(src)
		if err := workload.FillPattern(pre.pool, room, src, 0); err != nil {
			t.Fatal(err)
		}
		_ = s.Send(src, true)
		s.Wait(ctx, engine.KVSuccess)
		t.Errorf("the prefill served the TRANSFER of a fenced registration over the new one (sender reached WaitingForInput, then %s)", s.Poll())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Errorf("the stale attempt's sender: %s, want Failed", st)
	}
	if err := workload.VerifyPattern(dec.pool, next, pages, 0); err != nil {
		t.Errorf("reused pages overwritten by the fenced attempt's producer: %v", err)
	}
}
