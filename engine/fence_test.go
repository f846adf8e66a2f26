package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// These tests reproduce the fencing issue's cases in one process, with the
// engine/faulty decorator standing in for a slow, stalled or dying producer
// and a dropped control channel. None uses the checksum or the engine's
// verification hook to decide: the test reads the decode's bytes itself.

// fillPages sets every byte of the given pages of every KV buffer to v.
func fillPages(t *testing.T, pool *workload.KVBuffers, pages []int32, v byte) {
	t.Helper()
	for i := range pool.Args().KVBuffers {
		item := pool.Buffer(i).ItemLen
		b := pool.Bytes(i)
		for _, p := range pages {
			row := b[uint64(p)*item : uint64(p+1)*item]
			for j := range row {
				row[j] = v
			}
		}
	}
}

// pagesAre returns an error naming the first byte of the pages that is not v.
func pagesAre(pool *workload.KVBuffers, pages []int32, v byte) error {
	for i := range pool.Args().KVBuffers {
		item := pool.Buffer(i).ItemLen
		b := pool.Bytes(i)
		for _, p := range pages {
			for j, c := range b[uint64(p)*item : uint64(p+1)*item] {
				if c != v {
					return fmt.Errorf("buffer %d page %d byte %d is %#x, want %#x (a late write landed)", i, p, j, c, v)
				}
			}
		}
	}
	return nil
}

// room is one request through one prefill and one decode rank, driven step
// by step.
type room struct {
	t      *testing.T
	id     uint64
	s      *engine.Sender
	r      *engine.Receiver
	src    []int32
	dst    []int32
	pre    *rank
	dec    *rank
	closed bool
}

// openRoom creates the receiver (destination pages filled with 0xAA) and
// the sender, and waits until the sender may send.
func openRoom(t *testing.T, addr string, pre, dec *rank, id uint64, pages int) *room {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	x := &room{t: t, id: id, pre: pre, dec: dec}
	var err error
	if x.dst, err = dec.pool.Alloc(pages); err != nil {
		t.Fatal(err)
	}
	fillPages(t, dec.pool, x.dst, 0xAA)
	if x.r, err = dec.m.NewReceiver(addr, id); err != nil {
		t.Fatal(err)
	}
	if err := x.r.Init(x.dst); err != nil {
		t.Fatal(err)
	}
	if x.s, err = pre.m.NewSender(id); err != nil {
		t.Fatal(err)
	}
	if st := x.s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("room %d: sender %s %v", id, st, x.s.Failure())
	}
	if x.src, err = pre.pool.Alloc(pages); err != nil {
		t.Fatal(err)
	}
	if err := workload.FillPattern(pre.pool, id, x.src, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.close)
	return x
}

// wait waits (bounded) until both sides are terminal.
func (x *room) wait() {
	x.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	x.r.Wait(ctx, engine.KVSuccess)
	x.s.Wait(ctx, engine.KVSuccess)
}

// close closes both sides (the receiver's Close waits for fencing) and frees
// the pages; it reports how long the receiver's Close took.
func (x *room) closeTimed() time.Duration {
	t0 := time.Now()
	x.r.Close()
	d := time.Since(t0)
	x.s.Close()
	if !x.closed {
		x.closed = true
		x.dec.pool.Free(x.dst)
		x.pre.pool.Free(x.src)
	}
	return d
}

func (x *room) close() { x.closeTimed() }

// agree fails the test unless both sides reached the same terminal state,
// and returns it.
func (x *room) agree() engine.KVPoll {
	x.t.Helper()
	ps, pr := x.s.Poll(), x.r.Poll()
	if ps != pr || (ps != engine.KVSuccess && ps != engine.KVFailed) {
		x.t.Fatalf("room %d: outcomes differ: prefill %s (%v), decode %s (%v)", x.id, ps, x.s.Failure(), pr, x.r.Failure())
	}
	return ps
}

// Case 2 of the issue: the decode fails the room (waiting timeout) while the
// producer is still writing (each batch lands 1.5 s late). The decode
// aborts the producer, the producer stops, reports "aborted by decode" and
// acknowledges; nothing lands, and the pages are handed back long before
// the fence timeout, through the acknowledgement.
func TestDecodeFailureAbortsProducer(t *testing.T) { forTransports(t, testDecodeFailureAbortsProducer) }

