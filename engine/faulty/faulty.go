// Package faulty is a fault-injecting decorator for engine.Transport: it wraps
// a real transport (tcp, shm) and injects deterministic faults at the
// Transport seam so the sender and receiver state machines can be driven
// through every KVPoll state without hardware (STYLE.md rule 19).
//
//	tr, _ := tcp.New(engine.DefaultOptions())
//	ft := faulty.Wrap(tr, faulty.FailAfter(3), faulty.Delay(5*time.Millisecond))
//
// Knobs count events of the wrapped transport in call order, 1-based and
// across all of its segments, so a test that submits sequentially knows
// exactly which batch is hit:
//
//   - RejectAfter(n): Submit number n+1, n+2, ... returns an error at once;
//   - FailAfter(n): Submit number n+1, ... is accepted but nothing is sent and
//     the batch ends BatchFailed;
//   - Delay(d): every batch's terminal status becomes visible only d after
//     its Submit (Poll reports pending, Wait blocks);
//   - FlipStatus(k...): the terminal status of Submit number k is flipped:
//     completed becomes failed, failed becomes completed (a transport that
//     lies; the metadata check must catch it);
//   - CorruptData(k...): after batch k lands, the first byte of its first
//     request is overwritten at the receiver with the complement of the
//     source byte, then the batch reports completed (a torn write that only
//     a checksum catches);
//   - FailRegisterAfter(n): RegisterMemory number n+1, ... fails;
//   - FailInstall(): OpenSegment fails (the segment cannot be installed);
//   - FailWith(err): the engine error the injected failures wrap besides
//     ErrInjected (default engine.ErrPeerLost).
//
// Every injected error wraps ErrInjected and the FailWith error, and says
// which knob fired. The decorator is safe for concurrent use; Close closes
// the wrapped transport.
package faulty

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine"
)

// ErrInjected is wrapped by every fault this package injects.
var ErrInjected = errors.New("faulty: injected fault")

type config struct {
	rejectAfter   int64 // -1 = off
	failAfter     int64 // -1 = off
	delay         time.Duration
	flip          map[int64]bool
	corrupt       map[int64]bool
	registerAfter int64 // -1 = off
	failInstall   bool
	failWith      error
}

// Option sets one knob.
type Option func(*config)

// RejectAfter makes Submit fail at once (error, no batch) for every Submit
// after the first n. n = 0 rejects all.
func RejectAfter(n int) Option { return func(c *config) { c.rejectAfter = int64(n) } }

// FailAfter makes every batch after the first n Submits end BatchFailed
// without sending anything. n = 0 fails all.
func FailAfter(n int) Option { return func(c *config) { c.failAfter = int64(n) } }

// Delay hides each batch's terminal status until d after its Submit.
func Delay(d time.Duration) Option { return func(c *config) { c.delay = d } }

// FlipStatus flips the terminal status (completed <-> failed) of the listed
// Submit numbers (1-based).
func FlipStatus(submits ...int) Option {
	return func(c *config) {
		for _, k := range submits {
			c.flip[int64(k)] = true
		}
	}
}

// CorruptData corrupts one landed byte of each listed Submit number
// (1-based): the first byte of the batch's first request, at the receiver.
// Only host source memory is supported; the batch fails otherwise.
func CorruptData(submits ...int) Option {
	return func(c *config) {
		for _, k := range submits {
			c.corrupt[int64(k)] = true
		}
	}
}

// FailRegisterAfter makes RegisterMemory fail after the first n calls.
func FailRegisterAfter(n int) Option { return func(c *config) { c.registerAfter = int64(n) } }

// FailInstall makes every OpenSegment fail.
func FailInstall() Option { return func(c *config) { c.failInstall = true } }

// FailWith sets the engine error injected failures wrap (besides
// ErrInjected); default engine.ErrPeerLost.
func FailWith(err error) Option { return func(c *config) { c.failWith = err } }

