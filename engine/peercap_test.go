package engine_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// TestPeerCapEvictsIdleDecodes: at its peer cap (MaxPeers 2) a prefill
// evicts the least recently used decode with no room to admit a new one, and
// tells it, so the evicted decode's next room registers again and succeeds
// (before: live idle decodes were never evicted and the new one was
// refused). A decode with a room in flight is never evicted: then the new
// one is refused, naming the cap.
func TestPeerCapEvictsIdleDecodes(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, maxPeers: 2})}
	var decs []*rank
	for range 3 {
		decs = append(decs, newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1}))
	}
	room := uint64(40)
	serve := func(i int) {
		t.Helper()
		room++
		if r := transferOne(t, addr, pre, decs[i:i+1], room, 2); r[0].Poll() != engine.KVSuccess {
			t.Fatalf("decode %d, room %d: %s %v", i, room, r[0].Poll(), r[0].Failure())
		}
	}
	for _, i := range []int{0, 1, 2, 0, 1, 2, 2, 0} {
		serve(i)
	}

	// Both registered decodes busy (a receiver each, its TRANSFER waiting
	// for a sender): the third is refused, naming the cap.
	busy := func(d *rank, room uint64) *engine.Receiver {
		t.Helper()
		r, err := d.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		pages, _ := d.pool.Alloc(2)
		if err := r.Init(pages); err != nil {
			t.Fatal(err)
		}
		return r
	}
	a, b := busy(decs[0], 60), busy(decs[2], 61) // decs[2] and decs[0] are the registered ones
	deadline := time.Now().Add(30 * time.Second)
	// Busy as the prefill sees it: it holds both TRANSFERs (Transferring
	// on the decode means sent, not read: a REGISTER read before one of
	// them evicts that decode, whose room then fails naming the eviction).
	for a.Poll() < engine.KVTransferring || b.Poll() < engine.KVTransferring ||
		len(engine.PendingTransferAttempts(pre[0].m, 60)) == 0 || len(engine.PendingTransferAttempts(pre[0].m, 61)) == 0 {
		if time.Now().After(deadline) || a.Poll() == engine.KVFailed || b.Poll() == engine.KVFailed {
			t.Fatalf("busy rooms: %s %v, %s %v", a.Poll(), a.Failure(), b.Poll(), b.Failure())
		}
		time.Sleep(5 * time.Millisecond)
	}
	c := busy(decs[1], 62)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if st := c.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(c.Failure().Error(), "--max-peers") {
		t.Fatalf("a third decode while both registered ones have rooms: %s %v, want the peer-cap refusal", st, c.Failure())
	}
}

// TestPeerCapEvictedRoomRegistersAgain: a decode's room whose registration
// the prefill evicts at its peer cap before the room's TRANSFER is read
// (the TRANSFER crosses the eviction notice, as seen under load in
// TestPeerCapEvictsIdleDecodes) registers again and succeeds, well within
// the peer timeout: nothing was written for it. Before, the decode only
// dropped the registration on the notice; the prefill's rejection of the
// stale TRANSFER was never sent (at its socket cap, both sockets to
// registered decodes, it cannot open one back to the evicted decode), and
// the room failed a peer timeout later with "prefill … silent".
//
// unnoticed: the notice is lost (dropped on the prefill); then the
// prefill's rejection of the stale TRANSFER, sent over a one-off socket
// beyond its socket cap, fails the room at once (before: not sent, the
// room failed a peer timeout later, "silent").
func TestPeerCapEvictedRoomRegistersAgain(t *testing.T) {
	// notified: the notice is handled before the room's TRANSFER is sent;
	// crossed: after (the decode's control loop is held on it meanwhile).
	for _, mode := range []string{"notified", "crossed", "unnoticed"} {
		t.Run(mode, func(t *testing.T) { testEvictedRoomRegistersAgain(t, mode) })
	}
}

