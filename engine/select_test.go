package engine_test

import (
	"context"
	"errors"
	"os"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/sglangenv"
	"github.com/kvxfer/kvxfer/workload"
)

// sendOne runs one request (1 prefill, 1 decode) to Success and returns the
// transports the sender used.
func sendOne(t *testing.T, addr string, p, d *rank, room uint64) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dp, _ := d.pool.Alloc(3)
	defer d.pool.Free(dp)
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.Init(dp)
	s, err := p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
	sendPattern(ctx, t, p, d, r, s, room, dp)
	s.Wait(ctx, engine.KVSuccess)
	return s.TransportNames()
}

// sendPattern sends room's pattern from len(dp) new pages of p as the
// whole room (one last chunk), waits for the decode's Success and checks
// that dp holds the pattern. The prefill's outcome is the caller's to
// check.
func sendPattern(ctx context.Context, t *testing.T, p, d *rank, r *engine.Receiver, s *engine.Sender, room uint64, dp []int32) {
	t.Helper()
	sp, _ := p.pool.Alloc(len(dp))
	defer p.pool.Free(sp)
	_ = workload.FillPattern(p.pool, room, sp, 0)
	if err := s.Send(sp, true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("decode of room %d: %s %v, want Success", room, st, r.Failure())
	}
	if err := workload.VerifyPattern(d.pool, room, dp, 0); err != nil {
		t.Fatal(err)
	}
}

func TestTransportSelectionAndFallback(t *testing.T) {
	if err := transport.ProbeTransport("shm"); err != nil {
		t.Skipf("shm transport unavailable: %v", err)
	}
	addr := startBootstrap(t)
	// Both sides have shm and tcp: the higher-priority shm is chosen.
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, transports: []string{"shm", "tcp"}})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: []string{"shm", "tcp"}})
	if got := sendOne(t, addr, p, d, 1); !reflect.DeepEqual(got, []string{"shm"}) {
		t.Fatalf("chose %v, want [shm]", got)
	}

	// The prefill's shm cannot open the decode's segment (as on another
	// host): it falls back to tcp.
	addr2 := startBootstrap(t)
	p2 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr2, transports: []string{"shm", "tcp"},
		wrap: func(tr transport.Transport) transport.Transport {
			return faulty.Wrap(tr, faulty.FailInstall(), faulty.FailWith(transport.ErrUnavailable))
		}})
	d2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: []string{"shm", "tcp"}})
	if got := sendOne(t, addr2, p2, d2, 2); !reflect.DeepEqual(got, []string{"tcp"}) {
		t.Fatalf("chose %v, want the tcp fallback", got)
	}
}

// TestCallerMemorySelectsCMA: buffers that are the caller's own memory (no
// memfd) on both sides of one host, with shm, cma and tcp offered (what
// auto opens): shm cannot register them, so the room runs on cma; where
// the kernel refuses cross-memory attach (cma's OpenSegment fails with
// ErrUnavailable, as on EPERM) it falls back to tcp.
func TestCallerMemorySelectsCMA(t *testing.T) {
	if err := transport.ProbeTransport("cma"); err != nil {
		t.Skipf("cma transport unavailable: %v", err)
	}
	all := []string{"cma", "shm", "tcp"}
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, transports: all, noFD: true})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: all, noFD: true})
	for _, r := range []*rank{p, d} {
		if got := r.m.TransportNames(); !reflect.DeepEqual(got, []string{"cma", "tcp"}) {
			t.Fatalf("registered with %v, want [cma tcp] (shm cannot share memory without an fd)", got)
		}
	}
	if got := sendOne(t, addr, p, d, 1); !reflect.DeepEqual(got, []string{"cma"}) {
		t.Fatalf("chose %v, want [cma]", got)
	}

	addr2 := startBootstrap(t)
	p2 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr2, transports: all, noFD: true,
		wrap: func(tr transport.Transport) transport.Transport {
			return faulty.Wrap(tr, faulty.FailInstall(), faulty.FailWith(transport.ErrUnavailable))
		}})
	d2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: all, noFD: true})
	if got := sendOne(t, addr2, p2, d2, 2); !reflect.DeepEqual(got, []string{"tcp"}) {
		t.Fatalf("chose %v, want the tcp fallback", got)
	}
}

