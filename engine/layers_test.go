package engine_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// lwPlan is how a prefill rank sends a room layer by layer: the chunks of
// a chunked prefill (chunkPages pages each; 0: one chunk) times the layer
// ranges (span layers per SendLayers call), chunk by chunk or (layerMajor)
// layer by layer, each range filled with the pattern just before it is
// sent (the forward pass writing that layer's KV). prefixPages are held by
// the decode already.
type lwPlan struct {
	name        string
	chunkPages  int
	span        int
	layerMajor  bool
	prefixPages int
}

// lwCall is one SendLayers call of a plan: positions [c0, c1) of the pages
// sent, model layers lo…hi.
type lwCall struct{ c0, c1, lo, hi int }

// calls lists the plan's SendLayers calls for n pages over layers
// [start, end).
func (pl lwPlan) calls(n, start, end int) []lwCall {
	cp, span := pl.chunkPages, max(pl.span, 1)
	if cp <= 0 {
		cp = max(n, 1)
	}
	var chunks [][2]int
	for c0 := 0; c0 < n || (n == 0 && len(chunks) == 0); c0 += cp {
		chunks = append(chunks, [2]int{c0, min(c0+cp, n)})
	}
	var out []lwCall
	for a := 0; a < len(chunks)*((end-start+span-1)/span); a++ {
		var ci, li int
		nl := (end - start + span - 1) / span
		if pl.layerMajor {
			li, ci = a/len(chunks), a%len(chunks)
		} else {
			ci, li = a/nl, a%nl
		}
		lo := start + li*span
		out = append(out, lwCall{chunks[ci][0], chunks[ci][1], lo, min(lo+span, end) - 1})
	}
	return out
}

// lwRoom is one room of a layer-wise test: what each side holds.
type lwRoom struct {
	room   uint64
	tokens int
	prefix int // pages held by the decode
	aux    int // the aux row on both sides
	recvs  []*engine.Receiver
	dpages [][]int32 // per decode rank: every page of the prompt (prefix first)
}

// startDecodes opens a receiver for room on every decode rank, asking for
// the pages after prefix pages (a fragmented destination: every other page).
func startDecodes(t *testing.T, addr string, dec []*rank, room uint64, pages, prefix int) *lwRoom {
	t.Helper()
	lr := &lwRoom{room: room, tokens: pages * 4, prefix: prefix, aux: int(room % 16)}
	for _, d := range dec {
		all, err := d.pool.Alloc(2 * pages)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.pool.Free(all) })
		var pg []int32
		for i := 0; i < len(all); i += 2 {
			pg = append(pg, all[i])
		}
		r, err := d.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		if err := r.SetTokens(lr.tokens); err != nil {
			t.Fatal(err)
		}
		if err := r.SendMetadata(pg[prefix:], lr.aux, nil, prefix*4); err != nil {
			t.Fatal(err)
		}
		lr.recvs, lr.dpages = append(lr.recvs, r), append(lr.dpages, pg)
	}
	return lr
}

// sendLayerwise drives one prefill rank's sender through the plan's calls
// (all of them when upTo < 0, else the first upTo) and returns the sender
// and its source pages.
func sendLayerwise(t *testing.T, ctx context.Context, p *rank, lr *lwRoom, pl lwPlan, upTo int) (*engine.Sender, []int32) {
	t.Helper()
	s, err := p.m.NewSender(lr.room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.SetTokens(lr.tokens); err != nil {
		t.Fatal(err)
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("room %d: sender %s (%v), want WaitingForInput", lr.room, st, s.Failure())
	}
	lay := p.pool.Layout()
	var src []int32
	if s.HasRealDst() {
		n, err := s.InitTokens(lr.tokens, lr.aux)
		if err != nil {
			t.Fatal(err)
		}
		if n != lr.tokens/4-lr.prefix {
			t.Fatalf("InitTokens: %d pages, want %d", n, lr.tokens/4-lr.prefix)
		}
		if src, err = p.pool.Alloc(n); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.pool.Free(src) })
		if err := workload.FillAux(p.pool, lr.room, lr.aux); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range pl.calls(len(src), lay.StartLayer, lay.EndLayer) {
		if upTo >= 0 && i >= upTo {
			break
		}
		pg := src[c.c0:c.c1]
		if err := workload.FillPatternLayers(p.pool, lr.room, pg, lr.prefix+c.c0, c.lo, c.hi); err != nil {
			t.Fatal(err)
		}
		if err := s.SendLayers(pg, c.lo, c.hi, nil); err != nil {
			t.Fatalf("room %d: SendLayers(pages %d…%d, layers %d…%d): %v", lr.room, c.c0, c.c1, c.lo, c.hi, err)
		}
	}
	return s, src
}

