package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
	"github.com/kvxfer/kvxfer/workload"
)

var (
	smallGQA = workload.ModelConfig{Name: "tiny-gqa", NumLayers: 4, NumKVHeads: 4, HeadDim: 16, DtypeBytes: 2}
	smallMLA = workload.ModelConfig{Name: "tiny-mla", NumLayers: 3, NumKVHeads: 1, HeadDim: 36, DtypeBytes: 2, MLA: true, KVLoraRank: 32, QKRopeHeadDim: 4}
)

func startBootstrap(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatalf("bootstrap server: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("bootstrap server did not start")
	}
	t.Cleanup(func() { cancel(); <-done })
	return srv.Addr()
}

type rank struct {
	m    *engine.Manager
	pool *workload.KVBuffers
}

type rankOpts struct {
	role             engine.Role
	model            workload.ModelConfig
	tp, tpRank       int
	pp, ppRank       int
	pages            int
	addr             string
	checksum         bool
	waiting, peerTmo time.Duration
	bootTmo          time.Duration
	wrap             func(transport.Transport) transport.Transport
	transports       []string             // default: tcp
	envTimeouts      bool                 // leave zero timeouts to the SGLang env variables
	bootHB           time.Duration        // decode: BootstrapHeartbeatInterval (0: default)
	dirCheck         time.Duration        // prefill: DirectoryCheckInterval (0: default)
	host             string               // control and data listen host (default 127.0.0.1)
	advertise        string               // AdvertiseHost of the manager and transports
	metrics          *prometheus.Registry // ManagerConfig.Metrics (nil: none)
	noProbe          bool                 // ManagerConfig.NoProbe
	tracer           trace.TracerProvider // ManagerConfig.TracerProvider
	fenceTmo         time.Duration        // decode: FenceTimeout (0: default)
	kvDtype          string               // KVCacheDtype ("": auto)
	controlFault     func(peer, msgType string) bool
	verifyKV         func(engine.ReceivedKV) error
	ringSlots        int                         // decode: RingSlots (0: default)
	authToken        string                      // BootstrapAuthToken
	authControl      bool                        // AuthenticateControl (needs authToken)
	instance         string                      // InstanceID ("": random)
	maxPeers         int                         // MaxPeers (0: default)
	policy           string                      // prefill: DecodeAllocationPolicy
	layout           []byte                      // prefill: DSV41SpecLayout
	noHeads          bool                        // KVArgs without kv_head_num/total_kv_head_num, as SGLang's decode fills them
	httpPort         int                         // prefill: PrefillHTTPPort
	onDevice         bool                        // KV buffers on cuda:0 (a fake or real CUDA library must be loaded)
	cfgMod           func(*engine.ManagerConfig) // last word on the manager's configuration
	noFD             bool                        // buffers registered without their memfd, as a caller's own memory (shm cannot share them)
}