// Transport is the decorator. It implements engine.Transport and
// engine.Acceptor (Accept forwards to the wrapped transport, or fails if it
// has no handshake).
type Transport struct {
	inner engine.Transport
	cfg   config

	submits   atomic.Int64
	registers atomic.Int64

	mu        sync.Mutex
	scratch   *engine.HostBuffer // source of corrupting writes
	scratchID engine.RegionID
	scratchN  int
	local     map[engine.RegionID]engine.Memory // registered through us
}

var (
	_ engine.Transport   = (*Transport)(nil)
	_ engine.Acceptor    = (*Transport)(nil)
	_ engine.RegionAdder = (*segment)(nil)
)

// Wrap returns inner decorated with the given knobs. With no options it is a
// transparent pass-through.
func Wrap(inner engine.Transport, opts ...Option) *Transport {
	c := config{rejectAfter: -1, failAfter: -1, registerAfter: -1, flip: map[int64]bool{}, corrupt: map[int64]bool{}, failWith: engine.ErrPeerLost}
	for _, o := range opts {
		o(&c)
	}
	return &Transport{inner: inner, cfg: c, local: map[engine.RegionID]engine.Memory{}}
}

// Unwrap returns the wrapped transport.
func (t *Transport) Unwrap() engine.Transport { return t.inner }

// Submits returns how many Submit calls the decorator has seen.
func (t *Transport) Submits() int { return int(t.submits.Load()) }

func (t *Transport) injected(format string, args ...any) error {
	return fmt.Errorf("%w (%s): %w", ErrInjected, fmt.Sprintf(format, args...), t.cfg.failWith)
}

// Name returns the wrapped transport's name.
func (t *Transport) Name() string { return t.inner.Name() }

// Capabilities returns the wrapped transport's flags.
func (t *Transport) Capabilities() engine.Caps { return t.inner.Capabilities() }

// RegisterMemory forwards to the wrapped transport unless FailRegisterAfter fires.
func (t *Transport) RegisterMemory(m engine.Memory) (engine.RegionDesc, error) {
	if n := t.registers.Add(1); t.cfg.registerAfter >= 0 && n > t.cfg.registerAfter {
		return engine.RegionDesc{}, t.injected("RegisterMemory call %d after FailRegisterAfter(%d)", n, t.cfg.registerAfter)
	}
	d, err := t.inner.RegisterMemory(m)
	if err == nil {
		t.mu.Lock()
		t.local[d.ID] = m
		t.mu.Unlock()
	}
	return d, err
}

// DeregisterMemory forwards to the wrapped transport.
func (t *Transport) DeregisterMemory(id engine.RegionID) error {
	t.mu.Lock()
	delete(t.local, id)
	t.mu.Unlock()
	return t.inner.DeregisterMemory(id)
}

// Endpoint forwards to the wrapped transport.
func (t *Transport) Endpoint(ctx context.Context, peer string) ([]byte, error) {
	return t.inner.Endpoint(ctx, peer)
}

// Accept forwards to the wrapped transport's Accept.
func (t *Transport) Accept(ctx context.Context, peer string, reply []byte) error {
	a, ok := t.inner.(engine.Acceptor)
	if !ok {
		return fmt.Errorf("faulty: accept from %s: transport %s has no handshake (no engine.Acceptor)", peer, t.inner.Name())
	}
	return a.Accept(ctx, peer, reply)
}

// OpenSegment forwards to the wrapped transport unless FailInstall is set.
func (t *Transport) OpenSegment(ctx context.Context, info engine.SegmentInfo) (engine.Segment, error) {
	if t.cfg.failInstall {
		return nil, t.injected("OpenSegment to %q with FailInstall", info.Endpoint)
	}
	s, err := t.inner.OpenSegment(ctx, info)
	if err != nil {
		return nil, err
	}
	return &segment{t: t, inner: s, batches: map[engine.BatchID]*fbatch{}, nextID: 1}, nil
}

// Close closes the wrapped transport and frees the decorator's scratch memory.
func (t *Transport) Close() error {
	err := t.inner.Close()
	t.mu.Lock()
	if t.scratch != nil {
		t.scratch.Close()
		t.scratch = nil
	}
	t.mu.Unlock()
	return err
}