// verifyDecodes waits for every receiver's Success and checks every byte
// the test itself (no VerifyKV hook, no checksum needed): the pages after
// the prefix carry the room's pattern, and so does the aux row.
func (lr *lwRoom) verifyDecodes(t *testing.T, ctx context.Context, dec []*rank) {
	t.Helper()
	for i, r := range lr.recvs {
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Fatalf("room %d: decode rank %d: %s (%v)", lr.room, i, st, r.Failure())
		}
		if err := workload.VerifyPattern(dec[i].pool, lr.room, lr.dpages[i][lr.prefix:], lr.prefix); err != nil {
			t.Fatalf("room %d: decode rank %d: %v", lr.room, i, err)
		}
		if err := workload.VerifyAux(dec[i].pool, lr.room, lr.aux); err != nil {
			t.Fatalf("room %d: decode rank %d aux row: %v", lr.room, i, err)
		}
	}
}

var lwPlans = []lwPlan{
	{name: "layer-by-layer"},
	{name: "chunked-3x-layers", chunkPages: 3},
	{name: "layer-major-span2", chunkPages: 2, span: 2, layerMajor: true},
	{name: "prefix-2-chunked", chunkPages: 2, prefixPages: 2},
}

// TestLayerwiseTopologies: rooms sent layer range by layer range, in every
// chunking, through every topology (equal TP, TP mismatch with head slicing
// per layer, a decode TP larger than the prefill's, MLA with a dummy rank,
// PP where each stage sends its own layers), with decode prefix reuse:
// both sides reach Success and every byte is right, checked by the test
// (no VerifyKV, no checksum; one topology with the CRC32C on).
func TestLayerwiseTopologies(t *testing.T) {
	cases := []struct {
		name          string
		model         workload.ModelConfig
		ptp, ppp, dtp int
		checksum      bool
	}{
		{"tp1-1-crc", smallGQA, 1, 1, 1, true},
		{"tp2-1", smallGQA, 2, 1, 1, false},
		{"tp1-2", smallGQA, 1, 1, 2, false},
		{"mla-tp2-1-dummy", smallMLA, 2, 1, 1, false},
		{"pp2-1", smallGQA, 1, 2, 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr, pre, dec := topology(t, c.model, c.ptp, c.ppp, c.dtp, c.checksum)
			for k, pl := range lwPlans {
				t.Run(pl.name, func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					lr := startDecodes(t, addr, dec, uint64(1000+k), 7, pl.prefixPages)
					var wg sync.WaitGroup
					var senders []*engine.Sender
					var mu sync.Mutex
					for _, p := range pre {
						wg.Go(func() {
							s, _ := sendLayerwise(t, ctx, p, lr, pl, -1)
							mu.Lock()
							senders = append(senders, s)
							mu.Unlock()
						})
					}
					wg.Wait()
					lr.verifyDecodes(t, ctx, dec)
					for _, s := range senders {
						if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
							t.Fatalf("sender: %s (%v)", st, s.Failure())
						}
					}
				})
			}
		})
	}
}

// TestLayerwisePlanCalls checks the test's own call generator: every
// (position, layer) is covered exactly once.
func TestLayerwisePlanCalls(t *testing.T) {
	for _, pl := range lwPlans {
		seen := map[[2]int]int{}
		for _, c := range pl.calls(5, 2, 6) {
			for p := c.c0; p < c.c1; p++ {
				for l := c.lo; l <= c.hi; l++ {
					seen[[2]int{p, l}]++
				}
			}
		}
		if len(seen) != 5*4 {
			t.Fatalf("%s: %d (page, layer) pairs covered, want 20", pl.name, len(seen))
		}
		for k, n := range seen {
			if n != 1 {
				t.Fatalf("%s: %v covered %d times", pl.name, k, n)
			}
		}
	}
}

