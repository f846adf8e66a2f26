// Package faulty is a fault-injecting decorator for transport.Transport: it wraps
// a real transport (tcp, shm) and injects deterministic faults at the
// Transport seam so the sender and receiver state machines can be driven
// through every KVPoll state without hardware (STYLE.md rule 19).
//
//	tr, _ := tcp.New(transport.DefaultOptions())
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
//     a checksum catches); for a read batch the first byte its first
//     request read into local memory is complemented (a torn read);
//   - FailRegisterAfter(n): RegisterMemory number n+1, ... fails;
//   - FailInstall(): OpenSegment fails (the segment cannot be installed);
//   - FailWith(err): the engine error the injected failures wrap besides
//     ErrInjected (default transport.ErrPeerLost);
//   - DelayWrites(d): a slow writer: every batch is handed to the wrapped
//     segment only d after its Submit, so its bytes land late (Cancel before
//     then drops it, as a live sender would);
//   - StallAfter(n), or Stall() at any time: a stopped producer: Submit
//     number n+1, ... is held, and Cancel does not release it (a process
//     stopped with SIGSTOP does not process cancellations); Resume() hands
//     every held batch to the wrapped segment, so their bytes land then,
//     stale, unless the receiver fenced the data path;
//   - KillMidBatch(k...): Submit number k hands the first half of its
//     requests to the wrapped segment and then closes it (a producer dying
//     in the middle of a batch): the batch fails, and so does every later
//     batch of that segment.
//
// DropControl builds a filter for engine.ManagerConfig.ControlFault that
// drops control messages (lost on a dropped connection).
//
// Read batches (transport.OpRead) are forwarded like write batches and
// counted with them: every knob above applies to them (a held read copies
// late, a KillMidBatch read reads half its requests, ...).
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

	"github.com/kvxfer/kvxfer/engine/transport"
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
	delayWrites   time.Duration
	stallAfter    int64 // -1 = off
	killMid       map[int64]bool
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

// DelayWrites hands each batch to the wrapped segment d after its Submit:
// the batch's bytes land late (a slow writer). A Cancel before then drops
// the batch (BatchCanceled, nothing written).
func DelayWrites(d time.Duration) Option { return func(c *config) { c.delayWrites = d } }

// StallAfter holds every Submit after the first n until Resume, ignoring
// Cancel (a stopped producer); see Transport.Stall.
func StallAfter(n int) Option { return func(c *config) { c.stallAfter = int64(n) } }

// KillMidBatch makes the listed Submit numbers (1-based) send only the first
// half of their requests and then close the wrapped segment.
func KillMidBatch(submits ...int) Option {
	return func(c *config) {
		for _, k := range submits {
			c.killMid[int64(k)] = true
		}
	}
}

// FailWith sets the engine error injected failures wrap (besides
// ErrInjected); default transport.ErrPeerLost.
func FailWith(err error) Option { return func(c *config) { c.failWith = err } }

// Transport is the decorator. It implements transport.Transport and
// transport.Acceptor (Accept forwards to the wrapped transport, or fails if it
// has no handshake).
type Transport struct {
	inner transport.Transport
	cfg   config

	submits   atomic.Int64
	registers atomic.Int64

	// gate is closed by Resume; Submits held by StallAfter/Stall wait on it.
	gateMu  sync.Mutex
	gate    chan struct{}
	stalled bool

	mu        sync.Mutex
	scratch   *transport.HostBuffer // source of corrupting writes
	scratchID transport.RegionID
	scratchN  int
	local     map[transport.RegionID]transport.Memory // registered through us
}

// Every interface the decorator implements, checked at compile time.
var (
	_ transport.Transport   = (*Transport)(nil)
	_ transport.Acceptor    = (*Transport)(nil)
	_ transport.Fencer      = (*Transport)(nil)
	_ transport.Segment     = (*segment)(nil)
	_ transport.RegionAdder = (*segment)(nil)
)

// Wrap returns inner decorated with the given knobs. With no options it is a
// transparent pass-through.
func Wrap(inner transport.Transport, opts ...Option) *Transport {
	c := config{rejectAfter: -1, failAfter: -1, registerAfter: -1, stallAfter: -1, flip: map[int64]bool{}, corrupt: map[int64]bool{},
		killMid: map[int64]bool{}, failWith: transport.ErrPeerLost}
	for _, o := range opts {
		o(&c)
	}
	return &Transport{inner: inner, cfg: c, local: map[transport.RegionID]transport.Memory{}, gate: make(chan struct{})}
}

