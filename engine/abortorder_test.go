package engine_test

import (
	"context"
	"os"
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
// (which also sends its own ABORT to every producer).
func TestAbortDuringTransferSendNotServed(t *testing.T) {
	for _, how := range []string{"abort", "bootstrap lost"} {
		t.Run(how, func(t *testing.T) {
			if how == "bootstrap lost" && os.Getenv("KVXFER_TEST_OPEN_BUGS") == "" {
				// Open (issue 22; bench/RESULTS.md, the fencing soak's
				// "still open" paragraphs): when the bootstrap heartbeat
				// fails the room, the aborted attempt's TRANSFER is still
				// served now and then (about 1 run in 3 under -race), a
				// stale writer into reused pages, as in the chaos soak.
				// KVXFER_TEST_OPEN_BUGS=1 runs it.
				t.Skip("open bug: the bootstrap-heartbeat ABORT path can still let the aborted attempt's TRANSFER be served; set KVXFER_TEST_OPEN_BUGS=1 to run")
			}
			abortDuringTransferSend(t, how)
		})
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
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootHB: 100 * time.Millisecond, controlFault: func(peer, msgType string) bool {
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
				if how == "abort" {
					r.Abort()
				} else {
					stopBootstrap() // the heartbeat gives up after its failures
					wait = 10 * time.Second
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
		t.Errorf("the prefill served the aborted attempt's TRANSFER (sender reached WaitingForInput, then %s)", s.Poll())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Errorf("the aborted attempt's sender: %s, want Failed", st)
	}
	if err := workload.VerifyPattern(dec.pool, next, pages, 0); err != nil {
		t.Errorf("reused pages overwritten by the aborted attempt's producer: %v", err)
	}
}