// corruptRequest builds a 1-byte write that overwrites the first byte of r's
// destination with the complement of its source byte.
func (t *Transport) corruptRequest(r engine.WriteRequest) (engine.WriteRequest, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var src *engine.Memory
	for _, m := range t.local {
		if r.Local >= m.Addr && uint64(r.Local-m.Addr) < m.Length {
			m := m
			src = &m
			break
		}
	}
	if src == nil || src.Kind != engine.MemoryHost {
		return engine.WriteRequest{}, t.injected("CorruptData: source %#x is not host memory registered through the decorator", r.Local)
	}
	if t.scratch == nil {
		buf, err := engine.AllocHost("faulty-scratch", 4096)
		if err != nil {
			return engine.WriteRequest{}, fmt.Errorf("faulty: CorruptData scratch: %w", err)
		}
		d, err := t.inner.RegisterMemory(buf.Memory())
		if err != nil {
			buf.Close()
			return engine.WriteRequest{}, fmt.Errorf("faulty: CorruptData register scratch: %w", err)
		}
		t.scratch, t.scratchID = buf, d.ID
	}
	addr := r.Local
	b := *(*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr)))
	i := t.scratchN % t.scratch.Len()
	t.scratchN++
	t.scratch.Bytes()[i] = ^b
	return engine.WriteRequest{Local: t.scratch.Addr() + uintptr(i), Remote: r.Remote, RemoteOffset: r.RemoteOffset, Length: 1}, nil
}

type fbatch struct {
	n         int64 // Submit ordinal
	inner     engine.BatchID
	hasInner  bool
	submitted time.Time
	failErr   error // FailAfter: synthetic failed batch
	total     uint64

	corruptReq  *engine.WriteRequest
	corruptID   engine.BatchID
	corruptSent bool
	corruptErr  error
}

type segment struct {
	t     *Transport
	inner engine.Segment

	mu      sync.Mutex
	nextID  engine.BatchID
	batches map[engine.BatchID]*fbatch
}

// HandshakeReply forwards to the wrapped segment.
func (s *segment) HandshakeReply() []byte { return s.inner.HandshakeReply() }

// AddRegions forwards to the wrapped segment (engine.RegionAdder), or fails
// when it cannot add regions.
func (s *segment) AddRegions(regions []engine.RegionDesc) error {
	ra, ok := s.inner.(engine.RegionAdder)
	if !ok {
		return fmt.Errorf("faulty: add regions: transport %s cannot add regions to an open segment", s.t.inner.Name())
	}
	return ra.AddRegions(regions)
}