// Stall makes every later Submit be held until Resume (a producer stopped
// now); Cancel does not release a held batch.
func (t *Transport) Stall() {
	t.gateMu.Lock()
	defer t.gateMu.Unlock()
	if !t.stalled {
		t.stalled = true
		t.gate = make(chan struct{})
	}
}

// Resume hands every held batch to the wrapped segment (their bytes land
// now, unless the receiver fenced the data path) and stops holding.
func (t *Transport) Resume() {
	t.gateMu.Lock()
	defer t.gateMu.Unlock()
	t.cfg.stallAfter = -1
	if t.stalled {
		t.stalled = false
		close(t.gate)
	}
}

// holdGate returns the channel a Submit numbered n must wait on, or nil.
func (t *Transport) holdGate(n int64) <-chan struct{} {
	t.gateMu.Lock()
	defer t.gateMu.Unlock()
	if !t.stalled && t.cfg.stallAfter >= 0 && n > t.cfg.stallAfter {
		t.stalled = true
		t.gate = make(chan struct{})
	}
	if t.stalled {
		return t.gate
	}
	return nil
}

// Unwrap returns the wrapped transport.
func (t *Transport) Unwrap() transport.Transport { return t.inner }

// Submits returns how many Submit calls the decorator has seen.
func (t *Transport) Submits() int { return int(t.submits.Load()) }

func (t *Transport) injected(format string, args ...any) error {
	return fmt.Errorf("%w (%s): %w", ErrInjected, fmt.Sprintf(format, args...), t.cfg.failWith)
}

// Name returns the wrapped transport's name.
func (t *Transport) Name() string { return t.inner.Name() }

// Capabilities returns the wrapped transport's flags.
func (t *Transport) Capabilities() transport.Caps { return t.inner.Capabilities() }

// RegisterMemory forwards to the wrapped transport unless FailRegisterAfter fires.
func (t *Transport) RegisterMemory(m transport.Memory) (transport.RegionDesc, error) {
	if n := t.registers.Add(1); t.cfg.registerAfter >= 0 && n > t.cfg.registerAfter {
		return transport.RegionDesc{}, t.injected("RegisterMemory call %d after FailRegisterAfter(%d)", n, t.cfg.registerAfter)
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
func (t *Transport) DeregisterMemory(id transport.RegionID) error {
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
	a, ok := t.inner.(transport.Acceptor)
	if !ok {
		return fmt.Errorf("faulty: accept from %s: transport %s has no handshake (no transport.Acceptor)", peer, t.inner.Name())
	}
	return a.Accept(ctx, peer, reply)
}

// AdmitEpoch forwards to the wrapped transport (an error if it cannot fence).
func (t *Transport) AdmitEpoch(peer string, epoch uint64) error {
	f, ok := t.inner.(transport.Fencer)
	if !ok {
		return fmt.Errorf("faulty: admit epoch %d: transport %s cannot fence (no transport.Fencer)", epoch, t.inner.Name())
	}
	return f.AdmitEpoch(peer, epoch)
}

// FenceEpoch forwards to the wrapped transport (an error if it cannot fence).
func (t *Transport) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	f, ok := t.inner.(transport.Fencer)
	if !ok {
		return fmt.Errorf("faulty: fence epoch %d: transport %s cannot fence (no transport.Fencer)", epoch, t.inner.Name())
	}
	return f.FenceEpoch(ctx, peer, epoch)
}

// OpenSegment forwards to the wrapped transport unless FailInstall is set.
func (t *Transport) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	if t.cfg.failInstall {
		return nil, t.injected("OpenSegment to %q with FailInstall", info.Endpoint)
	}
	s, err := t.inner.OpenSegment(ctx, info)
	if err != nil {
		return nil, err
	}
	return &segment{t: t, inner: s, batches: map[transport.BatchID]*fbatch{}, nextID: 1}, nil
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

// checkLocalHost fails unless addr is inside host memory registered
// through the decorator.
func (t *Transport) checkLocalHost(addr uintptr) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.checkLocalHostLocked(addr)
}

// checkLocalHostLocked is checkLocalHost with t.mu held.
func (t *Transport) checkLocalHostLocked(addr uintptr) error {
	for _, m := range t.local {
		if addr >= m.Addr && uint64(addr-m.Addr) < m.Length && m.Kind == transport.MemoryHost {
			return nil
		}
	}
	return t.injected("CorruptData: local address %#x is not host memory registered through the decorator", addr)
}

