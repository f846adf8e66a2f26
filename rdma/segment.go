package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/ibverbs"
)

// sqp is one sender QP of a segment.
type sqp struct {
	qp      *ibverbs.QP
	dev     *device
	di      int    // index of dev in Transport.devs
	rdev    string // remote device name (selects rkeys)
	cq      *ibverbs.CQ
	credits int
	pending []slice
}

// slice is one RDMA WRITE WR (RDMA READ WR for a read batch).
type slice struct {
	local  uintptr
	lkey   uint32
	raddr  uint64
	rkey   uint32
	length uint32
	b      *batch
}

type batch struct {
	id       transport.BatchID
	read     bool // a read batch: RDMA READ WRs into local memory
	total    uint64
	done     uint64
	inflight int
	queued   int
	state    transport.BatchState
	err      error
	canceled bool
	doneCh   chan struct{}
}

// chain is one posted WR chain: consecutive WRITEs of one batch on one QP,
// posted with one ibv_post_send (one doorbell), of which only the last is
// signaled. Its WR IDs are chainID<<chainIDShift | index in the chain.
type chain struct {
	b      *batch // nil while the slot is free
	qi     int
	wrs    int    // WRs in the chain: send-queue credits it holds
	bytes  uint64 // payload of the chain
	failed bool   // a WR of the chain completed in error
}

// postStats counts what the pump posted.
type postStats struct {
	chains, wrs uint64
}

// chainIDShift splits a WR ID into chain slot (high bits) and the WR's
// index in its chain (low bits).
const chainIDShift = 16

// chainLen returns the most WRs one chain may hold for a send queue of
// sqDepth WRs: a quarter of it (so up to four chains per QP are in flight
// and the next is posted while earlier ones complete), at least 1, at most
// 1<<chainIDShift.
func chainLen(sqDepth int) int {
	return min(max(1, sqDepth/4), 1<<chainIDShift)
}

// Interfaces a segment implements (checked at compile time).
var (
	_ transport.Segment     = (*segment)(nil)
	_ transport.RegionAdder = (*segment)(nil)
)

// segment is a sender's RC QPs to one receiver, striping each batch across
// them in slices. One pump goroutine posts WRs and polls the CQs.
type segment struct {
	t       *Transport
	peer    string
	reply   []byte
	qps     []*sqp
	cqs     []*ibverbs.CQ
	regions map[transport.RegionID]remoteRegion
	// events (RDMAOptions.CQPoll false): one completion channel per CQ, watched by a notifier
	// that signals cqev; the pump arms the CQs and sleeps on cqev.
	chans []*ibverbs.CompChannel
	notes []*cqNotifier
	cqev  chan struct{}

	mu      sync.Mutex
	closed  bool
	broken  error
	batches map[transport.BatchID]*batch
	nextID  transport.BatchID
	slots   []chain // chain slots, indexed by chain ID
	free    []uint64
	rr      int
	posted  postStats // chains and WRs posted (tests check chaining)
	wake    chan struct{}
	stopped chan struct{}
}

type remoteRegion struct {
	desc transport.RegionDesc
	key  regionKey
}

