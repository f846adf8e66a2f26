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

// Issue 22 case 8: a prefill and a decode of different control protocol
// versions (one rank made to speak another version, in this build's frame
// layout: the fields a rank reads from another version's frames, DecodeForeign,
// keep their place in every version) both fail the room at once, each naming both
// versions, instead of the decode waiting its peer timeout ("silent …
// hung") and the prefill its bootstrap timeout (both 60 s here, beyond the
// test's 20 s wait).
func TestVersionSkewFailsBothSidesAtOnce(t *testing.T) {
	own := engine.ControlVersion
	for _, c := range []struct{ pre, dec int }{{own + 1, own}, {own - 1, own}, {own, own - 1}} {
		t.Run(fmt.Sprintf("prefill v%d decode v%d", c.pre, c.dec), func(t *testing.T) {
			addr := startBootstrap(t)
			opts := func(role engine.Role) rankOpts {
				return rankOpts{role: role, model: smallGQA, tp: 1, pp: 1, addr: addr, peerTmo: 60 * time.Second, bootTmo: 60 * time.Second, waiting: 60 * time.Second}
			}
			pre := newRank(t, opts(engine.RolePrefill))
			dec := newRank(t, opts(engine.RoleDecode))
			for _, x := range []struct {
				m *engine.Manager
				v int
			}{{pre.m, c.pre}, {dec.m, c.dec}} {
				if x.v != own {
					engine.SetControlVersion(x.m, x.v)
				}
			}
			pv, dv := c.pre, c.dec
			const room = 77
			s, err := pre.m.NewSender(room)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := dec.m.NewReceiver(addr, room)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			dst, _ := dec.pool.Alloc(4)
			if err := r.Init(dst); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			for _, side := range []struct {
				name string
				wait func() engine.KVPoll
				err  func() error
			}{
				{"decode", func() engine.KVPoll { return r.Wait(ctx, engine.KVSuccess) }, r.Failure},
				{"prefill", func() engine.KVPoll { return s.Wait(ctx, engine.KVSuccess) }, s.Failure},
			} {
				if st := side.wait(); st != engine.KVFailed {
					t.Fatalf("%s: state %s after 20 s, want Failed at once", side.name, st)
				}
				e := side.err()
				msg := e.Error()
				if !errors.Is(e, engine.ErrVersionSkew) || !strings.Contains(msg, fmt.Sprintf("version %d", pv)) || !strings.Contains(msg, fmt.Sprintf("version %d", dv)) {
					t.Fatalf("%s: %v: want a version mismatch naming versions %d and %d", side.name, e, pv, dv)
				}
				t.Logf("%s: %v", side.name, e)
			}
		})
	}
}

// TestProtocol6TransferNamesBothVersions: a decode of protocol 6 sends
// TRANSFER in that version's layout (15 frames, no attempt frame). The
// prefill of protocol 7 fails the room at once naming both versions,
// rather than dropping the frame as malformed and waiting its bootstrap
// timeout.
func TestProtocol6TransferNamesBothVersions(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: 60 * time.Second})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	sendOne(t, addr, pre, dec, 1) // registered with each other
	const room = 78
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	v6 := (&control.TransferMsg{Room: room, Endpoint: dec.m.Endpoint(), Pages: []int32{1}, RequiredDstInfoNum: 1, AuxIndex: -1,
		Epoch: engine.RegistrationEpoch(dec.m, pre.m.Endpoint()), Attempt: 1}).Encode()[:15]
	v6[1] = []byte("6")
	if err := engine.SendControl(dec.m, pre.m.Endpoint(), v6); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("prefill: state %s after 20 s, want Failed at once", st)
	}
	msg := s.Failure().Error()
	if !errors.Is(s.Failure(), engine.ErrVersionSkew) || !strings.Contains(msg, "version 6") || !strings.Contains(msg, fmt.Sprintf("version %d", engine.ControlVersion)) {
		t.Fatalf("prefill: %v: want a version mismatch naming versions 6 and %d", s.Failure(), engine.ControlVersion)
	}
}