// corruptRequest builds a 1-byte write that overwrites the first byte of r's
// destination with the complement of its source byte.
func (t *Transport) corruptRequest(r transport.WriteRequest) (transport.WriteRequest, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkLocalHostLocked(r.Local); err != nil {
		return transport.WriteRequest{}, err
	}
	if t.scratch == nil {
		buf, err := transport.AllocHost("faulty-scratch", 4096)
		if err != nil {
			return transport.WriteRequest{}, fmt.Errorf("faulty: CorruptData scratch: %w", err)
		}
		d, err := t.inner.RegisterMemory(buf.Memory())
		if err != nil {
			buf.Close()
			return transport.WriteRequest{}, fmt.Errorf("faulty: CorruptData register scratch: %w", err)
		}
		t.scratch, t.scratchID = buf, d.ID
	}
	addr := r.Local
	b := *(*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr)))
	i := t.scratchN % t.scratch.Len()
	t.scratchN++
	t.scratch.Bytes()[i] = ^b
	return transport.WriteRequest{Local: t.scratch.Addr() + uintptr(i), Remote: r.Remote, RemoteOffset: r.RemoteOffset, Length: 1}, nil
}

type fbatch struct {
	n        int64 // Submit ordinal
	inner    transport.BatchID
	hasInner bool
	// held: the batch waits (DelayWrites, stall) before it is handed to the
	// wrapped segment; forwarded is closed when that is decided (hasInner,
	// or failErr/dropped set). Guarded by segment.mu until then.
	held      bool
	forwarded chan struct{}
	dropped   bool // canceled while delayed: nothing sent
	submitted time.Time
	failErr   error // FailAfter: synthetic failed batch
	total     uint64

	corruptReq  *transport.WriteRequest
	corruptID   transport.BatchID
	corruptSent bool
	corruptErr  error
	// corruptLocal (a read batch's CorruptData): the local byte to
	// complement once the read completed; corruptDone once it was.
	corruptLocal uintptr
	corruptDone  bool
}

type segment struct {
	t     *Transport
	inner transport.Segment

	mu      sync.Mutex
	nextID  transport.BatchID
	batches map[transport.BatchID]*fbatch
}

// HandshakeReply forwards to the wrapped segment.
func (s *segment) HandshakeReply() []byte { return s.inner.HandshakeReply() }

// AddRegions forwards to the wrapped segment (transport.RegionAdder), or fails
// when it cannot add regions.
func (s *segment) AddRegions(regions []transport.RegionDesc) error {
	ra, ok := s.inner.(transport.RegionAdder)
	if !ok {
		return fmt.Errorf("faulty: add regions: transport %s cannot add regions to an open segment", s.t.inner.Name())
	}
	return ra.AddRegions(regions)
}

