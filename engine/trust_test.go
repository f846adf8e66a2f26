package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// injector sends hand-made control frames to a rank's control endpoint, as
// a stray or hostile process on the network would.
type injector struct {
	t    *testing.T
	ctx  *zmq.Context
	sock *zmq.Socket
	seq  uint64 // the injector's envelope sequence numbers
}

func newInjector(t *testing.T, endpoint string) *injector {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	s, err := zctx.NewSocket(zmq.PUSH)
	if err != nil {
		t.Fatal(err)
	}
	s.SetLinger(0)
	if err := s.Connect(endpoint); err != nil {
		t.Fatal(err)
	}
	in := &injector{t: t, ctx: zctx, sock: s}
	t.Cleanup(func() { s.Close(); zctx.Term() })
	return in
}

// send seals frames as instance (with key, or untagged) and sends them.
func (in *injector) send(frames [][]byte, instance string, key []byte) {
	in.t.Helper()
	in.seq++
	in.sendSealed(control.SealControl(frames, instance, 0, in.seq, time.Now(), key))
}

// sendSealed sends frames already sealed (a captured frame, replayed).
func (in *injector) sendSealed(sealed [][]byte) {
	in.t.Helper()
	parts := make([]any, len(sealed))
	for i, f := range sealed {
		parts[i] = f
	}
	if _, err := in.sock.SendMessage(parts...); err != nil {
		in.t.Fatal(err)
	}
}

func waitDropped(t *testing.T, m *engine.Manager, n uint64) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); m.DroppedFrames() < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d control frames dropped, want %d", m.DroppedFrames(), n)
		}
	}
}

// TestForgedControlFrames (issue 18 case 7, no token): a REGISTER naming a
// live decode's endpoint from another instance (with a transport "tcpx" no
// prefill has), and one from the decode's own instance id with an epoch not
// newer than its registration, are dropped; 400 HANDSHAKEs naming distinct
// endpoints the decode never registered with open no socket and get no
// answer. The pair's rooms succeed before and after.
func TestForgedControlFrames(t *testing.T) {
	addr := startBootstrap(t)
	preReg, decReg := prometheus.NewRegistry(), prometheus.NewRegistry()
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, metrics: preReg})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, metrics: decReg})
	sendOne(t, addr, p, d, 1)
	toPrefill := newInjector(t, p.m.Endpoint())
	g := d.m.Geometry()
	regions := func(n int) []transport.RegionDesc {
		rs := make([]transport.RegionDesc, n)
		for i := range rs {
			rs[i] = transport.RegionDesc{ID: transport.RegionID(i + 2), Addr: 1 << 20, Length: 1 << 20}
		}
		return rs
	}
	forged := &control.RegisterMsg{Endpoint: d.m.Endpoint(), Geometry: *g, RingSlots: 64, Epoch: 1 << 40,
		Transports: []control.TransportOffer{{Name: "tcpx", Endpoint: []byte("127.0.0.1:9"), Ring: transport.RegionDesc{ID: 1, Length: 4096},
			KV: regions(len(g.KVItemLens)), Aux: regions(len(g.AuxItemLens)), State: regions(len(g.StateItemLens))}}}
	if _, err := control.DecodeRegister(forged.Encode()); err != nil {
		t.Fatalf("the forged REGISTER must be well formed: %v", err)
	}
	toPrefill.send(forged.Encode(), "forger", nil)
	forged.Epoch = 1 // the decode's own instance, an old epoch: a replay
	toPrefill.send(forged.Encode(), d.m.InstanceID(), nil)
	waitDropped(t, p.m, 2)
	waitSample(t, preReg, engine.MetricControlFramesDropped, map[string]string{"reason": "sender"}, 2)
	t0 := time.Now()
	sendOne(t, addr, p, d, 2)
	t.Logf("room 2 after the forged REGISTERs: ok in %s", time.Since(t0).Round(time.Millisecond))
	toDecode := newInjector(t, d.m.Endpoint())
	before := engine.PushSockets(d.m)
	const flood = 400
	t0 = time.Now()
	for i := range flood {
		hs := &control.HandshakeMsg{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 20000+i), Transport: "rdma", Reply: []byte("qp"), Epoch: uint64(i + 1)}
		toDecode.send(hs.Encode(), fmt.Sprintf("flood-%d", i), nil)
	}
	waitDropped(t, d.m, flood)
	waitSample(t, decReg, engine.MetricControlFramesDropped, map[string]string{"reason": "sender"}, flood)
	if n := engine.PushSockets(d.m); n != before {
		t.Fatalf("the decode holds %d control sockets after the flood, %d before", n, before)
	}
	dropped := time.Since(t0)
	sendOne(t, addr, p, d, 3)
	t.Logf("%d HANDSHAKEs sent and dropped in %s; room 3 ok %s after the flood began", flood, dropped.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
}

