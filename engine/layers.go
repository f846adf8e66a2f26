package engine

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"
)

// Layer-wise sending (issue 24). A serving engine computes a prompt layer by
// layer (and, with chunked prefill, a chunk of its pages at a time); a
// Sender can write each layer range of each chunk of pages as soon as the
// forward pass has produced it (SendLayers), so that when the last layer is
// computed only that layer is left to move. The room keeps every guarantee
// of a whole-room Send:
//
//   - the metadata record is written once, in the batch of the last layer
//     range's writes, after every earlier batch of the room completed, and
//     committed after that batch; it states the pages and the layers this
//     producer covered (MetaRecord.PageCount, LayerCount), and the decode
//     accepts it only when both are whole, so it never reports Success on a
//     partial room;
//   - chunks are written in the order they were queued; an abort (either
//     side), the loss of the peer or a fence stops the worker before the
//     next chunk's writes and cancels the batch in flight, and ABORT_ACK
//     follows only once no batch of the room is in flight, so no layer is
//     written after the abort is acknowledged and the decode keeps the
//     room's pages quarantined until then (or until the path is fenced);
//   - a chunk may wait for an Event (a CUDA event the caller recorded on its
//     compute stream after the layer's KV write): its writes are posted only
//     once the event completed, and the caller's stream never waits for
//     kvxfer.
//
// Every layer has its own cursor: a call's pages map onto the next
// destination pages of the layers in its range, which must all be at the
// same page, so the caller may go chunk by chunk and layer by layer in
// either order. The source page at each position must be the same for
// every layer (one page table for all layers, as paged KV caches have).

// Event is what the writes of one SendLayers call wait for: typically the
// CUDA event the caller recorded on its compute stream right after it wrote
// that layer range's KV (cuda.EventHandle for a caller's cudaEvent_t, or a
// *cuda.Event). Query reports (true, nil) once the work before the event is
// done, (false, nil) while it is pending, and an error when it never will
// be (the room then fails with it). Query must be safe for concurrent use.
// A comparable Event value (cuda.EventHandle is one) is polled once for all
// the rooms waiting for it.
type Event interface {
	Query() (bool, error)
}

// layerState is a Sender's per-layer progress (guarded by Sender.mu).
type layerState struct {
	// cursor[l] is the pages queued for local layer l (model layer
	// StartLayer+l); touched[l] whether any call named it.
	cursor  []int
	touched []bool
	// src[k] is the source page at position k of the request (-1 before a
	// call covered k); sized to the decode's page count.
	src []int32
	// partial: some call covered fewer than all layers (a layer-wise room).
	partial bool
	chunks  int
}

func (ls *layerState) init(layers, want int) {
	if ls.cursor != nil {
		return
	}
	ls.cursor, ls.touched = make([]int, layers), make([]bool, layers)
	ls.src = make([]int32, max(want, 0))
	for i := range ls.src {
		ls.src[i] = -1
	}
}

// complete reports whether every layer was named and holds want pages
// (want < 0: no real destination, any count).
func (ls *layerState) complete(want int) bool {
	for l, c := range ls.cursor {
		if !ls.touched[l] || (want >= 0 && c != want) {
			return false
		}
	}
	return true
}

// admit checks one call's pages for local layers a…b (model layer =
// local + start) against the progress so far and, when they fit, records
// them. It returns the call's first position, whether it is the room's
// last chunk, and why it does not fit ("" when it does; the room then
// fails). want < 0: no real destination (any page count). whole: Send
// (every layer; last says whether it is the final chunk).
func (ls *layerState) admit(pages []int32, a, b, start, want int, whole, last bool) (at int, commit bool, why string) {
	at = ls.cursor[a]
	for l := a; l <= b; l++ {
		if ls.cursor[l] != at {
			return 0, false, fmt.Sprintf("layers %d…%d are at different pages: layer %d has %d pages sent, layer %d has %d (a call's pages follow the same pages of every layer it names)", a+start, b+start, a+start, at, l+start, ls.cursor[l])
		}
	}
	if want >= 0 && (at+len(pages) > want || (whole && last && at+len(pages) != want)) {
		return 0, false, fmt.Sprintf("%d pages sent in total, the decode pre-allocated %d", at+len(pages), want)
	}
	if want >= 0 {
		for i, pg := range pages {
			if prev := ls.src[at+i]; prev >= 0 && prev != pg {
				return 0, false, fmt.Sprintf("source page %d at position %d for layers %d…%d, but page %d was sent at that position for other layers (every layer of a position comes from the same page)", pg, at+i, a+start, b+start, prev)
			}
		}
		copy(ls.src[at:], pages)
	}
	for l := a; l <= b; l++ {
		ls.cursor[l] += len(pages)
		ls.touched[l] = true
	}
	if b-a+1 < len(ls.cursor) {
		ls.partial = true
	}
	ls.chunks++
	commit = last
	if !whole {
		commit = ls.complete(want)
	}
	return at, commit, ""
}