// OpenSegment connects to the receiver described by info.Endpoint: one QP
// per remote QP, spread over the local devices, each moved to RTS. The
// receiver must then Accept(HandshakeReply()).
func (t *Transport) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	h, err := decodeHandshake(info.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("rdma: open segment: %w", err)
	}
	s := &segment{t: t, peer: h.QPs[0].GID, regions: map[transport.RegionID]remoteRegion{},
		batches: map[transport.BatchID]*batch{}, wake: make(chan struct{}, 1), cqev: make(chan struct{}, 1), stopped: make(chan struct{})}
	for _, rd := range info.Regions {
		k, err := decodeRegionKey(rd.Key)
		if err != nil {
			return nil, fmt.Errorf("rdma: open segment to %s: region %d: %w", s.peer, rd.ID, err)
		}
		if transport.RegionID(k.ID) != rd.ID {
			// Keep it out of the table: writes to it fail with ErrUnknownRegion.
			continue
		}
		s.regions[rd.ID] = remoteRegion{desc: rd, key: k}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, fmt.Errorf("rdma: open segment: %w", transport.ErrClosed)
	}
	cqByDev := map[int]*ibverbs.CQ{}
	var replies []qpInfo
	fail := func(d *device, stage string, err error) (transport.Segment, error) {
		s.destroy()
		return nil, fmt.Errorf("rdma: %s -> peer %s: open segment: %s: %w", d.name, s.peer, stage, regHint(err, transport.MemoryHost))
	}
	perDev := (len(h.QPs) + len(t.devs) - 1) / len(t.devs)
	for i, rq := range h.QPs {
		di := i % len(t.devs)
		d := t.devs[di]
		cq := cqByDev[di]
		if cq == nil {
			var ch *ibverbs.CompChannel
			if t.cfg.cqEvents {
				if ch, err = d.ctx.CreateCompChannel(); err != nil {
					return fail(d, "create completion channel (set transport.RDMAOptions.CQPoll to poll instead)", err)
				}
				s.chans = append(s.chans, ch)
			}
			if cq, err = d.ctx.CreateCQ(t.cfg.sqDepth*perDev+16, ch); err != nil {
				return fail(d, "create CQ", err)
			}
			cqByDev[di] = cq
			s.cqs = append(s.cqs, cq)
			if ch != nil {
				n, err := newCQNotifier(ch, s.cqev)
				if err != nil {
					return fail(d, "watch completion channel (set transport.RDMAOptions.CQPoll to poll instead)", err)
				}
				s.notes = append(s.notes, n)
			}
		}
		qp, err := d.pd.CreateQP(ibverbs.QPInitAttr{SendCQ: cq, RecvCQ: cq, MaxSendWR: t.cfg.sqDepth, MaxRecvWR: 1, MaxSendSGE: 1, MaxRecvSGE: 1})
		if err != nil {
			return fail(d, "create QP", err)
		}
		s.qps = append(s.qps, &sqp{qp: qp, dev: d, di: di, rdev: rq.Dev, cq: cq, credits: t.cfg.sqDepth})
		if err := qp.ToInit(d.port, mrAccess); err != nil {
			return fail(d, "QP to INIT", err)
		}
		li := d.info(qp.QPN(), randPSN())
		if err := connectQP(qp, d, li, rq, true, t.cfg); err != nil {
			return fail(d, fmt.Sprintf("connect QP %d to remote QP %d", qp.QPN(), rq.QPN), err)
		}
		replies = append(replies, li)
	}
	s.reply = encodeHandshake(handshake{QPs: replies})
	n := t.cfg.sqDepth * len(s.qps) // at most one chain per WR in flight
	s.slots = make([]chain, n)
	s.free = make([]uint64, n)
	for i := range s.free {
		s.free[i] = uint64(n - 1 - i)
	}
	t.segs[s] = struct{}{}
	go s.pump()
	return s, nil
}

func (s *segment) destroy() {
	for _, n := range s.notes {
		n.close()
	}
	for _, q := range s.qps {
		_ = q.qp.Close()
	}
	for _, cq := range s.cqs {
		_ = cq.Close()
	}
	for _, ch := range s.chans {
		_ = ch.Close()
	}
}

// HandshakeReply returns the sender QPs' info for the receiver's Accept.
func (s *segment) HandshakeReply() []byte { return s.reply }

// AddRegions adds receiver regions registered after the segment was opened
// (transport.RegionAdder): their rkeys come from the descriptor's keys.
// Regions already known are kept; a key that does not decode is an error
// and nothing is added.
func (s *segment) AddRegions(regions []transport.RegionDesc) error {
	add := map[transport.RegionID]remoteRegion{}
	for _, rd := range regions {
		k, err := decodeRegionKey(rd.Key)
		if err != nil {
			return fmt.Errorf("rdma: add region %d to segment to %s: %w", rd.ID, s.peer, err)
		}
		if transport.RegionID(k.ID) != rd.ID {
			continue // as in OpenSegment: writes to it fail with ErrUnknownRegion
		}
		add[rd.ID] = remoteRegion{desc: rd, key: k}
	}
	s.t.mu.Lock() // Submit reads s.regions under t.mu
	defer s.t.mu.Unlock()
	for id, r := range add {
		if _, ok := s.regions[id]; !ok {
			s.regions[id] = r
		}
	}
	return nil
}

