package engine_test

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestDeadRegisteredPrefillUnreachable: a prefill rank that was killed
// without deregistering (its bootstrap entry names a port nobody listens
// on) fails the decode's request with "could not be reached", not with the
// "silent … hung" text that is kept for a peer that connected and went
// quiet.
func TestDeadRegisteredPrefillUnreachable(t *testing.T) {
	addr := startBootstrap(t)
	port := deadPort(t) // the "killed" prefill's control port: connections are refused
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

// deadPort returns a loopback TCP port that refuses connections and that no
// other socket can take while the test runs: it stays bound, never
// listening. A port freed by closing a listener went back to the pool: on a
// loaded machine running tests in parallel another process's listener took
// it within the peer timeout (seen: EVENT_CONNECTED to the "dead" prefill,
// whose new owner never answered, so the decode rightly reported it silent,
// not unreachable).
func deadPort(t *testing.T) int {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return sa.(*syscall.SockaddrInet4).Port
}