// zeroLayers fails unless the decode rank's destination pages of model
// layers lo…hi (K and V) are all zero: nothing of them was written.
func zeroLayers(t *testing.T, d *rank, pages []int32, lo, hi int) {
	t.Helper()
	lay := d.pool.Layout()
	il := lay.ItemLen()
	for layer := lo; layer <= hi; layer++ {
		for kv := 0; kv < lay.KVs(); kv++ {
			i, ok := lay.BufferIndex(layer, kv)
			if !ok {
				t.Fatalf("layer %d kv %d not held", layer, kv)
			}
			b := d.pool.Bytes(i)
			for _, pg := range pages {
				if !bytes.Equal(b[uint64(pg)*il:uint64(pg+1)*il], make([]byte, il)) {
					t.Fatalf("layer %d buffer %d page %d was written after the room stopped", layer, i, pg)
				}
			}
		}
	}
}

// lwFault runs one room of smallGQA (4 layers) whose prefill sends layers
// 0 and 1 (flushed: they landed), then hands the test the sides to break.
func lwFault(t *testing.T, pre, dec *rankOpts) (context.Context, *engine.Sender, *lwRoom, *rank, *rank) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	t.Cleanup(cancel)
	addr := startBootstrap(t)
	pre.addr, pre.role, pre.model, pre.tp, pre.pp = addr, engine.RolePrefill, smallGQA, 1, 1
	dec.role, dec.model, dec.tp, dec.pp = engine.RoleDecode, smallGQA, 1, 1
	p, d := newRank(t, *pre), newRank(t, *dec)
	lr := startDecodes(t, addr, []*rank{d}, 77, 6, 0)
	s, _ := sendLayerwise(t, ctx, p, lr, lwPlan{}, 2)
	if err := s.Flush(ctx); err != nil {
		t.Fatalf("Flush after layers 0-1: %v", err)
	}
	if err := workload.VerifyPatternLayers(d.pool, lr.room, lr.dpages[0], 0, 0, 1); err != nil {
		t.Fatalf("layers 0-1 did not land before the room is complete: %v", err)
	}
	if st := lr.recvs[0].Poll(); st != engine.KVTransferring {
		t.Fatalf("decode with 2 of 4 layers: %s (%v), want Transferring", st, lr.recvs[0].Failure())
	}
	return ctx, s, lr, p, d
}

// failedBoth waits until both sides are Failed and returns their errors.
func failedBoth(t *testing.T, ctx context.Context, s *engine.Sender, r *engine.Receiver) (error, error) {
	t.Helper()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("decode: %s, want Failed", st)
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("prefill: %s, want Failed (decode: %v)", st, r.Failure())
	}
	return s.Failure(), r.Failure()
}

// TestLayerwiseFaultsBetweenLayers: a room whose layers 0-1 landed, then
// (a) the decode aborts, (b) the prefill aborts, (c) the prefill rank is
// lost, (d) the prefill stalls (never sends layers 2-3). Each time both
// sides report Failed with the cause, the decode's Close returns only once
// the producer is fenced, and layers 2-3 of the destination pages were
// never written (no write of a later layer after the abort).
func TestLayerwiseFaultsBetweenLayers(t *testing.T) {
	cases := []struct {
		name           string
		dec            rankOpts
		breakIt        func(t *testing.T, s *engine.Sender, r *engine.Receiver, p *rank)
		sErr, rErr     string
		sendAfterFails bool
	}{
		{name: "decode-abort", breakIt: func(t *testing.T, s *engine.Sender, r *engine.Receiver, p *rank) { r.Abort() },
			sErr: "aborted by decode", rErr: "aborted by the decode caller", sendAfterFails: true},
		{name: "prefill-abort", breakIt: func(t *testing.T, s *engine.Sender, r *engine.Receiver, p *rank) {
			s.AbortWith(errors.New("forward pass failed at layer 2"))
		}, sErr: "forward pass failed at layer 2", rErr: "forward pass failed at layer 2", sendAfterFails: true},
		{name: "prefill-lost", dec: rankOpts{fenceTmo: time.Second}, breakIt: func(t *testing.T, s *engine.Sender, r *engine.Receiver, p *rank) { p.m.Close() },
			sErr: "", rErr: "peer"},
		{name: "prefill-stalls", dec: rankOpts{waiting: 1500 * time.Millisecond}, breakIt: func(t *testing.T, s *engine.Sender, r *engine.Receiver, p *rank) {},
			sErr: "aborted by decode", rErr: "no Success", sendAfterFails: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pre := rankOpts{}
			ctx, s, lr, p, d := lwFault(t, &pre, &c.dec)
			r := lr.recvs[0]
			c.breakIt(t, s, r, p)
			serr, rerr := failedBoth(t, ctx, s, r)
			if c.sErr != "" && !strings.Contains(serr.Error(), c.sErr) {
				t.Errorf("prefill failure %q lacks %q", serr, c.sErr)
			}
			if !strings.Contains(rerr.Error(), c.rErr) {
				t.Errorf("decode failure %q lacks %q", rerr, c.rErr)
			}
			if c.sendAfterFails {
				lay := p.pool.Layout()
				if err := s.SendLayers(nil, lay.EndLayer-1, lay.EndLayer-1, nil); err == nil {
					t.Error("SendLayers after the room failed was accepted")
				}
			}
			closed := make(chan struct{})
			go func() { r.Close(); close(closed) }()
			select {
			case <-closed:
			case <-ctx.Done():
				t.Fatal("decode Close did not return (producer never fenced)")
			}
			select {
			case <-r.Fenced():
			default:
				t.Fatal("decode Close returned before the producer was fenced")
			}
			zeroLayers(t, d, lr.dpages[0], 2, 3)
			t.Logf("prefill: %v\ndecode: %v", serr, rerr)
		})
	}
}