// Submit validates b, cuts every block into slices of at most RDMAOptions.SliceSize
// bytes that never cross an MR boundary on either side, stripes them
// round-robin over the segment's QPs (and so over NICs), and queues them for
// the pump. The batch completes when every WRITE has been acknowledged by
// the receiver's NIC (RC ACK: the bytes are placed in its memory); so a
// caller that writes its metadata record in a later batch, after this one
// completed, commits it only after all KV writes landed.
//
// A read batch (transport.OpRead) is cut and striped the same way into
// RDMA READ work requests on the same QPs: the receiver's NIC serves them
// from its MRs (registered with remote read access) within the rkeys'
// bounds, and refuses a deregistered region (remote access error, the QP
// moves to ERR, the batch fails with ErrOutOfBounds/ErrUnknownRegion) or a
// fenced epoch (its QPs are destroyed: no response, ErrPeerLost). The batch
// completes when every READ's response has been placed in local memory.
func (s *segment) Submit(ctx context.Context, b *transport.TransferBatch) (transport.BatchID, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if err := transport.CheckBatch("rdma", s.t.Capabilities(), b); err != nil {
		return 0, err
	}
	t := s.t
	t.mu.Lock()
	// Validate everything first: nothing is queued on error.
	for i, r := range b.Requests {
		rr, ok := s.regions[r.Remote]
		if !ok {
			t.mu.Unlock()
			return 0, fmt.Errorf("rdma: request %d: remote region %d: %w", i, r.Remote, transport.ErrUnknownRegion)
		}
		if r.Length == 0 {
			continue
		}
		for k := uint64(0); k < r.Blocks(); k++ {
			ro := r.RemoteOffset + k*r.RemoteStride
			la := r.Local + uintptr(k*r.LocalStride)
			if ro+r.Length < ro || ro+r.Length > rr.desc.Length {
				t.mu.Unlock()
				return 0, fmt.Errorf("rdma: request %d block %d: %s of remote %d+%d outside region %d (%d bytes): %w", i, k, b.Op, ro, r.Length, r.Remote, rr.desc.Length, transport.ErrOutOfBounds)
			}
			for _, q := range s.qps {
				if ext := rr.key.extent(q.rdev); ro+r.Length > ext {
					t.mu.Unlock()
					return 0, fmt.Errorf("rdma: request %d block %d: remote %d+%d outside the %d bytes region %d has registered on %s: %w", i, k, ro, r.Length, ext, r.Remote, q.rdev, transport.ErrOutOfBounds)
				}
			}
			if _, _, ok := t.localLKey(0, la, r.Length); !ok {
				t.mu.Unlock()
				return 0, fmt.Errorf("rdma: request %d block %d: local %#x+%d is not inside a registered region: %w", i, k, la, r.Length, transport.ErrOutOfBounds)
			}
		}
	}
	s.mu.Lock()
	if s.closed || s.broken != nil {
		err := s.broken
		if s.closed {
			err = transport.ErrClosed
		}
		s.mu.Unlock()
		t.mu.Unlock()
		return 0, fmt.Errorf("rdma: submit to peer %s: segment unusable: %w", s.peer, err)
	}
	s.nextID++
	bt := &batch{id: s.nextID, total: b.Bytes(), read: b.Op == transport.OpRead, doneCh: make(chan struct{})}
	s.batches[bt.id] = bt
	sliceMax := t.cfg.sliceSize
	for _, r := range b.Requests {
		rr := s.regions[r.Remote]
		for k := uint64(0); k < r.Blocks() && r.Length > 0; k++ {
			ro := r.RemoteOffset + k*r.RemoteStride
			la := r.Local + uintptr(k*r.LocalStride)
			for left := r.Length; left > 0; {
				q := s.qps[s.rr%len(s.qps)]
				s.rr++
				lkey, lroom, _ := t.localLKey(q.di, la, left)
				n := min(left, sliceMax, lroom)
				var rkey uint32
				for _, c := range rr.key.chunks(q.rdev) {
					if ro >= c.Off && ro < c.Off+c.Len {
						rkey = c.RKey
						n = min(n, c.Off+c.Len-ro)
						break
					}
				}
				q.pending = append(q.pending, slice{local: la, lkey: lkey, raddr: rr.desc.Addr + ro, rkey: rkey, length: uint32(n), b: bt})
				bt.queued++
				la += uintptr(n)
				ro += n
				left -= n
			}
		}
	}
	if bt.queued == 0 {
		s.finish(bt, transport.BatchCompleted, nil)
	}
	s.mu.Unlock()
	t.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return bt.id, nil
}

// stats returns what the pump has posted so far.
func (s *segment) stats() postStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.posted
}

// finish makes a batch terminal; s.mu held.
func (s *segment) finish(b *batch, st transport.BatchState, err error) {
	if b.state.Terminal() {
		return
	}
	b.state, b.err = st, err
	close(b.doneCh)
}

