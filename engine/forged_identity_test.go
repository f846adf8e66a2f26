package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// Issue 22 case 4 (no token): a REGISTER that carries the live decode's
// instance id and epoch in its envelope, the decode's endpoint, a huge
// registration epoch and a data endpoint that leads nowhere takes the
// decode's registration on the prefill. The decode's next registration
// takes it back at once: at most the room in flight when the forgery
// landed fails, and every room after it succeeds (it used to be every room,
// for minutes).
func TestForgedIdentityRegisterWonBack(t *testing.T) {
	for _, c := range []struct {
		name, transport, endpoint string
	}{{"unknown transport", "tcpx", "127.0.0.1:9"}, {"tcp to nowhere", "tcp", "127.0.0.1:9"}} {
		t.Run(c.name, func(t *testing.T) {
			addr := startBootstrap(t)
			p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
			d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: 10 * time.Second})
			sendOne(t, addr, p, d, 1)
			g := d.m.Geometry()
			regions := func(n int) []transport.RegionDesc {
				rs := make([]transport.RegionDesc, n)
				for i := range rs {
					rs[i] = transport.RegionDesc{ID: transport.RegionID(i + 2), Addr: 1 << 20, Length: 1 << 20}
				}
				return rs
			}
			forged := &control.RegisterMsg{Endpoint: d.m.Endpoint(), Geometry: *g, RingSlots: 64, Epoch: 1 << 62,
				Transports: []control.TransportOffer{{Name: c.transport, Endpoint: []byte(c.endpoint), Ring: transport.RegionDesc{ID: 1, Length: 4096},
					KV: regions(len(g.KVItemLens)), Aux: regions(len(g.AuxItemLens)), State: regions(len(g.StateItemLens))}}}
			in := newInjector(t, p.m.Endpoint())
			in.sendSealed(control.SealControl(forged.Encode(), d.m.InstanceID(), d.m.Epoch(), 1<<40, time.Now(), nil))
			time.Sleep(200 * time.Millisecond) // the forgery is handled
			failed := 0
			for room := uint64(2); room < 6; room++ {
				if !tryRoom(t, addr, p, d, room) {
					failed++
					if room > 2 {
						t.Fatalf("room %d failed: the decode's registration did not win back its pair", room)
					}
				}
			}
			t.Logf("%d room(s) failed after the forged REGISTER", failed)
		})
	}
}

// tryRoom runs one small room and reports whether both sides succeeded; it
// fails the test when they disagree.
func tryRoom(t *testing.T, addr string, p, d *rank, room uint64) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dp, _ := d.pool.Alloc(3)
	defer d.pool.Free(dp)
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_ = r.Init(dp)
	s, err := p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st == engine.KVWaitingForInput {
		sp, _ := p.pool.Alloc(3)
		defer p.pool.Free(sp)
		_ = workload.FillPattern(p.pool, room, sp, 0)
		_ = s.Send(sp, true)
	}
	rs, ss := r.Wait(ctx, engine.KVSuccess), s.Wait(ctx, engine.KVSuccess)
	if rs != ss {
		t.Fatalf("room %d: decode %s (%v), prefill %s (%v)", room, rs, r.Failure(), ss, s.Failure())
	}
	if rs != engine.KVSuccess {
		t.Logf("room %d failed on both sides: %v", room, r.Failure())
	}
	return rs == engine.KVSuccess
}
