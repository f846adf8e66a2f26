package engine_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// entry polls the directory at addr until cond holds for the entry at
// (0,0,0,0) (nil: absent), and returns how long it took.
func pollEntry(t *testing.T, addr string, limit time.Duration, what string, cond func(*bootstrap.TableRank) bool) time.Duration {
	t.Helper()
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var last *bootstrap.TableRank
	var lastErr error
	for time.Since(start) < limit {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		e, err := c.Entry(ctx, bootstrap.Coord{})
		cancel()
		if err == nil || errors.Is(err, bootstrap.ErrNotFound) {
			if cond(e) {
				return time.Since(start)
			}
		}
		last, lastErr = e, err
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s: not within %s (last entry %+v, err %v)", what, limit, last, lastErr)
	return 0
}

// TestPrefillReregistersAfterDirectoryRestart: the directory restarts empty
// on the same address; the prefill rank notices and registers again
// within a few check intervals, with its instance id and epoch.
func TestPrefillReregistersAfterDirectoryRestart(t *testing.T) {
	addr, stop := stoppableBootstrap(t, 0)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, dirCheck: 100 * time.Millisecond})
	mine := func(e *bootstrap.TableRank) bool {
		return e != nil && e.InstanceID == p.m.InstanceID() && e.Epoch == p.m.Epoch()
	}
	pollEntry(t, addr, 10*time.Second, "initial registration", mine)
	stop()
	_, portStr, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portStr)
	if addr2, _ := stoppableBootstrap(t, port); addr2 != addr {
		t.Fatalf("restarted directory on %s, want %s", addr2, addr)
	}
	took := pollEntry(t, addr, 20*time.Second, "re-registration after the directory restarted", mine)
	t.Logf("re-registered %s after the directory came back (check interval 100 ms)", took.Round(time.Millisecond))
	// The counter moves once the rank has the directory's answer (after
	// the entry is visible).
	for deadline := time.Now().Add(10 * time.Second); p.m.Reregistrations() < 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Reregistrations() = %d, want ≥ 1", p.m.Reregistrations())
		}
	}
}

// TestRollingRestartKeepsSuccessor: P2 registers the coordinates of P1 (its
// replacement); P1 notices it was replaced and stops re-registering, and
// its clean exit leaves P2's entry in place (issue 18 item 3).
func TestRollingRestartKeepsSuccessor(t *testing.T) {
	addr := startBootstrap(t)
	p1 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, dirCheck: 50 * time.Millisecond})
	p2 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, dirCheck: 50 * time.Millisecond})
	if p1.m.InstanceID() == p2.m.InstanceID() || p2.m.Epoch() <= p1.m.Epoch() {
		t.Fatalf("instances %s/%d and %s/%d: want distinct ids and a higher epoch for the later one",
			p1.m.InstanceID(), p1.m.Epoch(), p2.m.InstanceID(), p2.m.Epoch())
	}
	isP2 := func(e *bootstrap.TableRank) bool { return e != nil && e.InstanceID == p2.m.InstanceID() }
	pollEntry(t, addr, 10*time.Second, "P2 holds the entry", isP2)
	// Several of P1's checks pass: it must not take the entry back.
	time.Sleep(500 * time.Millisecond)
	pollEntry(t, addr, time.Second, "P2 still holds the entry while P1 runs", isP2)
	if err := p1.m.Close(); err != nil {
		t.Fatal(err)
	}
	pollEntry(t, addr, time.Second, "P2's entry after P1's clean exit", isP2)
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	for _, r := range transferOne(t, addr, []*rank{p2}, []*rank{dec}, 5, 2) {
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("room after the rolling restart: %s %v", r.Poll(), r.Failure())
		}
	}
}

// TestPrefillDeclaresPolicyLayoutAndHeartbeat: a prefill rank's
// registration carries the decode allocation policy and DSpark layout it
// was configured with (the topology answer has them, as SGLang's newest
// server gives them to a decode) and its directory-check interval as
// heartbeat_ms; its checks are check-ins, so the directory never reports it
// stale while it runs, well past the stale bound. A policy SGLang does not
// have, a layout that is not a JSON object, or an HTTP port out of range
// fails NewManager naming it. The serving engine's HTTP port
// (prefill_http_port, SGLang's PD rebootstrap target) is in the topology.
func TestPrefillDeclaresPolicyLayoutAndHeartbeat(t *testing.T) {
	addr := startBootstrap(t)
	layout := []byte(`{"num_draft_tokens": 6, "block_size": 128}`)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, dirCheck: 100 * time.Millisecond,
		policy: bootstrap.PolicyPrefillComplete, layout: layout, httpPort: 30000})
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	info, err := c.WaitReady(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if info.AllocationPolicy() != bootstrap.PolicyPrefillComplete || string(info.DSV41SpecLayout) != `{"block_size":128,"num_draft_tokens":6}` {
		t.Fatalf("topology policy %q layout %s", info.AllocationPolicy(), info.DSV41SpecLayout)
	}
	if info.PrefillHTTPPort == nil || *info.PrefillHTTPPort != 30000 {
		t.Fatalf("topology prefill_http_port %v, want 30000", info.PrefillHTTPPort)
	}
	bound := bootstrap.StaleAfter(100 * time.Millisecond)
	for start := time.Now(); time.Since(start) < bound+time.Second; time.Sleep(50 * time.Millisecond) {
		tab, err := c.Table(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(tab.Ranks) != 1 || tab.Ranks[0].HeartbeatMS != 100 || tab.Ranks[0].InstanceID != p.m.InstanceID() {
			t.Fatalf("table %+v", tab.Ranks)
		}
		if tab.Ranks[0].Stale || !tab.Ready {
			t.Fatalf("running rank reported stale %v after registering (bound %v): %+v", time.Since(start), bound, tab)
		}
	}

	for _, tc := range []struct {
		policy string
		layout []byte
		port   int
		want   string
	}{{"eager", nil, 0, `"eager"`}, {"", []byte(`[1]`), 0, "dsv41_spec_layout"}, {"", nil, 65536, "prefill HTTP port (prefill_http_port) 65536"}} {
		l, err := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 8})
		if err != nil {
			t.Fatal(err)
		}
		pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "decl", Device: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		_, err = engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RolePrefill, KV: pool.Args(), BootstrapAddr: addr, Transports: []transport.Transport{tr},
			DecodeAllocationPolicy: tc.policy, DSV41SpecLayout: tc.layout, PrefillHTTPPort: tc.port})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("policy %q layout %s: NewManager %v, want an error naming %s", tc.policy, tc.layout, err, tc.want)
		}
	}
}
