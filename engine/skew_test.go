package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// Issue 22 case 8: a prefill and a decode of different control protocol
// versions (one rank made to speak another version; frames of versions 5
// to 7 share this layout) both fail the room at once, each naming both
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