// Submit applies RejectAfter, FailAfter and CorruptData, then forwards.
func (s *segment) Submit(ctx context.Context, b *engine.TransferBatch) (engine.BatchID, error) {
	t := s.t
	n := t.submits.Add(1)
	if t.cfg.rejectAfter >= 0 && n > t.cfg.rejectAfter {
		return 0, t.injected("Submit %d rejected after RejectAfter(%d)", n, t.cfg.rejectAfter)
	}
	fb := &fbatch{n: n, submitted: time.Now(), total: b.Bytes()}
	if t.cfg.failAfter >= 0 && n > t.cfg.failAfter {
		fb.failErr = t.injected("batch of Submit %d failed after FailAfter(%d)", n, t.cfg.failAfter)
	} else {
		if t.cfg.corrupt[n] && len(b.Requests) > 0 {
			r, err := t.corruptRequest(b.Requests[0])
			if err != nil {
				return 0, err
			}
			fb.corruptReq = &r
		}
		id, err := s.inner.Submit(ctx, b)
		if err != nil {
			return 0, err
		}
		fb.inner, fb.hasInner = id, true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.nextID
	s.nextID++
	s.batches[id] = fb
	return id, nil
}

func (s *segment) get(id engine.BatchID) (*fbatch, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fb, ok := s.batches[id]
	if !ok {
		return nil, fmt.Errorf("faulty: batch %d: %w", id, engine.ErrUnknownBatch)
	}
	return fb, nil
}

// status computes the decorated status; it may submit the corrupting write
// (never blocks on it).
func (s *segment) status(fb *fbatch) (engine.BatchStatus, error) {
	var st engine.BatchStatus
	if fb.failErr != nil {
		st = engine.BatchStatus{State: engine.BatchFailed, Err: fb.failErr}
	} else {
		var err error
		if st, err = s.inner.Poll(fb.inner); err != nil {
			return st, err
		}
	}
	if !st.State.Terminal() {
		return st, nil
	}
	if d := s.t.cfg.delay; d > 0 && time.Since(fb.submitted) < d {
		return engine.BatchStatus{State: engine.BatchPending, BytesDone: st.BytesDone}, nil
	}
	if fb.corruptReq != nil && st.State == engine.BatchCompleted {
		s.mu.Lock()
		defer s.mu.Unlock()
		if !fb.corruptSent {
			fb.corruptSent = true
			fb.corruptID, fb.corruptErr = s.inner.Submit(context.Background(), &engine.TransferBatch{Requests: []engine.WriteRequest{*fb.corruptReq}})
		}
		if fb.corruptErr != nil {
			return engine.BatchStatus{State: engine.BatchFailed, Err: fmt.Errorf("faulty: CorruptData write for Submit %d: %w", fb.n, fb.corruptErr)}, nil
		}
		cst, err := s.inner.Poll(fb.corruptID)
		if err != nil {
			return cst, err
		}
		if !cst.State.Terminal() {
			return engine.BatchStatus{State: engine.BatchPending, BytesDone: st.BytesDone}, nil
		}
		if cst.State != engine.BatchCompleted {
			return engine.BatchStatus{State: engine.BatchFailed, Err: fmt.Errorf("faulty: CorruptData write for Submit %d: %v: %w", fb.n, cst.State, cst.Err)}, nil
		}
	}
	if s.t.cfg.flip[fb.n] {
		switch st.State {
		case engine.BatchCompleted:
			st = engine.BatchStatus{State: engine.BatchFailed, BytesDone: st.BytesDone, Err: s.t.injected("FlipStatus turned Submit %d's completed batch into failed", fb.n)}
		case engine.BatchFailed:
			st = engine.BatchStatus{State: engine.BatchCompleted, BytesDone: fb.total}
		}
	}
	return st, nil
}

// Poll returns the decorated status (Delay, FlipStatus, CorruptData applied).
func (s *segment) Poll(id engine.BatchID) (engine.BatchStatus, error) {
	fb, err := s.get(id)
	if err != nil {
		return engine.BatchStatus{}, err
	}
	return s.status(fb)
}

// Wait waits for the wrapped batch, then for the decorated status to be terminal.
func (s *segment) Wait(ctx context.Context, id engine.BatchID) (engine.BatchStatus, error) {
	fb, err := s.get(id)
	if err != nil {
		return engine.BatchStatus{}, err
	}
	if fb.hasInner {
		if st, err := s.inner.Wait(ctx, fb.inner); err != nil {
			return st, err
		}
	}
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		st, err := s.status(fb)
		if err != nil || st.State.Terminal() {
			return st, err
		}
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("faulty: wait for batch %d: %w", id, ctx.Err())
		case <-tick.C:
		}
	}
}

// Cancel forwards to the wrapped segment (a FailAfter batch is already failed).
func (s *segment) Cancel(id engine.BatchID) error {
	fb, err := s.get(id)
	if err != nil {
		return err
	}
	if fb.hasInner {
		return s.inner.Cancel(fb.inner)
	}
	return nil
}

// Release forgets a terminal batch; a batch still pending (including one
// whose status is held back by Delay) is left alone, as engine.Segment says.
func (s *segment) Release(id engine.BatchID) {
	fb, err := s.get(id)
	if err != nil {
		return
	}
	if st, err := s.status(fb); err == nil && !st.State.Terminal() {
		return
	}
	s.mu.Lock()
	_, ok := s.batches[id]
	delete(s.batches, id)
	s.mu.Unlock()
	if !ok {
		return
	}
	if fb.hasInner {
		s.inner.Release(fb.inner)
	}
	if fb.corruptSent && fb.corruptErr == nil {
		s.inner.Release(fb.corruptID)
	}
}

// Close closes the wrapped segment.
func (s *segment) Close() error { return s.inner.Close() }
