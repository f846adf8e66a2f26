package engine_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// A decode restarted on the same control port (a pod or systemd restart)
// whose REGISTER the prefill reads before it noticed that the old
// incarnation's control connection dropped: the old registration was heard
// from moments ago and looks alive. Before, the REGISTER of another instance
// was dropped without an answer and nothing looked at it again, so the new
// incarnation's first room failed at its bootstrap timeout ("did not answer
// REGISTER"; CI failure of TestVerdictOfReplacedIncarnationCounts under
// load). It must be held and taken once the old instance is judged gone:
// its connection reset (the new process accepts the prefill's reconnection)
// with nothing heard from it since, or, when that judgment never comes, its
// connection dropped and nothing came from it for a few heartbeats.
func TestRestartedDecodeRegistersBeforeDropNoticed(t *testing.T) {
	for _, c := range []struct {
		name   string
		judged bool // the drop is judged right after the REGISTER was handled
	}{
		{"drop judged after the REGISTER", true},
		{"drop never judged", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := startBootstrap(t)
			pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
			d1 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
			sendOne(t, addr, pre, d1, 1)
			// registered closes at the first frame the prefill dispatches
			// after the new incarnation's REGISTER: that REGISTER was
			// handled.
			registered, release := make(chan struct{}), make(chan struct{})
			var stage atomic.Int32
			engine.SetBeforeDispatch(pre.m, func(typ string) {
				if typ == engine.MsgRegister && stage.CompareAndSwap(0, 1) {
					return
				}
				if stage.CompareAndSwap(1, 2) {
					close(registered)
				}
			})
			var once sync.Once
			done := func() { once.Do(func() { close(release) }) }
			t.Cleanup(done)
			d1ep := d1.m.Endpoint()
			engine.SetBeforeDropJudged(pre.m, func(ep string) {
				if ep != d1ep {
					return
				}
				wait := release
				if c.judged {
					wait = registered
				}
				select {
				case <-wait:
				case <-time.After(30 * time.Second):
				}
			})
			d1.m.Close()
			d2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: 8 * time.Second,
				cfgMod: func(cfg *engine.ManagerConfig) { cfg.ControlPort = d1.m.ControlPort() }})
			t0 := time.Now()
			sendOne(t, addr, pre, d2, 2)
			t.Logf("the new incarnation's first room succeeded %s after it started", time.Since(t0).Round(time.Millisecond))
			done()
			sendOne(t, addr, pre, d2, 3)
		})
	}
}