func testDecodeFailureAbortsProducer(t *testing.T, tr string) {
	addr := startBootstrap(t)
	preReg, decReg := prometheus.NewRegistry(), prometheus.NewRegistry()
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, addr: addr, metrics: preReg,
		wrap: func(tr transport.Transport) transport.Transport {
			return faulty.Wrap(tr, faulty.DelayWrites(1500*time.Millisecond))
		}})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, waiting: 300 * time.Millisecond, fenceTmo: time.Minute, metrics: decReg})
	x := openRoom(t, addr, pre, dec, 2, 8)
	for i := 0; i < len(x.src); i++ { // one page per chunk, as --chunk-pages 1
		if err := x.s.Send(x.src[i:i+1], i == len(x.src)-1); err != nil {
			t.Fatal(err)
		}
	}
	x.wait()
	if x.agree() != engine.KVFailed {
		t.Fatal("room succeeded although the decode's waiting timeout is shorter than the writes")
	}
	if err := x.s.Failure(); !errors.Is(err, engine.ErrAborted) || !strings.Contains(err.Error(), "aborted by decode") || !strings.Contains(err.Error(), "no Success") {
		t.Fatalf("prefill failure %v: want aborted by decode with the decode's reason", err)
	}
	if !errors.Is(x.r.Failure(), engine.ErrTimeout) {
		t.Fatalf("decode failure %v, want its waiting timeout", x.r.Failure())
	}
	// Until the producer's ABORT_ACK every page of the room is quarantined.
	// The gauge is read before the timeline: a zero gauge means the
	// acknowledgement came first, and the timeline then says so.
	q := sample(t, decReg, engine.MetricPoolPages, map[string]string{"state": "quarantined"})
	if tl, _ := dec.m.RoomTimeline(2); q != float64(len(x.dst)) && (q != 0 || !timelineHas(tl, "every producer fenced")) {
		t.Errorf("quarantined pages %v before Close, want %d (0 once acknowledged); timeline %s", q, len(x.dst), tl)
	}
	if d := x.closeTimed(); d > 30*time.Second {
		t.Fatalf("Receiver.Close took %s: the clean ABORT_ACK should fence the producer well before the 1 min fence timeout", d)
	}
	// The fencing events of this path: the pages were quarantined, ABORT
	// went out and was acknowledged; no data path had to be torn down.
	for _, c := range []struct {
		g          prometheus.Gatherer
		role, ev   string
		atLeastOne bool
	}{
		{decReg, "decode", "quarantined", true}, {decReg, "decode", "abort_sent", true}, {decReg, "decode", "abort_ack_received", true},
		{preReg, "prefill", "abort_received", true}, {preReg, "prefill", "abort_ack_sent", true}, {decReg, "decode", "fenced", false},
	} {
		n := sample(t, c.g, engine.MetricFencingEvents, map[string]string{"role": c.role, "event": c.ev})
		if (n >= 1) != c.atLeastOne {
			t.Errorf("%s{role=%s,event=%s} = %v, want at least one: %v", engine.MetricFencingEvents, c.role, c.ev, n, c.atLeastOne)
		}
	}
	if q := sample(t, decReg, engine.MetricPoolPages, map[string]string{"state": "quarantined"}); q != 0 {
		t.Errorf("quarantined pages %v after Close, want 0", q)
	}
	// Both timelines go on after the failure with the fencing.
	waitTimeline(t, dec.m, 2, "pages quarantined", "ABORT_ACK: clean", "every producer fenced: pages reusable", "closed")
	waitTimeline(t, dec.m, 2, "ABORT sent", "ABORT_ACK: clean") // the question before its answer; from its own goroutine, so before or after the quarantine
	waitTimeline(t, pre.m, 2, "ABORT received", "ABORT_ACK sent: clean")
	time.Sleep(2 * time.Second) // any delayed write would have landed by now
	if err := pagesAre(dec.pool, x.dst, 0xAA); err != nil {
		t.Fatal(err)
	}
}

// Case 1 of the issue, in process: the producer of room A stalls in the
// middle of the transfer (its writes held, its control messages lost, as a
// process stopped with SIGSTOP), the decode fails A at its waiting timeout,
// and A's pages are reused. The producer then resumes and posts its held
// writes: the decode fenced its data path before handing the pages back,
// so nothing lands in them. The next room on the same pair succeeds on a
// new data path, both sides agree, and its bytes are the producer's.
func TestStalledProducerFencedBeforeReuse(t *testing.T) {
	forTransports(t, testStalledProducerFencedBeforeReuse)
}