func newRank(t testing.TB, o rankOpts) *rank {
	t.Helper()
	if o.pages == 0 {
		o.pages = 64
	}
	l, err := workload.NewLayout(o.model, workload.LayoutOptions{PageSize: 4, TPSize: o.tp, TPRank: o.tpRank, PPSize: o.pp, PPRank: o.ppRank, NumPages: o.pages})
	if err != nil {
		t.Fatal(err)
	}
	dev := -1
	if o.onDevice {
		dev = 0
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "test", Device: dev, Aux: workload.DefaultAux, AuxRows: 16})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.transports) == 0 {
		o.transports = []string{"tcp"}
	}
	var trs []transport.Transport
	topts := transport.DefaultOptions()
	if o.host != "" {
		topts.ListenHost = o.host
	}
	topts.AdvertiseHost = o.advertise
	for i, name := range o.transports {
		tr, err := transport.OpenTransport(name, topts)
		if err != nil {
			t.Fatal(err)
		}
		if o.wrap != nil && i == 0 {
			tr = o.wrap(tr)
		}
		trs = append(trs, tr)
	}
	args := pool.Args()
	if o.noFD {
		for _, list := range [][]kvargs.Buffer{args.KVBuffers, args.AuxBuffers, args.StateBuffers} {
			for i := range list {
				list[i].FD = -1
			}
		}
	}
	cfg := engine.ManagerConfig{Role: o.role, KV: args, Transports: trs, BootstrapAddr: o.addr,
		Checksum: o.checksum, WaitingTimeout: o.waiting, PeerTimeout: o.peerTmo, BootstrapTimeout: o.bootTmo,
		BootstrapHeartbeatInterval: o.bootHB, DirectoryCheckInterval: o.dirCheck, ControlHost: o.host, AdvertiseHost: o.advertise,
		FenceTimeout: o.fenceTmo, KVCacheDtype: o.kvDtype, ControlFault: o.controlFault, VerifyKV: o.verifyKV, RingSlots: o.ringSlots,
		BootstrapAuthToken: o.authToken, AuthenticateControl: o.authControl, InstanceID: o.instance, MaxPeers: o.maxPeers,
		DecodeAllocationPolicy: o.policy, DSV41SpecLayout: o.layout, PrefillHTTPPort: o.httpPort}
	if o.noHeads {
		cfg.KV.KVHeadNum, cfg.KV.TotalKVHeadNum = 0, 0
	}
	if o.metrics != nil {
		cfg.Metrics = o.metrics
	}
	cfg.NoProbe, cfg.TracerProvider = o.noProbe, o.tracer
	if cfg.BootstrapTimeout == 0 && !o.envTimeouts {
		cfg.BootstrapTimeout = 20 * time.Second
	}
	if cfg.WaitingTimeout == 0 && !o.envTimeouts {
		cfg.WaitingTimeout = 20 * time.Second
	}
	if o.cfgMod != nil {
		o.cfgMod(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, err := engine.NewManager(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := &rank{m: m, pool: pool}
	t.Cleanup(func() {
		m.Close()
		for _, tr := range trs {
			tr.Close()
		}
		pool.Close()
	})
	return r
}

// topology builds prefill ranks (ptp × ppp) and decode ranks (dtp).
func topology(t *testing.T, model workload.ModelConfig, ptp, ppp, dtp int, checksum bool) (addr string, pre, dec []*rank) {
	t.Helper()
	return topologyWith(t, model, ptp, ppp, dtp, func(o *rankOpts) { o.checksum = checksum && o.role == engine.RoleDecode })
}

// topologyWith is topology with each rank's options adjusted by mod.
func topologyWith(t *testing.T, model workload.ModelConfig, ptp, ppp, dtp int, mod func(*rankOpts)) (addr string, pre, dec []*rank) {
	t.Helper()
	addr = startBootstrap(t)
	for tp := 0; tp < ptp; tp++ {
		for pp := 0; pp < ppp; pp++ {
			o := rankOpts{role: engine.RolePrefill, model: model, tp: ptp, tpRank: tp, pp: ppp, ppRank: pp, addr: addr}
			mod(&o)
			pre = append(pre, newRank(t, o))
		}
	}
	for tp := 0; tp < dtp; tp++ {
		o := rankOpts{role: engine.RoleDecode, model: model, tp: dtp, tpRank: tp, pp: 1}
		mod(&o)
		dec = append(dec, newRank(t, o))
	}
	return addr, pre, dec
}

// transferOne runs one request of `pages` pages through every rank and returns
// the decode receivers (terminal) after verifying the pattern on Success.
func transferOne(t *testing.T, addr string, pre, dec []*rank, room uint64, pages int) []*engine.Receiver {
	t.Helper()
	recvs, _ := transferRoom(t, addr, pre, dec, room, pages)
	return recvs
}

// transferRoom is transferOne that also returns, per prefill rank, the KV
// bytes its sender wrote (0 for a dummy).
func transferRoom(t *testing.T, addr string, pre, dec []*rank, room uint64, pages int) ([]*engine.Receiver, []uint64) {
	t.Helper()
	sent := make([]uint64, len(pre))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var recvs []*engine.Receiver
	var dpages [][]int32
	for _, d := range dec {
		// Fragment the destination: take 2×pages and use every other page.
		all, err := d.pool.Alloc(2 * pages)
		if err != nil {
			t.Fatal(err)
		}
		var pg []int32
		for i := 0; i < len(all); i += 2 {
			pg = append(pg, all[i])
		}
		defer d.pool.Free(all)
		r, err := d.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		if err := r.Init(pg); err != nil {
			t.Fatal(err)
		}
		recvs = append(recvs, r)
		dpages = append(dpages, pg)
	}
	var wg sync.WaitGroup
	for pi, p := range pre {
		s, err := p.m.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
				t.Errorf("sender room %d: state %s (%v), want WaitingForInput", room, st, s.Failure())
				return
			}
			n := s.DstPages()
			src, err := p.pool.Alloc(n)
			if err != nil {
				t.Error(err)
				return
			}
			defer p.pool.Free(src)
			if err := workload.FillPattern(p.pool, room, src, 0); err != nil {
				t.Error(err)
				return
			}
			half := len(src) / 2
			if err := s.Send(src[:half], false); err != nil {
				t.Error(err)
				return
			}
			if err := s.Send(src[half:], true); err != nil {
				t.Error(err)
				return
			}
			if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
				t.Errorf("sender room %d: state %s (%v)", room, st, s.Failure())
			}
			sent[pi] = s.BytesSent()
		}()
	}
	for i, r := range recvs {
		r.Wait(ctx, engine.KVSuccess)
		if r.Poll() == engine.KVSuccess {
			if err := workload.VerifyPattern(dec[i].pool, room, dpages[i], 0); err != nil {
				t.Error(err)
			}
		}
	}
	wg.Wait()
	return recvs, sent
}