// settle finishes b when nothing of it is queued or in flight; s.mu held.
func (s *segment) settle(b *batch) {
	if b.state.Terminal() || b.inflight > 0 || b.queued > 0 {
		return
	}
	switch {
	case b.err != nil:
		s.finish(b, transport.BatchFailed, b.err)
	case b.canceled:
		s.finish(b, transport.BatchCanceled, fmt.Errorf("rdma: batch %d: %w", b.id, transport.ErrCanceled))
	default:
		s.finish(b, transport.BatchCompleted, nil)
	}
}

// wcErr turns a failed completion into an error naming device, peer and
// stage, wrapping the engine sentinel that fits.
func (s *segment) wcErr(q *sqp, wc *ibverbs.WC, op transport.Op) error {
	base := fmt.Errorf("rdma: %s QP %d -> peer %s: %s completion: %w", q.dev.name, q.qp.QPN(), s.peer, op, wc.Err())
	switch wc.Status {
	case ibverbs.WCRemAccessErr, ibverbs.WCRemInvReqErr:
		return fmt.Errorf("%w (receiver NIC refused the %s: region deregistered or %s out of its bounds): %w; %w", base, op, op, transport.ErrOutOfBounds, transport.ErrUnknownRegion)
	case ibverbs.WCRetryExcErr, ibverbs.WCRNRRetryExcErr, ibverbs.WCRespTimeoutErr:
		return fmt.Errorf("%w (no ACK from the receiver: it closed, died or is unreachable): %w", base, transport.ErrPeerLost)
	case ibverbs.WCLocProtErr:
		return fmt.Errorf("%w (local buffer not covered by its MR)", base)
	}
	return base
}

// pump posts queued slices within each QP's credits and polls completions
// until the segment closes. Each QP's slices go out as chains (see chain):
// a chain ends at a batch boundary, at chainLen WRs or when the QP's
// credits (free send-queue entries) run out, so small writes cost one
// doorbell and one completion per chain, not per write, and the WRs in
// flight per QP never exceed RDMAOptions.SQDepth.
func (s *segment) pump() {
	defer close(s.stopped)
	maxChain := chainLen(s.t.cfg.sqDepth)
	wrs := make([]ibverbs.SendWR, maxChain)
	wcs := make([]ibverbs.WC, 64)
	idle := 0
	lastProgress := time.Now()
	events, armed := len(s.notes) > 0, false
	wait := time.NewTimer(time.Hour)
	defer wait.Stop()
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return
		}
		work := false
		for qi, q := range s.qps {
			for q.credits > 0 && len(q.pending) > 0 && s.broken == nil {
				if s.postChain(qi, q, wrs[:min(maxChain, q.credits)]) {
					work = true
				}
			}
		}
		inflight := len(s.free) < len(s.slots)
		if !inflight {
			lastProgress = time.Now()
		}
		queued := false
		for _, q := range s.qps {
			queued = queued || len(q.pending) > 0
		}
		s.mu.Unlock()

		for ci, cq := range s.cqs {
			for {
				n, err := cq.Poll(wcs)
				if err != nil {
					// ibv_poll_cq itself failed (CQ overrun, device
					// fatal): its completions cannot be trusted.
					s.fail(fmt.Errorf("rdma: %s -> peer %s: poll CQ %d: %w (device error or CQ overrun; the segment is unusable, open a new one)",
						s.qps[0].dev.name, s.peer, ci, err))
					work = true
					break
				}
				if n == 0 {
					break
				}
				work = true
				s.mu.Lock()
				for i := 0; i < n; i++ {
					s.complete(&wcs[i])
				}
				if s.broken != nil { // a QP in ERR flushes the rest: fail queued work now
					s.dropQueued()
				}
				s.mu.Unlock()
			}
		}
		if work {
			idle = 0
			lastProgress = time.Now()
			continue
		}
		if inflight && time.Since(lastProgress) > s.t.cfg.stall {
			s.stalled()
			lastProgress = time.Now()
		}
		if !inflight && !queued {
			idle = 0
			select {
			case <-s.wake:
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		if events && idle >= pollBeforeSleep {
			// Completions pending for a while: arm every CQ, poll once
			// more (a completion that came before the arm raises no
			// event), then sleep until an event, new work or the stall
			// deadline.
			if !armed {
				for ci, cq := range s.cqs {
					if err := cq.ReqNotify(false); err != nil {
						s.fail(fmt.Errorf("rdma: %s -> peer %s: arm CQ %d (ibv_req_notify_cq): %w", s.qps[0].dev.name, s.peer, ci, err))
					}
				}
				armed = true
				continue
			}
			wait.Reset(max(time.Until(lastProgress.Add(s.t.cfg.stall)), 10*time.Millisecond))
			select {
			case <-s.cqev:
				armed = false
			case <-s.wake:
			case <-wait.C:
				if err := s.notifierDied(); err != nil {
					s.t.cfg.log.Warn("rdma: completion channel stopped; polling the CQs instead", "peer", s.peer, "err", err)
					events = false
				}
			}
			if !wait.Stop() {
				select {
				case <-wait.C:
				default:
				}
			}
			continue
		}
		// Completions pending: back off from 20 us to 1 ms between
		// polls (CQPoll: for good; events: pollBeforeSleep times,
		// about 200 us, so a quick completion costs no event round trip).
		idle++
		time.Sleep(time.Duration(min(20*idle, 1000)) * time.Microsecond)
	}
}