func testStalledProducerFencedBeforeReuse(t *testing.T, tr string) {
	addr := startBootstrap(t)
	drop := faulty.DropControl()
	var ft *faulty.Transport
	decReg := prometheus.NewRegistry()
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, addr: addr, controlFault: drop.Filter,
		wrap: func(tr transport.Transport) transport.Transport { ft = faulty.Wrap(tr); return ft }})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, waiting: time.Second, fenceTmo: 500 * time.Millisecond, metrics: decReg})
	a := openRoom(t, addr, pre, dec, 1, 8)
	if err := a.s.Send(a.src[:4], false); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); a.s.BytesSent() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first chunk never landed")
		}
	}
	// Stop the producer: later writes are held, its control messages lost.
	ft.Stall()
	drop.DropFor(4 * time.Second)
	if err := a.s.Send(a.src[4:], true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := a.r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("decode room A: %s, want Failed at its waiting timeout", st)
	}
	closeStart := time.Now()
	a.r.Close() // returns once the stalled producer's data path is fenced
	if n := sample(t, decReg, engine.MetricFencingEvents, map[string]string{"role": "decode", "event": "fenced"}); n < 1 {
		t.Errorf("%s{event=fenced} = %v after Close of a room whose producer never acknowledged", engine.MetricFencingEvents, n)
	}
	t.Logf("room A failed on the decode (%v); its pages were handed back %s later", a.r.Failure(), time.Since(closeStart).Round(time.Millisecond))
	waitTimeline(t, dec.m, 1, "pages quarantined", "fenced", "every producer fenced: pages reusable")
	// "Reuse" A's pages, then let the stale writer go.
	fillPages(t, dec.pool, a.dst, 0x55)
	ft.Resume()
	a.s.Wait(ctx, engine.KVSuccess)
	if a.s.Poll() != engine.KVFailed {
		t.Fatalf("prefill room A: %s, want Failed (the decode failed it)", a.s.Poll())
	}
	time.Sleep(2 * time.Second) // the held writes went out at Resume
	if err := pagesAre(dec.pool, a.dst, 0x55); err != nil {
		t.Fatalf("stale writer reached reused pages: %v", err)
	}
	if ft.Submits() < 2 {
		t.Fatalf("%d submits: the stalled batch was never posted", ft.Submits())
	}
	// The pair serves again: room B on a new data path (new epoch).
	time.Sleep(2500 * time.Millisecond) // let the control-channel drop end
	b := openRoom(t, addr, pre, dec, 2, 8)
	if err := b.s.Send(b.src, true); err != nil {
		t.Fatal(err)
	}
	b.wait()
	if b.agree() != engine.KVSuccess {
		t.Fatalf("room B after the fence: prefill %v, decode %v", b.s.Failure(), b.r.Failure())
	}
	if err := workload.VerifyPattern(dec.pool, 2, b.dst, 0); err != nil {
		t.Fatalf("room B's bytes: %v", err)
	}
}

// forTransports runs f once per host transport (tcp, and shm when it can
// run here).
func forTransports(t *testing.T, f func(t *testing.T, transport string)) {
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) {
			if err := transport.ProbeTransport(tr); err != nil {
				t.Skipf("%s unavailable: %v", tr, err)
			}
			f(t, tr)
		})
	}
}

// A lost verdict is asked for again: the prefill reports Success only once
// the decode's Success reached it.
func TestLostVerdictAskedAgain(t *testing.T) {
	addr := startBootstrap(t)
	drop := faulty.DropControl()
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, controlFault: drop.Filter})
	x := openRoom(t, addr, pre, dec, 9, 4)
	drop.DropNext(control.MsgStatus, 1) // the decode's verdict
	if err := x.s.Send(x.src, true); err != nil {
		t.Fatal(err)
	}
	x.wait()
	if x.agree() != engine.KVSuccess {
		t.Fatalf("prefill %v, decode %v", x.s.Failure(), x.r.Failure())
	}
	if n := drop.Dropped(control.MsgStatus); n != 1 {
		t.Fatalf("%d verdicts dropped, want 1", n)
	}
	if err := workload.VerifyPattern(dec.pool, 9, x.dst, 0); err != nil {
		t.Fatal(err)
	}
}