// TestLayerwisePartialRecordRefused: a producer whose record claims one
// layer fewer than it holds (as a room committed before its last layer
// would) is refused on both sides, naming the partial room.
func TestLayerwisePartialRecordRefused(t *testing.T) {
	edit := func(rec []byte) {
		n := binary.LittleEndian.Uint32(rec[engine.RecordLayerCountOffset:])
		binary.LittleEndian.PutUint32(rec[engine.RecordLayerCountOffset:], n-1)
	}
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport { return &recordEditor{Transport: tr, edit: edit} }})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lr := startDecodes(t, addr, []*rank{d}, 31, 5, 0)
	s, _ := sendLayerwise(t, ctx, p, lr, lwPlan{chunkPages: 2}, -1)
	serr, rerr := failedBoth(t, ctx, s, lr.recvs[0])
	if !strings.Contains(rerr.Error(), "covers 3 of its 4 layers") || !strings.Contains(serr.Error(), "partial room") {
		t.Fatalf("prefill: %v\ndecode: %v\nwant both to name the partial room", serr, rerr)
	}
}

// TestLayerwiseMisuse: calls the engine refuses, and whether the refusal
// fails the room (a mistake the decode must learn of) or only the call.
func TestLayerwiseMisuse(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cases := []struct {
		name  string
		do    func(s *engine.Sender, src []int32) error
		want  string
		fails bool
	}{
		{"layer outside the rank", func(s *engine.Sender, src []int32) error { return s.SendLayers(src, 3, 4, nil) }, "this rank holds layers 0…3", false},
		{"reversed range", func(s *engine.Sender, src []int32) error { return s.SendLayers(src, 2, 1, nil) }, "first <= last", false},
		{"page beyond a buffer", func(s *engine.Sender, src []int32) error { return s.SendLayers([]int32{1 << 20}, 0, 0, nil) }, "beyond", false},
		{"layers at different pages", func(s *engine.Sender, src []int32) error {
			if err := s.SendLayers(src[:2], 0, 0, nil); err != nil {
				return err
			}
			return s.SendLayers(src[2:], 0, 1, nil)
		}, "layers 0…1 are at different pages: layer 0 has 2 pages sent, layer 1 has 0", true},
		{"another source page", func(s *engine.Sender, src []int32) error {
			if err := s.SendLayers(src, 0, 0, nil); err != nil {
				return err
			}
			return s.SendLayers(append([]int32{src[1]}, src[1:]...), 1, 1, nil)
		}, "but page", true},
		{"too many pages", func(s *engine.Sender, src []int32) error { return s.SendLayers(append(src, src[0]), 0, 3, nil) }, "pages sent in total, the decode pre-allocated 4", true},
		{"after the last layer", func(s *engine.Sender, src []int32) error {
			if err := s.SendLayers(src, 0, 3, nil); err != nil {
				return err
			}
			return s.SendLayers(nil, 0, 0, nil)
		}, "already sent", false},
	}
	for k, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lr := startDecodes(t, addr, dec, uint64(500+k), 4, 0)
			s, err := pre[0].m.NewSender(lr.room)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
				t.Fatalf("sender %s", st)
			}
			// The decode asks for aux row lr.aux: given here too, so that
			// a call the engine accepts completes the room (without it,
			// the last layer's chunk fails the room, asynchronously, for
			// want of an aux_index, racing the refusal checked here).
			if _, err := s.InitTokens(lr.tokens, lr.aux); err != nil {
				t.Fatal(err)
			}
			src, _ := pre[0].pool.Alloc(4)
			defer pre[0].pool.Free(src)
			err = c.do(s, src)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
			if failed := s.Poll() == engine.KVFailed; failed != c.fails {
				t.Fatalf("sender failed = %v (%v), want %v", failed, s.Failure(), c.fails)
			}
			if c.fails {
				if st := lr.recvs[0].Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(lr.recvs[0].Failure().Error(), c.want) {
					t.Fatalf("decode: %s %v, want Failed naming %q", st, lr.recvs[0].Failure(), c.want)
				}
			}
		})
	}
}