// pollBeforeSleep is how many backoff polls (20, 40, 60, 80 us) the pump
// makes with completions pending before it arms the CQs and sleeps on the
// completion channel (CQPoll false).
const pollBeforeSleep = 4

// notifierDied returns why a completion-channel notifier stopped, or nil if
// all run.
func (s *segment) notifierDied() error {
	for _, n := range s.notes {
		select {
		case <-n.done:
			if n.err != nil {
				return n.err
			}
			return errors.New("completion channel watcher exited")
		default:
		}
	}
	return nil
}

// postChain takes up to len(wrs) queued slices of one batch from q (skipping
// those of canceled or failed batches), posts them as one chain with only
// the last WR signaled, and reports whether it took anything. s.mu held.
func (s *segment) postChain(qi int, q *sqp, wrs []ibverbs.SendWR) bool {
	var b *batch
	n := 0
	took := false
	var bytes uint64
	for n < len(wrs) && len(q.pending) > 0 {
		sl := q.pending[0]
		if b != nil && sl.b != b {
			break // a chain never spans batches: each batch gets its own completion
		}
		q.pending[0] = slice{}
		q.pending = q.pending[1:]
		sl.b.queued--
		took = true
		if sl.b.canceled || sl.b.err != nil {
			s.settle(sl.b)
			continue
		}
		b = sl.b
		opcode := ibverbs.OpRDMAWrite
		if b.read {
			opcode = ibverbs.OpRDMARead
		}
		wrs[n] = ibverbs.SendWR{Opcode: opcode, Addr: sl.local, Length: sl.length, LKey: sl.lkey, RemoteAddr: sl.raddr, RKey: sl.rkey}
		bytes += uint64(sl.length)
		n++
	}
	if n == 0 {
		return took
	}
	id := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	s.slots[id] = chain{b: b, qi: qi, wrs: n, bytes: bytes}
	for i := range wrs[:n] {
		wrs[i].ID = id<<chainIDShift | uint64(i)
	}
	wrs[n-1].Flags = ibverbs.SendSignaled
	b.inflight++
	ok, err := q.qp.PostSend(wrs[:n])
	if err == nil {
		q.credits -= n
		s.posted.chains++
		s.posted.wrs += uint64(n)
		return true
	}
	perr := fmt.Errorf("rdma: %s QP %d -> peer %s: post send of %d WRs: %w", q.dev.name, q.qp.QPN(), s.peer, n, err)
	if ok == 0 { // nothing posted: the batch fails, the QP is intact
		s.slots[id] = chain{}
		s.free = append(s.free, id)
		b.inflight--
		if b.err == nil {
			b.err = perr
		}
		s.settle(b)
		return true
	}
	// Part of the chain was posted without its signaled tail: those WRs
	// will never report completion, so the QP's accounting is lost.
	s.failLocked(fmt.Errorf("%w (%d of them posted; the segment is unusable, open a new one)", perr, ok))
	return true
}

// complete accounts for one work completion. s.mu held.
func (s *segment) complete(wc *ibverbs.WC) {
	id, idx := wc.WRID>>chainIDShift, int(wc.WRID&(1<<chainIDShift-1))
	if id >= uint64(len(s.slots)) || s.slots[id].b == nil {
		return // a second completion for a retired chain (error then flush)
	}
	c := &s.slots[id]
	q := s.qps[c.qi]
	if e := wc.Err(); e != nil {
		if s.broken == nil {
			op := transport.OpWrite
			if c.b.read {
				op = transport.OpRead
			}
			s.broken = s.wcErr(q, wc, op)
		}
		if c.b.err == nil {
			c.b.err = s.broken
		}
		c.failed = true
		if idx != c.wrs-1 {
			// An unsignaled WR failed; the tail's flush completion
			// retires the chain (or stalled does, if none comes).
			return
		}
	} else if !c.failed {
		c.b.done += c.bytes
	}
	q.credits += c.wrs
	c.b.inflight--
	s.settle(c.b)
	*c = chain{}
	s.free = append(s.free, id)
}