// chunkQueue is a Sender's queue of chunks for its worker: unbounded, so
// Send and SendLayers never block the caller, with counts for Flush.
type chunkQueue struct {
	mu     sync.Mutex
	items  []chunk
	wake   chan struct{} // capacity 1: the worker has something to pop
	queued int           // chunks pushed
	done   int           // chunks the worker finished writing
	doneCh chan struct{} // closed (and replaced) when done grows
}

func newChunkQueue() chunkQueue {
	return chunkQueue{wake: make(chan struct{}, 1), doneCh: make(chan struct{})}
}

func (q *chunkQueue) push(c chunk) {
	q.mu.Lock()
	q.items = append(q.items, c)
	q.queued++
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// pop returns the oldest chunk, waiting for one; false once ctx ends (an
// ended ctx wins over a queued chunk: nothing is written after an abort).
func (q *chunkQueue) pop(ctx context.Context) (chunk, bool) {
	for {
		if ctx.Err() != nil {
			return chunk{}, false
		}
		q.mu.Lock()
		if len(q.items) > 0 {
			c := q.items[0]
			q.items[0] = chunk{}
			q.items = q.items[1:]
			q.mu.Unlock()
			return c, true
		}
		q.mu.Unlock()
		select {
		case <-ctx.Done():
			return chunk{}, false
		case <-q.wake:
		}
	}
}

// finish counts one chunk written.
func (q *chunkQueue) finish() {
	q.mu.Lock()
	q.done++
	close(q.doneCh)
	q.doneCh = make(chan struct{})
	q.mu.Unlock()
}

// SendLayers queues the KV of model layers firstLayer … lastLayer
// (inclusive; within this rank's layers, [prefill_start_layer,
// prefill_start_layer + layers)) for the source pages given (indices into
// this rank's KV buffers, in request order, after the decode's prefix):
// they map onto the next destination pages of those layers, which must all
// have been sent the same number of pages so far. Call it as the forward
// pass finishes each layer (range) of each chunk, in any order of chunks
// and layers; the source page at each position must be the same for every
// layer. When after is not nil the writes start only once it completes
// (the caller's CUDA event after the layer's KV write). The call that
// completes every page of every layer is the last: the aux row, the state
// slots, the metadata record (PageCount, LayerCount) and STATUS follow it.
// A room whose pages are all held by the decode (or a rank with only dummy
// destinations) still names every layer once, with no pages.
//
// It returns at once (the queue is unbounded). Errors are immediate: a
// state before WaitingForInput, a failed sender, a layer outside this rank,
// a page beyond a buffer, a call after the last; a range whose layers are
// at different pages, more pages than the decode asked for, or a source
// page that differs from the one an earlier layer sent at that position
// also fail the room (the decode is told why). Units: layers are model
// layer indices, pages are page indices.
func (s *Sender) SendLayers(pages []int32, firstLayer, lastLayer int, after Event) error {
	return s.queueChunk("send layers of", pages, firstLayer, lastLayer, after, false, false)
}

// queueChunk validates and queues one chunk for the layers lo … hi
// (model layers, inclusive). whole marks Send (every layer; last says
// whether this is the final chunk); otherwise the chunk that completes
// every layer is the final one.
func (s *Sender) queueChunk(op string, pages []int32, lo, hi int, after Event, whole, last bool) error {
	p, err := s.st.get()
	if p == KVFailed {
		return fmt.Errorf("engine: %s room %d: sender already failed: %w", op, s.room, err)
	}
	if p < KVWaitingForInput {
		return fmt.Errorf("engine: %s room %d: state %s; wait for WaitingForInput (every decode destination known) first", op, s.room, p)
	}
	g := s.m.geo
	if lo > hi || lo < g.StartLayer || hi >= g.EndLayer {
		return fmt.Errorf("engine: %s room %d: layers %d…%d: this rank holds layers %d…%d (prefill_start_layer %d, %d layers); give first <= last within them", op, s.room, lo, hi, g.StartLayer, g.EndLayer-1, g.StartLayer, g.Layers())
	}
	if err := checkPages(pages, g); err != nil {
		return fmt.Errorf("engine: %s room %d: source %w", op, s.room, err)
	}
	s.mu.Lock()
	if s.lastSeen || s.closed {
		s.mu.Unlock()
		if whole {
			return fmt.Errorf("engine: %s room %d: the last chunk was already sent", op, s.room)
		}
		return fmt.Errorf("engine: %s room %d: every page of every layer was already sent (the room is complete)", op, s.room)
	}
	want := -1
	for _, d := range s.dsts {
		if !d.msg.Dummy {
			want = len(d.msg.Pages)
		}
	}
	bad := func(format string, v ...any) error {
		s.mu.Unlock()
		err := fmt.Errorf("engine: %s room %d: %s", op, s.room, fmt.Sprintf(format, v...))
		s.fail(err)
		return err
	}
	if s.numPages >= 0 && want >= 0 && s.numPages != want {
		return bad("Init declared %d pages, the decode pre-allocated %d (after a prefix of %d tokens)", s.numPages, want, s.prefixLocked())
	}
	ls := &s.layers
	ls.init(g.Layers(), want)
	at, commit, why := ls.admit(pages, lo-g.StartLayer, hi-g.StartLayer, g.StartLayer, want, whole, last)
	if why != "" {
		return bad("%s", why)
	}
	if s.started.IsZero() {
		s.started = time.Now()
	}
	s.queued = slices.Min(ls.cursor)
	s.lastSeen = commit
	c := chunk{pages: slices.Clone(pages), offset: at, lo: lo, hi: hi, after: after, last: commit, layerwise: ls.partial, chunks: ls.chunks}
	s.mu.Unlock()
	s.st.advance(KVTransferring)
	s.q.push(c)
	return nil
}

// Flush blocks until every chunk queued (Send, SendLayers) before the call
// has been written to every decode destination, so the caller may reuse
// what those chunks read (vLLM's wait_for_save). It returns nil, the
// sender's failure once it failed, or ctx's error when ctx ends first.
func (s *Sender) Flush(ctx context.Context) error {
	s.q.mu.Lock()
	target := s.q.queued
	s.q.mu.Unlock()
	for {
		st := s.st.waitChan()
		s.q.mu.Lock()
		done, ch := s.q.done, s.q.doneCh
		s.q.mu.Unlock()
		if done >= target {
			return nil
		}
		if p, err := s.st.get(); p == KVFailed {
			return fmt.Errorf("engine: flush room %d: %w", s.room, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("engine: flush room %d: %d of %d chunks written: %w", s.room, done, target, context.Cause(ctx))
		case <-ch:
		case <-st:
		}
	}
}

// Event polling: one goroutine per distinct pending event, shared by every
// room waiting for it (a batch's rooms wait for the same layer's event).
// The first query is immediate; then every 20 µs, backing off to 200 µs, so
// a layer's writes start at most about 200 µs after its event completes.
const (
	eventPollFirst = 20 * time.Microsecond
	eventPollMax   = 200 * time.Microsecond
)

type eventWait struct {
	done    chan struct{}
	err     error
	waiters int // guarded by eventPoller.mu
	// qmu is held by the poller while it decides to query and queries: a
	// waiter that leaves takes it once, so the event is never queried for
	// it after its wait returned (the caller may destroy the event then).
	qmu sync.Mutex
}

type eventPoller struct {
	mu    sync.Mutex
	waits map[Event]*eventWait
}

var events = &eventPoller{waits: map[Event]*eventWait{}}

// wait returns once ev completed (nil), its query failed (that error) or
// ctx ended (ctx's cause). After it returns ev is not queried again on
// this caller's behalf.
func (p *eventPoller) wait(ctx context.Context, ev Event) error {
	if ok, err := ev.Query(); err != nil || ok {
		return err
	}
	if !reflect.TypeOf(ev).Comparable() {
		return pollEvent(ctx, ev)
	}
	p.mu.Lock()
	w := p.waits[ev]
	if w == nil {
		w = &eventWait{done: make(chan struct{})}
		p.waits[ev] = w
		go p.poll(ev, w)
	}
	w.waiters++
	p.mu.Unlock()
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
		p.mu.Lock()
		w.waiters--
		p.mu.Unlock()
		w.qmu.Lock() // a query in flight ends; the next sees one waiter fewer
		w.qmu.Unlock()
		return context.Cause(ctx)
	}
}

// poll queries ev until it completes, fails, or nobody waits any more.
func (p *eventPoller) poll(ev Event, w *eventWait) {
	d := eventPollFirst
	var err error
	for {
		time.Sleep(d)
		d = min(2*d, eventPollMax)
		w.qmu.Lock()
		p.mu.Lock()
		if w.waiters == 0 {
			delete(p.waits, ev)
			p.mu.Unlock()
			w.qmu.Unlock()
			close(w.done)
			return
		}
		p.mu.Unlock()
		var ok bool
		ok, err = ev.Query()
		w.qmu.Unlock()
		if err != nil || ok {
			break
		}
	}
	p.mu.Lock()
	delete(p.waits, ev)
	w.err = err
	close(w.done)
	p.mu.Unlock()
}

// pollEvent queries ev with backoff, in the caller's goroutine, until it
// completes (nil), fails, or ctx ends.
func pollEvent(ctx context.Context, ev Event) error {
	d := eventPollFirst
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-t.C:
		}
		if ok, err := ev.Query(); err != nil || ok {
			return err
		}
		d = min(2*d, eventPollMax)
		t.Reset(d)
	}
}

// coverage turns per-layer page counts into the record's counts: the pages
// every layer holds (the smallest count) and the layers holding all want
// pages.
func coverage(layerPages []int, want int) (pages, layers int) {
	if len(layerPages) == 0 {
		return 0, 0
	}
	pages = slices.Min(layerPages)
	for _, n := range layerPages {
		if n == want {
			layers++
		}
	}
	return pages, layers
}
