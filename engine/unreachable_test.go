package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// TestDeadRegisteredPrefillUnreachable: a prefill rank that was killed
// without deregistering (its bootstrap entry names a port nobody listens
// on) fails the decode's request with "could not be reached", not with the
// "silent … hung" text that is kept for a peer that connected and went
// quiet.
func TestDeadRegisteredPrefillUnreachable(t *testing.T) {
	addr := startBootstrap(t)
	port := testenv.DeadPort(t) // the "killed" prefill's control port: connections are refused
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	dtype := "auto"
	if err := c.Register(ctx, bootstrap.RegisterRequest{AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
		RankIP: "127.0.0.1", RankPort: port, PageSize: 4, KVCacheDtype: &dtype}); err != nil {
		t.Fatal(err)
	}
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: time.Second})
	r, err := dec.m.NewReceiver(addr, 21)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, err := dec.pool.Alloc(2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	st := r.Wait(ctx, engine.KVSuccess)
	err = r.Failure()
	if st != engine.KVFailed || !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("receiver for a dead prefill: %s %v, want Failed with ErrPeerLost", st, err)
	}
	if msg := err.Error(); !strings.Contains(msg, "could not be reached") || !strings.Contains(msg, "connection refused") ||
		strings.Contains(msg, "hung") || strings.Contains(msg, "exited") {
		t.Fatalf("failure %q: want the unreachable reason with the dial's answer (connection refused), not the silent or exited one", err)
	}
}