// Submit applies RejectAfter, FailAfter, KillMidBatch, DelayWrites,
// StallAfter and CorruptData, then forwards.
func (s *segment) Submit(ctx context.Context, b *transport.TransferBatch) (transport.BatchID, error) {
	t := s.t
	n := t.submits.Add(1)
	if t.cfg.rejectAfter >= 0 && n > t.cfg.rejectAfter {
		return 0, t.injected("Submit %d rejected after RejectAfter(%d)", n, t.cfg.rejectAfter)
	}
	fb := &fbatch{n: n, submitted: time.Now(), total: b.Bytes()}
	gate := t.holdGate(n)
	switch {
	case t.cfg.failAfter >= 0 && n > t.cfg.failAfter:
	case t.cfg.killMid[n]:
		half := &transport.TransferBatch{Op: b.Op, Requests: b.Requests[:len(b.Requests)/2]}
		if len(half.Requests) > 0 {
			_, _ = s.inner.Submit(ctx, half)
		}
		_ = s.inner.Close()
		fb.failErr = t.injected("Submit %d: KillMidBatch closed the segment after %d of %d requests", n, len(half.Requests), len(b.Requests))
		return s.add(fb), nil
	case gate != nil || t.cfg.delayWrites > 0:
		fb.held, fb.forwarded = true, make(chan struct{})
		reqs := &transport.TransferBatch{Op: b.Op, Requests: append([]transport.WriteRequest(nil), b.Requests...), LastAfterAll: b.LastAfterAll}
		id := s.add(fb)
		go s.forwardLater(fb, reqs, gate)
		return id, nil
	}
	if t.cfg.failAfter >= 0 && n > t.cfg.failAfter {
		fb.failErr = t.injected("batch of Submit %d failed after FailAfter(%d)", n, t.cfg.failAfter)
	} else {
		if t.cfg.corrupt[n] && len(b.Requests) > 0 && b.Op == transport.OpRead {
			if err := t.checkLocalHost(b.Requests[0].Local); err != nil {
				return 0, err
			}
			fb.corruptLocal = b.Requests[0].Local
		} else if t.cfg.corrupt[n] && len(b.Requests) > 0 {
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
	return s.add(fb), nil
}

// add stores fb under the next ID.
func (s *segment) add(fb *fbatch) transport.BatchID {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.nextID
	s.nextID++
	s.batches[id] = fb
	return id
}

// forwardLater hands a held batch to the wrapped segment once its delay has
// passed and the stall gate (if any) is open. A delayed batch canceled
// meanwhile is dropped; a stalled one is sent anyway (a stopped process
// never saw the cancel).
func (s *segment) forwardLater(fb *fbatch, b *transport.TransferBatch, gate <-chan struct{}) {
	if d := s.t.cfg.delayWrites - time.Since(fb.submitted); d > 0 {
		time.Sleep(d)
	}
	if gate != nil {
		<-gate
	}
	s.mu.Lock()
	drop := fb.dropped
	s.mu.Unlock()
	var id transport.BatchID
	var err error
	if !drop {
		id, err = s.inner.Submit(context.Background(), b)
	}
	s.mu.Lock()
	switch {
	case drop:
	case err != nil:
		fb.failErr = fmt.Errorf("faulty: held batch of Submit %d: %w", fb.n, err)
	default:
		fb.inner, fb.hasInner = id, true
	}
	fb.held = false
	s.mu.Unlock()
	close(fb.forwarded)
}

func (s *segment) get(id transport.BatchID) (*fbatch, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fb, ok := s.batches[id]
	if !ok {
		return nil, fmt.Errorf("faulty: batch %d: %w", id, transport.ErrUnknownBatch)
	}
	return fb, nil
}

// status computes the decorated status; it may submit the corrupting write
// (never blocks on it).
func (s *segment) status(fb *fbatch) (transport.BatchStatus, error) {
	var st transport.BatchStatus
	s.mu.Lock()
	held, dropped, failErr := fb.held, fb.dropped, fb.failErr
	s.mu.Unlock()
	if held {
		return transport.BatchStatus{State: transport.BatchPending}, nil
	}
	if dropped {
		return transport.BatchStatus{State: transport.BatchCanceled, Err: fmt.Errorf("faulty: Submit %d canceled while DelayWrites held it: %w", fb.n, transport.ErrCanceled)}, nil
	}
	if failErr != nil {
		st = transport.BatchStatus{State: transport.BatchFailed, Err: failErr}
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
		return transport.BatchStatus{State: transport.BatchPending, BytesDone: st.BytesDone}, nil
	}
	if fb.corruptLocal != 0 && st.State == transport.BatchCompleted {
		s.mu.Lock()
		if !fb.corruptDone {
			fb.corruptDone = true
			addr := fb.corruptLocal
			p := (*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))) // registered host memory (checked at Submit)
			*p = ^*p
		}
		s.mu.Unlock()
	}
	if fb.corruptReq != nil && st.State == transport.BatchCompleted {
		s.mu.Lock()
		defer s.mu.Unlock()
		if !fb.corruptSent {
			fb.corruptSent = true
			fb.corruptID, fb.corruptErr = s.inner.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{*fb.corruptReq}})
		}
		if fb.corruptErr != nil {
			return transport.BatchStatus{State: transport.BatchFailed, Err: fmt.Errorf("faulty: CorruptData write for Submit %d: %w", fb.n, fb.corruptErr)}, nil
		}
		cst, err := s.inner.Poll(fb.corruptID)
		if err != nil {
			return cst, err
		}
		if !cst.State.Terminal() {
			return transport.BatchStatus{State: transport.BatchPending, BytesDone: st.BytesDone}, nil
		}
		if cst.State != transport.BatchCompleted {
			return transport.BatchStatus{State: transport.BatchFailed, Err: fmt.Errorf("faulty: CorruptData write for Submit %d: %v: %w", fb.n, cst.State, cst.Err)}, nil
		}
	}
	if s.t.cfg.flip[fb.n] {
		switch st.State {
		case transport.BatchCompleted:
			st = transport.BatchStatus{State: transport.BatchFailed, BytesDone: st.BytesDone, Err: s.t.injected("FlipStatus turned Submit %d's completed batch into failed", fb.n)}
		case transport.BatchFailed:
			st = transport.BatchStatus{State: transport.BatchCompleted, BytesDone: fb.total}
		}
	}
	return st, nil
}