func TestTransferTopologies(t *testing.T) {
	cases := []struct {
		name          string
		model         workload.ModelConfig
		ptp, ppp, dtp int
		checksum      bool
	}{
		{"tp1-1", smallGQA, 1, 1, 1, true},
		{"tp2-1", smallGQA, 2, 1, 1, true},
		{"tp1-2", smallGQA, 1, 1, 2, true},
		{"mla-tp2-1-dummy", smallMLA, 2, 1, 1, true},
		{"pp2-1", smallGQA, 1, 2, 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr, pre, dec := topology(t, c.model, c.ptp, c.ppp, c.dtp, c.checksum)
			for i, room := range []uint64{0, 1<<63 - 1, 12345} {
				recvs := transferOne(t, addr, pre, dec, room, 5+i)
				for _, r := range recvs {
					if r.Poll() != engine.KVSuccess {
						t.Fatalf("room %d: receiver %s: %v", room, r.Poll(), r.Failure())
					}
					r.Close()
				}
			}
		})
	}
}

func TestDuplicateRoomRejected(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	r, err := dec[0].m.NewReceiver(addr, 7)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := dec[0].m.NewReceiver(addr, 7); !errors.Is(err, engine.ErrRoomActive) {
		t.Fatalf("second receiver for room 7: err %v, want ErrRoomActive", err)
	}
	s, err := pre[0].m.NewSender(7)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pre[0].m.NewSender(7); !errors.Is(err, engine.ErrRoomActive) {
		t.Fatalf("second sender for room 7: err %v, want ErrRoomActive", err)
	}
	s.Close()
	s2, err := pre[0].m.NewSender(7)
	if err != nil {
		t.Fatalf("sender after Close: %v", err)
	}
	s2.Close()
}

func TestAbortFromDecode(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := pre[0].m.NewSender(99)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r, err := dec[0].m.NewReceiver(addr, 99)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := dec[0].pool.Alloc(3)
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s: %v", st, s.Failure())
	}
	r.Abort()
	if r.Poll() != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrAborted) {
		t.Fatalf("receiver after Abort: %s %v", r.Poll(), r.Failure())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrAborted) {
		t.Fatalf("sender after decode ABORT: %s %v, want Failed/ErrAborted", st, s.Failure())
	}
	if err := s.Send([]int32{0, 1, 2}, true); err == nil {
		t.Fatal("Send after abort succeeded")
	}
}

func TestAbortFromPrefill(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := dec[0].m.NewReceiver(addr, 5)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := dec[0].pool.Alloc(3)
	r.Init(pg)
	s, err := pre[0].m.NewSender(5)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.Wait(ctx, engine.KVWaitingForInput)
	s.Abort()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), "aborted") {
		t.Fatalf("receiver after prefill abort: %s %v", st, r.Failure())
	}
}

