package engine_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/workload"
)

// Issue 22 case 1: a decode that closes its manager the moment its room
// reached Success (its process exits) still delivers the Success verdict it
// decided, and the prefill, which then sees the decode's control connection
// drop, reports the room Success, not "peer lost". A fresh decode each run:
// the verdict raced the close in a fraction of the runs. The two races are
// made certain: the decode's verdict goroutine descheduled past the close,
// and the prefill's control loop busy when the verdict arrives, so that it
// notices the drop first.
func TestDecodeClosesRightAfterSuccess(t *testing.T) {
	for _, c := range []struct {
		name      string
		slowSend  bool
		slowRead  bool
		firstRoom uint64
	}{
		{"verdict sent late", true, false, 900},
		{"verdict read late", false, true, 950},
		{"no delay", false, false, 1000},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := startBootstrap(t)
			pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
			if c.slowRead {
				engine.SetBeforeDispatch(pre.m, func(typ string) {
					if typ == engine.MsgStatus {
						time.Sleep(100 * time.Millisecond)
					}
				})
			}
			for i := range uint64(10) {
				closeAfterSuccess(t, addr, pre, c.firstRoom+i, c.slowSend)
			}
		})
	}
}

// closeAfterSuccess runs room through pre and a new decode, closes the
// decode's manager the moment its room is Success, and fails the test
// unless the prefill reports Success too.
func closeAfterSuccess(t *testing.T, addr string, pre *rank, room uint64, slowSend bool) {
	t.Helper()
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	if slowSend {
		engine.SetBeforeVerdict(dec.m, func() { time.Sleep(20 * time.Millisecond) })
	}
	closeAfterSuccessOn(t, addr, pre, dec, room)
}

// closeAfterSuccessOn is closeAfterSuccess with the decode given.
func closeAfterSuccessOn(t *testing.T, addr string, pre, dec *rank, room uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
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
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("room %d: sender %s %v", room, st, s.Failure())
	}
	src, err := pre.pool.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	defer pre.pool.Free(src)
	if err := workload.FillPattern(pre.pool, room, src, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("room %d: receiver %s %v", room, st, r.Failure())
	}
	dec.m.Close() // at once, as a decode process that exits
	if ps := s.Wait(ctx, engine.KVSuccess); ps != engine.KVSuccess {
		t.Fatalf("room %d: decode Success, prefill %s: %v", room, ps, s.Failure())
	}
}

// Issue 22 case 1, the restart on the same address: the prefill's re-ask
// for a verdict reaches the decode's new incarnation, which answers that it
// has no such room, before the old incarnation's Success verdict (sent by
// its graceful close) arrives on its own connection. The prefill must wait
// for that verdict (verdictGrace) instead of failing the room on the "no
// room" answer. The race is made certain: the decode sends the "no room"
// ABORT itself right before its real verdict.
func TestNoRoomAnswerBeforeVerdictOfClosingDecode(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	for i := range uint64(5) {
		room := 1100 + i
		dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
		engine.SetBeforeVerdict(dec.m, func() {
			noRoom := (&control.AbortMsg{Room: room, Endpoint: dec.m.Endpoint(),
				Reason: fmt.Sprintf("decode %s has no room %d (closed long ago, or never created here)", dec.m.Endpoint(), room)}).Encode()
			if err := engine.SendControl(dec.m, pre.m.Endpoint(), noRoom); err != nil {
				t.Errorf("room %d: sending the no-room ABORT: %v", room, err)
			}
		})
		closeAfterSuccessOn(t, addr, pre, dec, room)
	}
}

// holdStatuses makes m's control loop hold every STATUS it receives, before
// dispatching it, until release is closed (10 s at most each); the channel
// it returns is closed when the first STATUS is held.
func holdStatuses(m *engine.Manager, release <-chan struct{}) <-chan struct{} {
	held := make(chan struct{})
	var once sync.Once
	engine.SetBeforeDispatch(m, func(typ string) {
		if typ != engine.MsgStatus {
			return
		}
		once.Do(func() { close(held) })
		select {
		case <-release:
		case <-time.After(10 * time.Second):
		}
	})
	return held
}