// dropQueued fails every queued (not posted) slice with s.broken. s.mu held.
func (s *segment) dropQueued() {
	for _, q := range s.qps {
		for _, p := range q.pending {
			p.b.queued--
			if p.b.err == nil {
				p.b.err = s.broken
			}
			s.settle(p.b)
		}
		q.pending = nil
	}
}

// fail breaks the segment with err: QPs to ERR, every unfinished batch
// fails now (completions may never come).
func (s *segment) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failLocked(err)
}

// failLocked is fail with s.mu held.
func (s *segment) failLocked(err error) {
	if s.broken == nil {
		s.broken = err
	}
	for _, q := range s.qps {
		_ = q.qp.ToError()
		for _, p := range q.pending {
			p.b.queued--
		}
		q.pending = nil
	}
	for _, b := range s.batches {
		if b.err == nil {
			b.err = s.broken
		}
		s.finish(b, transport.BatchFailed, b.err)
	}
}

// stalled declares the peer lost after RDMAOptions.StallTimeout without completions:
// QPs go to ERR (the driver flushes their WRs) and every unfinished batch
// fails with ErrPeerLost now, not when (or if) the flushes arrive.
func (s *segment) stalled() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failLocked(fmt.Errorf("rdma: %s -> peer %s: no completion for %v with %d WR chains in flight (receiver closed, died or unreachable): %w",
		s.qps[0].dev.name, s.peer, s.t.cfg.stall, len(s.slots)-len(s.free), transport.ErrPeerLost))
}

func (s *segment) get(id transport.BatchID) (*batch, error) {
	b, ok := s.batches[id]
	if !ok {
		return nil, fmt.Errorf("rdma: batch %d: %w", id, transport.ErrUnknownBatch)
	}
	return b, nil
}

// Poll returns the batch's state without blocking.
func (s *segment) Poll(id transport.BatchID) (transport.BatchStatus, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := s.get(id)
	if err != nil {
		return transport.BatchStatus{}, err
	}
	return transport.BatchStatus{State: b.state, BytesDone: b.done, Err: b.err}, nil
}

// Wait blocks until the batch is terminal or ctx ends.
func (s *segment) Wait(ctx context.Context, id transport.BatchID) (transport.BatchStatus, error) {
	s.mu.Lock()
	b, err := s.get(id)
	s.mu.Unlock()
	if err != nil {
		return transport.BatchStatus{}, err
	}
	select {
	case <-b.doneCh:
		return s.Poll(id)
	case <-ctx.Done():
		st, _ := s.Poll(id)
		return st, ctx.Err()
	}
}

// Cancel drops the batch's slices not yet posted; WRs already posted run to
// completion, then the batch ends BatchCanceled.
func (s *segment) Cancel(id transport.BatchID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := s.get(id)
	if err != nil {
		return err
	}
	if b.state.Terminal() {
		return nil
	}
	b.canceled = true
	for _, q := range s.qps {
		kept := q.pending[:0]
		for _, p := range q.pending {
			if p.b == b {
				b.queued--
				continue
			}
			kept = append(kept, p)
		}
		q.pending = kept
	}
	s.settle(b)
	return nil
}

// Release forgets a terminal batch.
func (s *segment) Release(id transport.BatchID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b, ok := s.batches[id]; ok && b.state.Terminal() {
		delete(s.batches, id)
	}
}

// Close stops the pump, fails pending batches with ErrClosed and destroys
// the QPs and CQs; idempotent.
func (s *segment) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	<-s.stopped
	s.mu.Lock()
	for _, b := range s.batches {
		if !b.state.Terminal() {
			s.finish(b, transport.BatchFailed, fmt.Errorf("rdma: segment to peer %s closed: %w", s.peer, transport.ErrClosed))
		}
	}
	s.mu.Unlock()
	s.destroy()
	s.t.mu.Lock()
	delete(s.t.segs, s)
	s.t.mu.Unlock()
	return nil
}
