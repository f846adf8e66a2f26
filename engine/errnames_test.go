package engine_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// TestPeerLossNamesTheRank (issue 26 item 10): a decode whose prefill tp1
// dies mid-room fails with an error naming that rank by role, coordinates
// and instance id besides its address, with at most one "engine: " prefix.
func TestPeerLossNamesTheRank(t *testing.T) {
	addr := startBootstrap(t)
	newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 2, tpRank: 0, pp: 1, addr: addr})
	pre1 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 2, tpRank: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	r, err := dec.m.NewReceiver(addr, 77)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, err := dec.pool.Alloc(2)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(pg)
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if st := r.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("receiver: %s %v", st, r.Failure())
	}
	inst := pre1.m.InstanceID()
	ep := strings.TrimPrefix(pre1.m.Endpoint(), "tcp://")
	pre1.m.Close()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("receiver: %s, want Failed", st)
	}
	msg := r.Failure().Error()
	t.Logf("failure: %s", msg)
	if want := "prefill tp1/pp0 (instance " + inst + ") at " + ep; !strings.Contains(msg, want) {
		t.Errorf("failure %q does not name %q", msg, want)
	}
	if n := strings.Count(msg, "engine:"); n > 1 {
		t.Errorf("failure %q has %d \"engine:\" prefixes, want at most one", msg, n)
	}
}

// TestCleanExitNoWarning (issue 26): a prefill rank that closes after its
// rooms succeeded leaves the decode with INFO lines only (the peer gone,
// its data path fenced), no WARN: nothing failed.
func TestCleanExitNoWarning(t *testing.T) {
	addr := startBootstrap(t)
	logs := make(logLines, 4096)
	quietLog := func(c *engine.ManagerConfig) {
		c.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, cfgMod: quietLog})}
	for _, r := range transferOne(t, addr, pre, dec, 31, 4) {
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("room: %s %v", r.Poll(), r.Failure())
		}
		r.Close()
	}
	pre[0].m.Close()
	var seen []map[string]any
	deadline := time.After(time.Minute)
	for fenced := false; !fenced; {
		select {
		case rec := <-logs:
			seen = append(seen, rec)
			fenced = rec["msg"] == "data path fenced"
		case <-deadline:
			t.Fatalf("the decode never fenced the data path of the closed prefill: %v", seen)
		}
	}
	dec[0].m.Close()
	for len(logs) > 0 {
		seen = append(seen, <-logs)
	}
	for _, rec := range seen {
		if rec["level"] != "INFO" && rec["level"] != "DEBUG" {
			t.Errorf("after a clean exit: %v", rec)
		}
	}
}

// TestAuthWithoutTokenNamesCallerTerms: the refusal names the setting in
// the terms of every caller (CLI flag, environment, C field, Python
// argument), not only the Go field.
func TestAuthWithoutTokenNamesCallerTerms(t *testing.T) {
	pool, err := workload.NewKVBuffers(mustLayout(t), workload.BufferOptions{Name: "auth", Device: -1, Aux: workload.DefaultAux, AuxRows: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	_, err = engine.NewManager(context.Background(), engine.ManagerConfig{Role: engine.RoleDecode, KV: pool.Args(), Transports: []transport.Transport{tr}, AuthenticateControl: true})
	if err == nil {
		t.Fatal("a manager authenticating control frames without a token started")
	}
	for _, w := range []string{"--control-auth", "kvx_kv_config.control_auth", "control_auth=True", "--bootstrap-auth-token", "kvx_kv_config.bootstrap_auth_token", "server_args.bootstrap_auth_token"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not name %s", err, w)
		}
	}
}

func mustLayout(t *testing.T) *workload.Layout {
	t.Helper()
	l, err := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	return l
}