// A prefill that is itself stopped while it waits for the verdict (its
// receive loop blocked, as under SIGSTOP or CPU starvation) reads the
// verdict waiting in its inbox before it gives up on the decode: the decode
// said Success, so the prefill must too. With the wall-clock rule it failed
// the room "the decode did not answer" when it resumed, while the decode had
// accepted it (a disagreement the chaos soak found).
func TestStoppedPrefillReadsVerdictBeforeGivingUp(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a multi-second stall")
	}
	const peerTimeout = 2 * time.Second
	const stall = 5 * time.Second // past the waiting timeout and a further peer timeout
	addr := startBootstrap(t)
	drop := faulty.DropControl()
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, waiting: time.Second, peerTmo: peerTimeout})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, controlFault: drop.Filter, peerTmo: time.Minute})
	x := openRoom(t, addr, pre, dec, 12, 4)
	drop.DropNext(control.MsgStatus, 1) // the decode's first verdict
	var armed atomic.Bool
	armed.Store(true)
	blocked := make(chan struct{})
	engine.SetBeforeDispatch(pre.m, func(msgType string) {
		if msgType == control.MsgStatus && armed.CompareAndSwap(true, false) {
			close(blocked) // the answer to the prefill's first ask
			time.Sleep(stall)
		}
	})
	if err := x.s.Send(x.src, true); err != nil {
		t.Fatal(err)
	}
	select {
	case <-blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("the prefill never received an answer to its verdict request")
	}
	x.wait()
	if x.agree() != engine.KVSuccess {
		t.Fatalf("prefill %v, decode %v", x.s.Failure(), x.r.Failure())
	}
	if err := workload.VerifyPattern(dec.pool, 12, x.dst, 0); err != nil {
		t.Fatal(err)
	}
}

// While the decode stays reachable (its PINGs arrive) but its verdicts are
// lost, the prefill keeps asking past its waiting timeout and a further peer
// timeout, and reports the decode's Success once an answer gets through. The
// old rule gave up one peer timeout after the first ask: prefill Failed,
// decode Success.
func TestVerdictAskedUntilAnswerGetsThrough(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for several seconds of lost verdicts")
	}
	const waiting, peerTimeout = 4 * time.Second, 2 * time.Second
	const lossFor = 7500 * time.Millisecond // past waiting + peer timeout + a tick
	addr := startBootstrap(t)
	var lossUntil atomic.Int64 // unix ns; 0: not yet
	lossUntil.Store(time.Now().Add(time.Hour).UnixNano())
	statusLost := func(peer, msgType string) bool {
		return msgType == control.MsgStatus && time.Now().UnixNano() < lossUntil.Load()
	}
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, waiting: waiting, peerTmo: peerTimeout})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, controlFault: statusLost, peerTmo: time.Minute})
	x := openRoom(t, addr, pre, dec, 13, 4)
	start := time.Now()
	lossUntil.Store(start.Add(lossFor).UnixNano())
	if err := x.s.Send(x.src, true); err != nil {
		t.Fatal(err)
	}
	x.wait()
	if x.agree() != engine.KVSuccess {
		t.Fatalf("prefill %v, decode %v", x.s.Failure(), x.r.Failure())
	}
	if d := time.Since(start); d < lossFor {
		t.Fatalf("prefill Success after %s, before any verdict could arrive (%s)", d, lossFor)
	}
}

// A decode from which nothing at all arrives after it accepted the room
// (unreachable in that direction) is given up on after the waiting timeout
// and a further peer timeout: the prefill fails the room naming why, and
// does not hang. (The decode's Success then stands alone: no protocol can
// tell a prefill a verdict that cannot reach it.)
func TestUnreachableDecodeVerdictGivenUp(t *testing.T) {
	const waiting, peerTimeout = time.Second, 2 * time.Second
	addr := startBootstrap(t)
	var cut atomic.Bool
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, waiting: waiting, peerTmo: peerTimeout})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, peerTmo: time.Minute,
		controlFault: func(peer, msgType string) bool { return cut.Load() }})
	x := openRoom(t, addr, pre, dec, 14, 4)
	cut.Store(true)
	start := time.Now()
	if err := x.s.Send(x.src, true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if st := x.s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("prefill %s (%v), want Failed: no verdict can reach it", st, x.s.Failure())
	}
	if err := x.s.Failure(); !errors.Is(err, engine.ErrTimeout) || !strings.Contains(err.Error(), "nothing at all came from decode") {
		t.Fatalf("prefill failure %v: want a timeout naming the silent decode", err)
	}
	t.Logf("prefill gave up %s after Send (waiting %s + peer timeout %s)", time.Since(start).Round(time.Millisecond), waiting, peerTimeout)
}