func TestBootstrapTimeout(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, bootTmo: 300 * time.Millisecond})
	s, err := p.m.NewSender(3)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrTimeout) {
		t.Fatalf("sender with no decode: %s %v, want Failed/ErrTimeout", st, s.Failure())
	}
}

func TestWaitingTimeout(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	_ = p
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, waiting: 400 * time.Millisecond})
	r, err := d.m.NewReceiver(addr, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := d.pool.Alloc(2)
	r.Init(pg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// The prefill never creates a sender for room 4.
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrTimeout) {
		t.Fatalf("receiver: %s %v, want Failed/ErrTimeout", st, r.Failure())
	}
}

func TestResolveUnknownBootstrapFails(t *testing.T) {
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: 500 * time.Millisecond})
	r, err := d.m.NewReceiver("127.0.0.1:1", 8)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVWaitingForInput); st != engine.KVFailed {
		t.Fatalf("receiver with no bootstrap server: %s", st)
	}
	if !strings.Contains(r.Failure().Error(), "127.0.0.1:1") {
		t.Fatalf("failure does not name the address: %v", r.Failure())
	}
	// The cause, not only the deadline: nothing listens on port 1.
	if !strings.Contains(r.Failure().Error(), "connection refused") {
		t.Fatalf("failure does not say why the directory was unreachable: %v", r.Failure())
	}
}

// TestResolveSilentBootstrapSaysWhatToCheck: an address that accepts
// connections but never answers HTTP (a rank's ZeroMQ control port given
// as the bootstrap address) fails at the bootstrap timeout saying that
// nothing answered and what the address should be, not a bare deadline.
func TestResolveSilentBootstrapSaysWhatToCheck(t *testing.T) {
	ln := testenv.SilentListener(t)
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: 500 * time.Millisecond})
	r, err := d.m.NewReceiver(ln.Addr().String(), 9)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVWaitingForInput); st != engine.KVFailed {
		t.Fatalf("receiver with a silent bootstrap address: %s", st)
	}
	msg := r.Failure().Error()
	for _, want := range []string{ln.Addr().String(), "no answer", "bootstrap server's HTTP port"} {
		if !strings.Contains(msg, want) {
			t.Errorf("failure %q lacks %q", msg, want)
		}
	}
}

func TestPeerClosedMidTransfer(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := dec[0].m.NewReceiver(addr, 11)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, _ := dec[0].pool.Alloc(4)
	r.Init(pg)
	s, err := pre[0].m.NewSender(11)
	if err != nil {
		t.Fatal(err)
	}
	s.Wait(ctx, engine.KVWaitingForInput)
	// The prefill rank dies before sending (its manager goes away silently
	// from the decode's point of view: no STATUS).
	start := time.Now()
	pre[0].m.Close()
	st := r.Wait(ctx, engine.KVSuccess)
	if st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) {
		t.Fatalf("receiver after prefill loss: %s %v", st, r.Failure())
	}
	t.Logf("decode noticed the lost prefill after %s: %v", time.Since(start).Round(time.Millisecond), r.Failure())
}

var _ = fmt.Sprint

// TestBootstrapCacheInvalidatedOnPeerLoss: after a prefill rank is lost the
// decode drops its cached bootstrap info, so a restarted prefill (new control
// port) is resolved afresh and serves the next request.
func TestBootstrapCacheInvalidatedOnPeerLoss(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	for _, r := range transferOne(t, addr, pre, dec, 1, 2) {
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("first request: %s %v", r.Poll(), r.Failure())
		}
		r.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := dec[0].m.NewReceiver(addr, 2)
	if err != nil {
		t.Fatal(err)
	}
	pg, _ := dec[0].pool.Alloc(2)
	r.Init(pg)
	r.Wait(ctx, engine.KVTransferring)
	old := pre[0].m.Endpoint()
	pre[0].m.Close() // the prefill rank goes away
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) {
		t.Fatalf("receiver: %s %v", st, r.Failure())
	}
	r.Close()
	dec[0].pool.Free(pg)
	restarted := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	if restarted.m.Endpoint() == old {
		t.Fatalf("restarted prefill reuses endpoint %s", old)
	}
	for _, r := range transferOne(t, addr, []*rank{restarted}, dec, 3, 2) {
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("request after the restart: %s %v (stale bootstrap cache?)", r.Poll(), r.Failure())
		}
	}
}