// Issue 22 case 1, a room decided while its decode closes (kvxfer chaos: a
// room in flight when another room's exit or a restart closed the decode):
// the prefill's STATUS Success is dispatched after Manager.Close waited for
// the verdicts decided before it, and the verdict's goroutine runs once the
// manager counts as closed. Both sides must report the same outcome. Before:
// the decode reported Success, its verdict's send found the manager closed,
// and the prefill failed the room ("peer lost") once the grace was over.
func TestRoomDecidedWhileDecodeCloses(t *testing.T) {
	addr, pre, dec := verdictPair(t, rankOpts{}, rankOpts{})
	const room = 1300
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	// The STATUS Success waits in the decode's control loop until Close
	// has waited for the verdicts decided before it; Close then waits
	// there until the room is decided; the verdict's goroutine is
	// descheduled past the rest of Close.
	flushed := make(chan struct{})
	held := holdStatuses(dec.m, flushed)
	engine.SetAfterVerdictFlush(dec.m, func() {
		close(flushed)
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if p := r.Poll(); p == engine.KVSuccess || p == engine.KVFailed {
				return
			}
		}
	})
	engine.SetBeforeVerdict(dec.m, func() { time.Sleep(100 * time.Millisecond) })
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("the prefill's STATUS never reached the decode")
	}
	dec.m.Close()
	ds := r.Poll()
	if ds != engine.KVSuccess && ds != engine.KVFailed {
		t.Fatalf("decode still %s after its manager closed", ds)
	}
	if ps := s.Wait(ctx, engine.KVSuccess); ps != ds {
		t.Fatalf("decode %s (%v), prefill %s (%v): the two sides disagree", ds, r.Failure(), ps, s.Failure())
	}
}

// Issue 22 case 1, a restart on the same address under load: the decode's
// old incarnation decides the room, sends its Success verdict and closes;
// its new incarnation on the same control port registers with the prefill,
// and the prefill's control loop, behind, dispatches that REGISTER before
// the old incarnation's verdict (ZeroMQ reads its connections in turn, not
// in arrival order). The verdict comes from the instance the room was
// served to and must count. Before: it was dropped as a frame of an
// instance that no longer holds the address, and the room failed "peer
// lost" after the grace, while the decode had reported Success.
func TestVerdictOfReplacedIncarnationCounts(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	// The old incarnation's verdict is held back here and handed to the
	// prefill late, below.
	d1 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1,
		controlFault: func(_, typ string) bool { return typ == engine.MsgStatus }})
	const room = 1400
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, d1, addr, room)
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("receiver %s %v", st, r.Failure())
	}
	verdict := (&control.StatusMsg{Room: room, State: int(engine.KVSuccess), Producer: 0, Endpoint: d1.m.Endpoint(),
		Epoch: engine.RegistrationEpoch(d1.m, pre.m.Endpoint())}).Encode()
	d1.m.Close()
	// The new incarnation's first room: once the prefill dispatched its
	// REGISTER (its TRANSFER comes next), the old verdict arrives.
	var once sync.Once
	engine.SetBeforeDispatch(pre.m, func(typ string) {
		if typ == engine.MsgTransfer {
			once.Do(func() { engine.DispatchFrom(pre.m, d1.m, verdict) })
		}
	})
	d2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1,
		cfgMod: func(c *engine.ManagerConfig) { c.ControlPort = d1.m.ControlPort() }})
	sendOne(t, addr, pre, d2, room+1)
	if ps := s.Wait(ctx, engine.KVSuccess); ps != engine.KVSuccess {
		t.Fatalf("decode Success then closed and replaced; prefill %s: %v", ps, s.Failure())
	}
}