// A room the decode rejects after every record passed (its own check of the
// bytes) fails on the prefill too: the prefill's Success waits for the
// decode's verdict.
func TestDecodeRejectionFailsProducer(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1,
		verifyKV: func(kv engine.ReceivedKV) error {
			return fmt.Errorf("room %d rejected by the caller", kv.Room)
		}})
	x := openRoom(t, addr, pre, dec, 11, 4)
	if err := x.s.Send(x.src, true); err != nil {
		t.Fatal(err)
	}
	x.wait()
	if x.agree() != engine.KVFailed || !strings.Contains(x.s.Failure().Error(), "rejected by the caller") {
		t.Fatalf("prefill %v, decode %v: want both Failed with the decode's reason", x.s.Failure(), x.r.Failure())
	}
}

// A producer dying in the middle of a batch (its segment closed after half
// the requests): both sides fail the room, the decode fences the data path
// before handing the pages back, and the next room on the pair succeeds on
// a new data path.
func TestKillMidBatchThenRecover(t *testing.T) { forTransports(t, testKillMidBatchThenRecover) }

func testKillMidBatchThenRecover(t *testing.T, tr string) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport { return faulty.Wrap(tr, faulty.KillMidBatch(1)) }})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, transports: []string{tr}, fenceTmo: time.Minute})
	a := openRoom(t, addr, pre, dec, 21, 8)
	if err := a.s.Send(a.src, true); err != nil {
		t.Fatal(err)
	}
	a.wait()
	if a.agree() != engine.KVFailed {
		t.Fatal("room with a killed batch succeeded")
	}
	if d := a.closeTimed(); d > 30*time.Second {
		t.Fatalf("Receiver.Close took %s; the unclean ABORT_ACK should fence the data path at once", d)
	}
	b := openRoom(t, addr, pre, dec, 22, 8)
	if err := b.s.Send(b.src, true); err != nil {
		t.Fatal(err)
	}
	b.wait()
	if b.agree() != engine.KVSuccess {
		t.Fatalf("room after the killed batch: prefill %v, decode %v", b.s.Failure(), b.r.Failure())
	}
	if err := workload.VerifyPattern(dec.pool, 22, b.dst, 0); err != nil {
		t.Fatal(err)
	}
}

// Case 5 of the issue: the decode refuses the pairing (kv_cache_dtype
// differs) before it looked any producer up; the prefill holding the request
// learns it at once instead of at its bootstrap timeout.
func TestRefusedPairingReachesProducer(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, kvDtype: "fp8_e4m3", bootTmo: time.Minute})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	s, err := pre.m.NewSender(5)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start := time.Now()
	r, err := dec.m.NewReceiver(addr, 5)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), "kv_cache_dtype") {
		t.Fatalf("decode: %s %v, want Failed naming kv_cache_dtype", st, r.Failure())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("prefill: %s after %s, want Failed well before its 1 min bootstrap timeout", st, time.Since(start))
	}
	if err := s.Failure(); !errors.Is(err, engine.ErrAborted) || !strings.Contains(err.Error(), "kv_cache_dtype") {
		t.Fatalf("prefill failure %v: want aborted by decode, naming kv_cache_dtype", err)
	}
	t.Logf("prefill failed %s after the decode's receiver was created: %v", time.Since(start).Round(time.Millisecond), s.Failure())
}

// timelineHas reports whether an event of tl mentions sub.
func timelineHas(tl engine.RoomTimeline, sub string) bool {
	for _, e := range tl.Events {
		if strings.Contains(e.Detail, sub) {
			return true
		}
	}
	return false
}

// waitTimeline waits (up to 30 s: events sent from goroutines may trail the
// state they follow) until m's timeline of room has an event mentioning
// each of want, in that order.
func waitTimeline(t *testing.T, m *engine.Manager, room uint64, want ...string) {
	t.Helper()
	var tl engine.RoomTimeline
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		tl, _ = m.RoomTimeline(room)
		i := 0
		for _, e := range tl.Events {
			if i < len(want) && strings.Contains(e.Detail, want[i]) {
				i++
			}
		}
		if i == len(want) {
			return
		}
	}
	t.Errorf("room %d timeline lacks, in order, %q:\n%s", room, want, tl)
}