// Poll returns the decorated status (Delay, FlipStatus, CorruptData applied).
func (s *segment) Poll(id transport.BatchID) (transport.BatchStatus, error) {
	fb, err := s.get(id)
	if err != nil {
		return transport.BatchStatus{}, err
	}
	return s.status(fb)
}

// Wait waits for the wrapped batch, then for the decorated status to be terminal.
func (s *segment) Wait(ctx context.Context, id transport.BatchID) (transport.BatchStatus, error) {
	fb, err := s.get(id)
	if err != nil {
		return transport.BatchStatus{}, err
	}
	if fb.forwarded != nil {
		select {
		case <-fb.forwarded:
		case <-ctx.Done():
			return transport.BatchStatus{State: transport.BatchPending}, fmt.Errorf("faulty: wait for batch %d: %w", id, ctx.Err())
		}
	}
	s.mu.Lock()
	hasInner := fb.hasInner
	s.mu.Unlock()
	if hasInner {
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
func (s *segment) Cancel(id transport.BatchID) error {
	fb, err := s.get(id)
	if err != nil {
		return err
	}
	s.mu.Lock()
	if fb.held && s.t.cfg.delayWrites > 0 && !s.t.isStalled() {
		fb.dropped = true // DelayWrites: a live slow writer honours it
	}
	hasInner := fb.hasInner
	s.mu.Unlock()
	if hasInner {
		return s.inner.Cancel(fb.inner)
	}
	return nil
}

func (t *Transport) isStalled() bool {
	t.gateMu.Lock()
	defer t.gateMu.Unlock()
	return t.stalled
}

// Release forgets a terminal batch; a batch still pending (including one
// whose status is held back by Delay) is left alone, as transport.Segment says.
func (s *segment) Release(id transport.BatchID) {
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
	s.mu.Lock()
	hasInner := fb.hasInner
	s.mu.Unlock()
	if hasInner {
		s.inner.Release(fb.inner)
	}
	if fb.corruptSent && fb.corruptErr == nil {
		s.inner.Release(fb.corruptID)
	}
}

// Close closes the wrapped segment.
func (s *segment) Close() error { return s.inner.Close() }

// ControlDropper drops a KV manager's outgoing control messages, as a
// dropped connection loses what was queued on it. Plug its Filter into
// engine.ManagerConfig.ControlFault. Safe for concurrent use.
type ControlDropper struct {
	mu      sync.Mutex
	next    map[string]int // message type ("" = any) → messages left to drop
	until   time.Time      // drop everything before this
	dropped map[string]int
}

// DropControl returns a ControlDropper that drops nothing until told to.
func DropControl() *ControlDropper {
	return &ControlDropper{next: map[string]int{}, dropped: map[string]int{}}
}

// DropNext drops the next n messages of type msgType (engine.MsgStatus, …;
// "" for any type).
func (d *ControlDropper) DropNext(msgType string, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.next[msgType] += n
}

// DropFor drops every message for the next dur (a control connection down
// that long).
func (d *ControlDropper) DropFor(dur time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.until = time.Now().Add(dur)
}

// Dropped returns how many messages of msgType ("" = all) were dropped.
func (d *ControlDropper) Dropped(msgType string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if msgType == "" {
		n := 0
		for _, k := range d.dropped {
			n += k
		}
		return n
	}
	return d.dropped[msgType]
}

// Pending returns how many messages of msgType ("" = any type) DropNext
// still has to drop.
func (d *ControlDropper) Pending(msgType string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.next[msgType]
}

// Filter is the engine.ManagerConfig.ControlFault hook: true drops the
// message to peer of type msgType.
func (d *ControlDropper) Filter(peer, msgType string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	drop := time.Now().Before(d.until)
	for _, k := range []string{msgType, ""} {
		if !drop && d.next[k] > 0 {
			d.next[k]--
			drop = true
		}
	}
	if drop {
		d.dropped[msgType]++
	}
	return drop
}