func testEvictedRoomRegistersAgain(t *testing.T, mode string) {
	const peerTmo = 6 * time.Second
	addr := startBootstrap(t)
	var dropNotice atomic.Pointer[string] // unnoticed: the eviction notice to decs[0] is lost
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, maxPeers: 2, peerTmo: peerTmo,
		controlFault: func(peer, typ string) bool {
			to := dropNotice.Load()
			return typ == engine.MsgRegisterAck && to != nil && *to == peer
		}})
	var decs []*rank
	for range 3 {
		decs = append(decs, newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: peerTmo}))
	}
	for i, room := range []uint64{41, 42} { // decs[0] is now the least recently used
		if r := transferOne(t, addr, []*rank{pre}, decs[i:i+1], room, 2); r[0].Poll() != engine.KVSuccess {
			t.Fatalf("decode %d, room %d: %s %v", i, room, r[0].Poll(), r[0].Failure())
		}
	}
	const room = 50
	r, err := decs[0].m.NewReceiver(addr, room) // over decs[0]'s registration
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	deadline := time.Now().Add(20 * time.Second)
	for r.Poll() != engine.KVWaitingForInput {
		if time.Now().After(deadline) || r.Poll() == engine.KVFailed {
			t.Fatalf("room %d before the eviction: %s %v", room, r.Poll(), r.Failure())
		}
		time.Sleep(5 * time.Millisecond)
	}
	var hold atomic.Bool
	release := make(chan struct{})
	hold.Store(mode == "crossed")
	if mode == "unnoticed" {
		ep := decs[0].m.Endpoint()
		dropNotice.Store(&ep)
	}
	engine.SetBeforeDispatch(decs[0].m, func(msgType string) {
		if msgType == "REGISTER_ACK" && hold.CompareAndSwap(true, false) {
			select { // the eviction notice waits for the room's TRANSFER (or outcome)
			case <-release:
			case <-time.After(20 * time.Second):
			}
		}
	})
	// decs[2] registers: the prefill evicts decs[0], idle as far as it knows.
	if r := transferOne(t, addr, []*rank{pre}, decs[2:3], 43, 2); r[0].Poll() != engine.KVSuccess {
		t.Fatalf("decode 2, room 43: %s %v", r[0].Poll(), r[0].Failure())
	}
	dst, err := decs[0].pool.Alloc(2)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := r.Init(dst); err != nil { // its TRANSFER may name the evicted registration
		t.Fatal(err)
	}
	if mode == "unnoticed" {
		for r.Poll() != engine.KVFailed && r.Poll() != engine.KVSuccess && time.Since(start) < 2*peerTmo {
			time.Sleep(5 * time.Millisecond)
		}
		took := time.Since(start)
		if r.Poll() != engine.KVFailed || !strings.Contains(r.Failure().Error(), "TRANSFER before REGISTER") || took > peerTmo/2 {
			t.Fatalf("room %d, its registration evicted, the notice not handled yet: %s %v after %s; want Failed at once with the prefill's rejection (TRANSFER before REGISTER)", room, r.Poll(), r.Failure(), took)
		}
		return
	}
	if mode == "crossed" {
		for r.Poll() == engine.KVWaitingForInput && time.Since(start) < 10*time.Second {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(100 * time.Millisecond) // the stale TRANSFER reaches the prefill
		close(release)
	}
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 2*peerTmo)
	defer cancel()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender room %d: %s %v (after %s); receiver: %s %v", room, st, s.Failure(), time.Since(start), r.Poll(), r.Failure())
	}
	src, err := pre.pool.Alloc(s.DstPages())
	if err != nil {
		t.Fatal(err)
	}
	if err := workload.FillPattern(pre.pool, room, src, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	st := r.Wait(ctx, engine.KVSuccess)
	took := time.Since(start)
	if st != engine.KVSuccess {
		t.Fatalf("room %d after its registration was evicted: %s %v (after %s), want Success over a new registration", room, st, r.Failure(), took)
	}
	if err := workload.VerifyPattern(decs[0].pool, room, dst, 0); err != nil {
		t.Fatal(err)
	}
	if took > peerTmo/2 {
		t.Fatalf("room %d took %s after its TRANSFER (want well within the peer timeout %s)", room, took, peerTmo)
	}
}
