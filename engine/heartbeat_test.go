package engine_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// stoppableBootstrap starts a bootstrap server on host:port (port 0: a free
// one) and returns its address and a stop function that shuts it down and
// waits (idempotent; also run at cleanup).
func stoppableBootstrap(t *testing.T, port int) (string, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := server.New(server.Options{Host: "127.0.0.1", Port: port})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		t.Fatalf("bootstrap server on port %d: %v", port, err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("bootstrap server did not start")
	}
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		<-done
	}
	t.Cleanup(stop)
	return srv.Addr(), stop
}

// TestBootstrapHeartbeatFailsWaitingReceivers: when the bootstrap server of
// a resolved address goes away, the decode's heartbeat fails the receivers
// waiting on it (ErrBootstrapLost, naming the address) and drops the cached
// bootstrap info, so that a request after the server (and its prefill) came
// back resolves afresh.
func TestBootstrapHeartbeatFailsWaitingReceivers(t *testing.T) {
	const every = 200 * time.Millisecond
	addr, stop := stoppableBootstrap(t, 0)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootHB: every})
	_ = pre

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Room 1 has no sender on the prefill: the receiver waits in
	// Transferring until something fails it.
	r, err := dec.m.NewReceiver(addr, 1)
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
	if st := r.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("receiver before the outage: %s %v", st, r.Failure())
	}
	// Several health checks pass while the server is up.
	time.Sleep(5 * every)
	if st := r.Poll(); st != engine.KVTransferring {
		t.Fatalf("receiver failed while the bootstrap server was up: %s %v", st, r.Failure())
	}

	stop()
	wctx, wcancel := context.WithTimeout(ctx, 15*time.Second) // ~2 intervals expected; generous bound
	st := r.Wait(wctx, engine.KVSuccess)
	wcancel()
	if st != engine.KVFailed {
		t.Fatalf("receiver after the bootstrap server stopped: %s, want Failed", st)
	}
	ferr := r.Failure()
	if !errors.Is(ferr, engine.ErrBootstrapLost) || !errors.Is(ferr, transport.ErrPeerLost) {
		t.Fatalf("failure %v: want ErrBootstrapLost and ErrPeerLost", ferr)
	}
	if msg := ferr.Error(); !strings.Contains(msg, addr) || !strings.Contains(msg, "2 consecutive health checks") {
		t.Fatalf("failure %q does not name the address %s and the failure count", msg, addr)
	}
	if st := r.Poll(); st != engine.KVFailed {
		t.Fatalf("Failed is not sticky: %s", st)
	}

	// The bootstrap server comes back on the same address with a restarted
	// prefill; a new request must resolve it afresh (the old cached rank
	// endpoint names the old prefill, which has no sender for room 2).
	_, portStr, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portStr)
	addr2, _ := stoppableBootstrap(t, port)
	if addr2 != addr {
		t.Fatalf("restarted bootstrap server on %s, want %s", addr2, addr)
	}
	restarted := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	for _, rr := range transferOne(t, addr, []*rank{restarted}, []*rank{dec}, 2, 2) {
		if rr.Poll() != engine.KVSuccess {
			t.Fatalf("request after the bootstrap server came back: %s %v (stale bootstrap cache?)", rr.Poll(), rr.Failure())
		}
		rr.Close()
	}
}

// TestBootstrapHeartbeatCloseIdempotent: closing a decode manager with a
// running heartbeat returns (the heartbeat stops) and a second Close is a
// no-op.
func TestBootstrapHeartbeatCloseIdempotent(t *testing.T) {
	addr, _ := stoppableBootstrap(t, 0)
	newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootHB: 50 * time.Millisecond})
	r, err := dec.m.NewReceiver(addr, 7)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("receiver: %s %v", st, r.Failure())
	}
	closed := make(chan struct{})
	go func() {
		dec.m.Close()
		dec.m.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-ctx.Done():
		t.Fatal("Close did not return with a bootstrap heartbeat running")
	}
	if st := r.Poll(); st != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrManagerClosed) {
		t.Fatalf("receiver after Close: %s %v, want Failed with ErrManagerClosed", st, r.Failure())
	}
}