// testEvent is an Event the test completes (or fails) by hand.
type testEvent struct {
	done    atomic.Bool
	err     atomic.Pointer[error]
	queries atomic.Int64
}

func (e *testEvent) Query() (bool, error) {
	e.queries.Add(1)
	if p := e.err.Load(); p != nil {
		return false, *p
	}
	return e.done.Load(), nil
}

// TestLayerwiseEventOrdering: each layer's writes wait for its event.
// While the events are pending nothing of the room is written, however
// long one waits, and the caller never blocks; the KV the "forward pass"
// writes after SendLayers returned but before the event completes is what
// arrives. Two rooms wait for the same events (a batch), both complete. An
// event that fails fails the room on both sides with its error.
func TestLayerwiseEventOrdering(t *testing.T) {
	addr, pre, dec := topology(t, smallGQA, 1, 1, 1, false)
	p := pre[0]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	evs := make([]*testEvent, 4)
	for i := range evs {
		evs[i] = &testEvent{}
	}
	type side struct {
		lr  *lwRoom
		s   *engine.Sender
		src []int32
	}
	var rooms []side
	for _, room := range []uint64{61, 62} {
		lr := startDecodes(t, addr, dec, room, 5, 0)
		s, err := p.m.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("sender %s", st)
		}
		n, err := s.InitTokens(lr.tokens, lr.aux)
		if err != nil {
			t.Fatal(err)
		}
		src, _ := p.pool.Alloc(n)
		defer p.pool.Free(src)
		if err := workload.FillAux(p.pool, room, lr.aux); err != nil {
			t.Fatal(err)
		}
		for l := 0; l < 4; l++ {
			if err := s.SendLayers(src, l, l, evs[l]); err != nil {
				t.Fatal(err)
			}
		}
		rooms = append(rooms, side{lr, s, src})
	}
	fctx, fcancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := rooms[0].s.Flush(fctx)
	fcancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Flush while every event is pending = %v, want the deadline", err)
	}
	for _, r := range rooms {
		if r.s.BytesSent() != 0 || r.lr.recvs[0].Poll() != engine.KVTransferring {
			t.Fatalf("room %d: %d bytes written before any event completed (decode %s)", r.lr.room, r.s.BytesSent(), r.lr.recvs[0].Poll())
		}
	}
	for l := 0; l < 4; l++ { // the forward pass reaches layer l
		for _, r := range rooms {
			if err := workload.FillPatternLayers(p.pool, r.lr.room, r.src, 0, l, l); err != nil {
				t.Fatal(err)
			}
		}
		evs[l].done.Store(true)
	}
	for _, r := range rooms {
		r.lr.verifyDecodes(t, ctx, dec)
		if st := r.s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Fatalf("sender: %s %v", st, r.s.Failure())
		}
	}
	t.Logf("event queries: %d, %d, %d, %d (two rooms share each event's poller)", evs[0].queries.Load(), evs[1].queries.Load(), evs[2].queries.Load(), evs[3].queries.Load())

	t.Run("event-fails", func(t *testing.T) {
		lr := startDecodes(t, addr, dec, 63, 3, 0)
		bad := &testEvent{}
		s, src := sendLayerwise(t, ctx, p, lr, lwPlan{}, 1) // layer 0 without an event
		e := fmt.Errorf("cuda: cudaEventQuery: an illegal memory access was encountered (runtime error 700)")
		bad.err.Store(&e)
		if err := s.SendLayers(src, 1, 1, bad); err != nil {
			t.Fatal(err)
		}
		serr, rerr := failedBoth(t, ctx, s, lr.recvs[0])
		for _, err := range []error{serr, rerr} {
			if !strings.Contains(err.Error(), "illegal memory access") || !strings.Contains(err.Error(), "layers 1…1") {
				t.Errorf("failure %q does not name the event's layers and error", err)
			}
		}
	})
}
