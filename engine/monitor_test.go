package engine_test

import (
	"net"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// A peer whose control connection drops while this rank is slow to handle
// the loss (its lock held, as on a loaded host) must not freeze this rank's
// control path. ZMQ keeps reporting reconnection attempts to the dead peer
// on the socket monitor; a monitor whose reader has gone blocks ZMQ's I/O
// thread, and with it every socket of the context, for good. The chaos soak
// found it: after a prefill was killed, the decode reached no prefill again
// and every later room failed "silent for more than 2s" on both sides.
func TestPeerDisconnectDoesNotFreezeControlPath(t *testing.T) {
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = zctx.Term() }()
	pull := func() (*zmq.Socket, string) {
		s, err := zctx.NewSocket(zmq.PULL)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.SetLinger(0)
		_ = s.SetRcvtimeo(10 * time.Second)
		if err := s.Bind("tcp://127.0.0.1:*"); err != nil {
			t.Fatal(err)
		}
		ep, err := s.GetLastEndpoint()
		if err != nil {
			t.Fatal(err)
		}
		return s, ep
	}
	ping := (&control.PingMsg{Endpoint: "tcp://127.0.0.1:9"}).Encode()
	a, epA := pull()
	if err := engine.SendControl(dec.m, epA, ping); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RecvMessageBytes(0); err != nil {
		t.Fatalf("peer A never got the first message: %v", err)
	}
	release := engine.LockManager(dec.m)
	_ = a.Close() // peer A dies; its port refuses every reconnection
	time.Sleep(time.Second)
	release()

	b, epB := pull()
	defer b.Close()
	if err := engine.SendControl(dec.m, epB, ping); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RecvMessageBytes(0); err != nil {
		t.Fatalf("after peer A died, a message to live peer B never arrived (the control path is frozen): %v", err)
	}
}

// A control socket opened to an endpoint nobody listens on any more (a late
// message to a peer that died and was declared lost) is closed once its
// connection attempts have failed for a peer timeout, instead of retrying
// every 100 ms for as long as the rank lives (the chaos soak's decode piled
// them up after each killed prefill until ZeroMQ's socket limit).
func TestDeadControlSocketSwept(t *testing.T) {
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: time.Second})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "tcp://" + l.Addr().String()
	_ = l.Close()
	if err := engine.SendControl(dec.m, dead, (&control.PingMsg{Endpoint: "tcp://127.0.0.1:9"}).Encode()); err != nil {
		t.Fatal(err)
	}
	if n := engine.PushSockets(dec.m); n != 1 {
		t.Fatalf("%d control sockets after one send, want 1", n)
	}
	for deadline := time.Now().Add(30 * time.Second); engine.PushSockets(dec.m) != 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the socket to %s (nothing listening) is still open 30 s later (peer timeout 1 s)", dead)
		}
	}
}