// TestAuthenticatedControl: ranks with AuthenticateControl and the same
// token serve rooms; an ABORT forged for a room in flight without the
// token, or with another one, is dropped and the room succeeds; a decode
// with another token cannot register (its frames are dropped) and its room
// fails naming the token as a likely cause.
func TestAuthenticatedControl(t *testing.T) {
	addr := startBootstrap(t)
	const token = "deployment-secret"
	decReg := prometheus.NewRegistry()
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, authToken: token, authControl: true})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, authToken: token, authControl: true, metrics: decReg})
	sendOne(t, addr, p, d, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := d.m.NewReceiver(addr, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := d.pool.Alloc(2)
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVTransferring); st != engine.KVTransferring {
		t.Fatalf("room 2: %s %v", st, r.Failure())
	}
	abort := (&control.AbortMsg{Room: 2, Endpoint: p.m.Endpoint(), Reason: "forged", Epoch: 0}).Encode()
	in := newInjector(t, d.m.Endpoint())
	in.send(abort, p.m.InstanceID(), nil)
	in.send(abort, p.m.InstanceID(), control.ControlKey("guessed"))
	waitDropped(t, d.m, 2)
	waitSample(t, decReg, engine.MetricControlFramesDropped, map[string]string{"reason": "unauthenticated"}, 2)
	// A frame tagged with the deployment's key (as the prefill sends it),
	// captured and sent again: the first copy is accepted, the replay is
	// dropped and counted, within the send-time window.
	ping := control.SealControl((&control.PingMsg{Endpoint: p.m.Endpoint()}).Encode(), p.m.InstanceID(), 0, 1<<40, time.Now(), control.ControlKey(token))
	in.sendSealed(ping)
	in.sendSealed(ping)
	waitDropped(t, d.m, 3)
	waitSample(t, decReg, engine.MetricControlFramesDropped, map[string]string{"reason": "replay"}, 1)
	s, err := p.m.NewSender(2)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender: %s %v", st, s.Failure())
	}
	src, _ := p.pool.Alloc(s.DstPages())
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("room 2 after forged ABORTs: %s %v", st, r.Failure())
	}
	wrong := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, authToken: "another", authControl: true, bootTmo: 2 * time.Second})
	r3, err := wrong.m.NewReceiver(addr, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer r3.Close()
	if st := r3.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r3.Failure().Error(), "same token") {
		t.Fatalf("decode with another token: %s %v, want Failed naming the token", st, r3.Failure())
	}
	waitDropped(t, p.m, 1)
	if _, err := engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RoleDecode, AuthenticateControl: true}); err == nil || !strings.Contains(err.Error(), "BootstrapAuthToken") {
		t.Fatalf("AuthenticateControl without a token: %v", err)
	}
}