// handshakeTransport makes a transport look like one that needs a second
// handshake step (CapHandshake, as RDMA's QP exchange): the segment returns a
// reply blob and the receiver's Accept must see it.
type handshakeTransport struct {
	transport.Transport
	accepted atomic.Value // []byte
	refuse   bool
}

type handshakeSeg struct{ transport.Segment }

func (h *handshakeTransport) Capabilities() transport.Caps {
	return h.Transport.Capabilities() | transport.CapHandshake
}

func (h *handshakeTransport) AdmitEpoch(peer string, epoch uint64) error {
	return fenceOf(h.Transport).AdmitEpoch(peer, epoch)
}

func (h *handshakeTransport) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	return fenceOf(h.Transport).FenceEpoch(ctx, peer, epoch)
}

func (h *handshakeTransport) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	s, err := h.Transport.OpenSegment(ctx, info)
	if err != nil {
		return nil, err
	}
	return handshakeSeg{s}, nil
}

func (handshakeSeg) HandshakeReply() []byte { return []byte("qpn=7;psn=9") }

func (h *handshakeTransport) Accept(ctx context.Context, peer string, reply []byte) error {
	if h.refuse {
		return errors.New("QP transition to RTR failed")
	}
	h.accepted.Store(append([]byte(nil), reply...))
	return nil
}

func TestHandshakeTransport(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		addr := startBootstrap(t)
		dh := &handshakeTransport{refuse: refuse}
		p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
			wrap: func(tr transport.Transport) transport.Transport { return &handshakeTransport{Transport: tr} }})
		d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1,
			wrap: func(tr transport.Transport) transport.Transport { dh.Transport = tr; return dh }})
		if !refuse {
			sendOne(t, addr, p, d, 5)
			if got, _ := dh.accepted.Load().([]byte); string(got) != "qpn=7;psn=9" {
				t.Fatalf("decode accepted %q, want the segment's reply", got)
			}
			continue
		}
		r := transferOneExpectFail(t, addr, []*rank{p}, []*rank{d}, 6, 2)
		if r.Poll() != engine.KVFailed || r.Failure() == nil || !strings.Contains(r.Failure().Error(), "QP transition to RTR failed") {
			t.Fatalf("refused handshake: receiver %s %v", r.Poll(), r.Failure())
		}
		r.Close()
	}
}

func TestTimeoutsFromSGLangEnv(t *testing.T) {
	t.Setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "0.3")
	t.Setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "0.3")
	// The edges (CLI, C ABI) read the variables into the config; the
	// engine reads none.
	var env engine.ManagerConfig
	if err := sglangenv.Apply(os.Getenv, &env); err != nil {
		t.Fatal(err)
	}
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: env.BootstrapTimeout, waiting: env.WaitingTimeout})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: env.BootstrapTimeout, waiting: env.WaitingTimeout})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, _ := p.m.NewSender(9) // no decode ever asks for room 9
	defer s.Close()
	// Room 10's prefill sender never sends (a prefill with no sender at
	// all answers the TRANSFER at its own bootstrap timeout).
	s10, _ := p.m.NewSender(10)
	defer s10.Close()
	r, _ := d.m.NewReceiver(addr, 10)
	defer r.Close()
	pg, _ := d.pool.Alloc(1)
	r.Init(pg)
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrTimeout) {
		t.Fatalf("sender: %s %v, want the env bootstrap timeout", st, s.Failure())
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrTimeout) {
		t.Fatalf("receiver: %s %v, want the env waiting timeout", st, r.Failure())
	}
	t.Setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "soon")
	if _, err := sglangenv.Seconds(os.Getenv, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", time.Second); err == nil {
		t.Fatal("malformed env accepted")
	}
}