// TestPrefillReplacedAtAddress (peer identity, issue 18 case 4): the
// directory names instance "inst-old", then "inst-new" with another epoch,
// for the prefill rank at an address where another process (instance
// "inst-new", its own epoch) listens. The decode's room fails at once naming
// both identities, not at its waiting timeout.
func TestPrefillReplacedAtAddress(t *testing.T) {
	stale := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: startBootstrap(t), instance: "inst-new"})
	decReg := prometheus.NewRegistry()
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, waiting: time.Minute, metrics: decReg})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := bootstrap.NewClient(stale)
	if err != nil {
		t.Fatal(err)
	}
	dtype := "auto"
	g := p.m.Geometry()
	// The second entry names the same instance id with another epoch: a
	// restart under a stable instance id is another process too.
	for i, e := range []struct {
		instance string
		epoch    uint64
		want     string
	}{{"inst-old", 1, "inst-old"}, {"inst-new", 1, "inst-new (epoch 1)"}} {
		if err := c.Register(ctx, bootstrap.RegisterRequest{AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
			RankIP: "127.0.0.1", RankPort: p.m.ControlPort(), PageSize: g.PageSize, KVCacheDtype: &dtype, InstanceID: e.instance, Epoch: e.epoch}); err != nil {
			t.Fatal(err)
		}
		r, err := d.m.NewReceiver(stale, uint64(9+i))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		pg, _ := d.pool.Alloc(2)
		if err := r.Init(pg); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		now := fmt.Sprintf("inst-new (epoch %d)", p.m.Epoch())
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) ||
			!strings.Contains(r.Failure().Error(), e.want) || !strings.Contains(r.Failure().Error(), now) {
			t.Fatalf("room with a replaced prefill: %s %v, want Failed naming %q and %q", st, r.Failure(), e.want, now)
		}
		t.Logf("failed %s after Init: %v", time.Since(start).Round(time.Millisecond), r.Failure())
	}
	if n := sample(t, decReg, engine.MetricPeersLost, map[string]string{"role": "decode", "cause": "replaced"}); n < 2 {
		t.Errorf("%s{cause=replaced} = %v after two rooms met a replaced prefill, want >= 2", engine.MetricPeersLost, n)
	}
}

// TestMaxPeersBoundsSockets: a decode limited to 4 control peers answers
// STATUS frames about unknown rooms from 40 distinct endpoints (each answer
// needs a socket): it never holds more than 4 sockets, closing the least
// recently used idle one, and its real prefill (a registration) keeps its
// socket, so the pair's next room succeeds.
func TestMaxPeersBoundsSockets(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, maxPeers: 4})
	sendOne(t, addr, p, d, 1)
	in := newInjector(t, d.m.Endpoint())
	for i := range 40 {
		st := &control.StatusMsg{Room: uint64(1000 + i), State: int(engine.KVFailed), Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 21000+i), Reason: "stray"}
		in.send(st.Encode(), fmt.Sprintf("stray-%d", i), nil)
		if n := engine.PushSockets(d.m); n > 4 {
			t.Fatalf("%d control sockets after %d stray STATUS frames, limit 4", n, i+1)
		}
	}
	time.Sleep(200 * time.Millisecond) // the answers go out on their own goroutines
	if n := engine.PushSockets(d.m); n > 4 {
		t.Fatalf("%d control sockets, limit 4", n)
	}
	sendOne(t, addr, p, d, 2)
}

// TestMonitorReaderFailureDoesNotFreezeControl: when a control socket's
// monitor reader cannot be opened (a context out of sockets: "too many open
// files"), the monitor is stopped too. Left running without a reader, its
// first event (a reconnection attempt to an endpoint that refuses, every
// 100 ms) blocked ZeroMQ's I/O thread and with it every control socket of
// the rank: the pair's next room failed with each side calling the other
// silent (TestMaxPeersBoundsSockets, about one run in two).
func TestMonitorReaderFailureDoesNotFreezeControl(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	sendOne(t, addr, p, d, 1)
	engine.FailMonitorReaders(d.m)
	in := newInjector(t, d.m.Endpoint())
	for i := range 3 { // answers go to endpoints nobody listens on
		st := &control.StatusMsg{Room: uint64(2000 + i), State: int(engine.KVFailed), Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 22000+i), Reason: "stray"}
		in.send(st.Encode(), fmt.Sprintf("stray-%d", i), nil)
	}
	time.Sleep(500 * time.Millisecond) // several reconnection attempts
	sendOne(t, addr, p, d, 2)
}
