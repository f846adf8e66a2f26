package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/kvargs"
)

// recvTarget is one prefill rank a Receiver gets KV (or a dummy) from.
type recvTarget struct {
	rank     bootstrap.TargetRank
	endpoint string
	producer int
	geo      *kvargs.Geometry    // the producer's (REGISTER_ACK)
	pairs    []kvargs.BufferPair // its KV buffers → ours
	extras   bool                // it writes the aux row and state slots
	slot     int
	gen      uint64
	epoch    uint64 // registration epoch with this producer
	done     bool   // record verified
	bytes    uint64 // KV bytes its record states (after acceptance)
	sent     bool   // TRANSFER sent (or being sent): the producer may write
	wrote    bool   // the producer reported Success: it writes nothing more
	fenced   bool   // clean ABORT_ACK, or its data path was fenced
	ready    bool   // it computed the request (prefill_complete: its answer to SUBSCRIBE)
	moving   bool   // its registration was evicted; registering again (evictmove.go)
}

// Receiver is the decode side of one request (SGLang's KVReceiver). On
// creation it resolves its producers through the bootstrap server (cached
// per address) and registers with them (Bootstrapping → WaitingForInput);
// Init gives the pre-allocated destination pages and sends TRANSFER to every
// producer (→ Transferring); each producer's Success STATUS is accepted only
// after its metadata record is committed, names this room and (optionally)
// matches the CRC32C of the received bytes; when every real producer is
// accepted the state is Success. When every producer is accepted the decode tells every producer (its
// verdict), so both sides report the same outcome. Any failure sends ABORT to
// every producer; the destination pages and the metadata slot of a failed
// room are not reusable until every producer that got TRANSFER is fenced
// (see Close and Fenced). Safe for concurrent use.
type Receiver struct {
	m    *Manager
	addr string
	room uint64
	// attempt names this receiver of the room to its producers
	// (control.TransferMsg.Attempt; TRANSFER, ABORT and ABORT_ACK carry
	// it), so a late frame of an earlier receiver of the same
	// bootstrap_room is told from this one's.
	attempt uint64
	st      *pollState
	tr      *roomTrace // timeline, metrics, span (timeline.go)

	ctx    context.Context
	cancel context.CancelFunc

	dpRank int // prefill DP rank given by the caller (-1: resolve)

	// sendMu orders each producer's TRANSFER before the room's ABORT to it:
	// run holds it from marking a target sent until its TRANSFER is handed to
	// the control socket, and failLocal's ABORT sends take it first. A
	// prefill that does not hold the room yet serves a TRANSFER arriving
	// after an ABORT as a retry of the room (earlyAbortGrace), so an ABORT
	// that overtook its TRANSFER let the failed attempt write into pages
	// handed back at its clean ABORT_ACK.
	sendMu      sync.Mutex
	mu          sync.Mutex
	pages       []int32
	auxIndex    int
	state       []int32
	prefix      int
	pagesSet    chan struct{}
	resolvedEPs []string // producers looked up so far (told on a resolve failure)
	initDone    bool
	tokens      int // declared token count (0: none)
	transferred bool
	latency     time.Duration
	targets     []*recvTarget
	resolved    bool
	sentAt      time.Time
	// peerFail is a producer's Failed STATUS, recorded synchronously by the
	// control loop so that an accept running concurrently cannot turn the
	// room into Success after it (one outcome).
	peerFail    error
	readyCh     chan struct{} // prefill_complete: closed once every real producer computed the request
	readyOnce   sync.Once
	fenceCh     chan struct{} // closed once every producer is fenced
	fenceOnce   sync.Once
	closeOnce   sync.Once
	closedCh    chan struct{}
	runDone     chan struct{}               // closed when run returns
	gate        func(context.Context) error // SetVerdictGate (nil: none)
	gated       bool                        // succeed ran (the gate runs once)
	remaining   int
	requiredDst int
	closed      bool
	slots       []int
	// progressAt is when the last "room waiting" line was logged (zero:
	// none yet; the first comes ProgressInterval after creation).
	progressAt time.Time
}

// NewReceiver creates the receiver for room (any value in [0, 2^63-1], 0
// included) whose prefill instance registers at bootstrapAddr ("host:port")
// and starts resolving its producers (the prefill DP rank from the bootstrap
// server). It fails at once with ErrRoomActive when a receiver for the room
// is active on this rank.
func (m *Manager) NewReceiver(bootstrapAddr string, room uint64) (*Receiver, error) {
	return m.NewReceiverDP(bootstrapAddr, room, -1)
}

// NewReceiverDP is NewReceiver with the prefill DP rank the router chose
// (SGLang KVReceiver.init(prefill_dp_rank)); prefillDPRank < 0 resolves it
// as NewReceiver does.
func (m *Manager) NewReceiverDP(bootstrapAddr string, room uint64, prefillDPRank int) (*Receiver, error) {
	if m.cfg.Role != RoleDecode {
		return nil, errors.New("engine: NewReceiver on a prefill manager (use NewSender)")
	}
	if room > control.MaxRoom {
		return nil, fmt.Errorf("engine: bootstrap_room %d exceeds 2^63-1", room)
	}
	if bootstrapAddr == "" {
		return nil, errors.New("engine: NewReceiver: bootstrap address is empty (want host:port)")
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Receiver{m: m, addr: bootstrapAddr, room: room, attempt: m.dec.nextAttempt(), dpRank: max(prefillDPRank, -1), st: newPollState(), ctx: ctx, cancel: cancel, pagesSet: make(chan struct{}), auxIndex: -1,
		fenceCh: make(chan struct{}), closedCh: make(chan struct{}), readyCh: make(chan struct{}), runDone: make(chan struct{})}
	r.tr = m.newRoomTrace(room, r.st)
	m.mu.Lock()
	if m.closed || m.closing {
		m.mu.Unlock()
		cancel()
		return nil, ErrManagerClosed
	}
	if old, dup := m.dec.receivers[room]; dup {
		m.mu.Unlock()
		cancel()
		return nil, fmt.Errorf("%w: room %d (receiver): %s", ErrRoomActive, room, old.busyReason())
	}
	m.dec.receivers[room] = r
	r.tr.start()
	m.mu.Unlock()
	go r.run()
	return r, nil
}

// busyReason says why a NewReceiver for r's room is refused and when the
// room becomes usable (ErrRoomActive).
func (r *Receiver) busyReason() string {
	p, err := r.st.get()
	switch {
	case p == KVFailed:
		fenced := false
		select {
		case <-r.fenceCh:
			fenced = true
		default:
		}
		if fenced {
			return fmt.Sprintf("its previous attempt failed (%v) and is concluded; the room is usable once that receiver is closed (Receiver.Close, kvx_kv_close)", err)
		}
		return fmt.Sprintf("its previous attempt failed (%v); its pages stay held until every producer it sent TRANSFER to acknowledged the abort or was fenced (at most the fence timeout, %s), then the room is usable once that receiver is closed", err, r.m.cfg.FenceTimeout)
	case p == KVSuccess:
		return "its previous attempt succeeded; the room is usable once that receiver is closed"
	}
	return fmt.Sprintf("an attempt is in progress (%s); wait for its outcome (a retry of the same bootstrap_room is served once it is closed)", p)
}

// Room returns the receiver's bootstrap_room.
func (r *Receiver) Room() uint64 { return r.room }

// Poll returns the current state.
func (r *Receiver) Poll() KVPoll { p, _ := r.st.get(); return p }

// Failure returns why the receiver failed (nil unless Poll is Failed).
func (r *Receiver) Failure() error { _, err := r.st.get(); return err }

// Wait blocks until the state is at least want (or Failed) or ctx ends, and
// returns the state.
func (r *Receiver) Wait(ctx context.Context, want KVPoll) KVPoll { return waitPoll(ctx, r.st, want) }

// SetTokens declares the request's token count (prompt length, >= 1). It
// travels in TRANSFER and is checked against the token_count of every
// producer's metadata record: a producer that declared another count fails
// the room, naming both (a prefill that declared none is not checked). Call
// it before Init; errors: tokens < 1, or TRANSFER already sent.
func (r *Receiver) SetTokens(tokens int) error {
	if tokens < 1 || tokens > control.MaxTokens {
		return fmt.Errorf("engine: receiver room %d: token count %d, want 1..%d", r.room, tokens, control.MaxTokens)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.transferred {
		return fmt.Errorf("engine: receiver room %d: SetTokens after TRANSFER was sent (call it before Init or SendMetadata)", r.room)
	}
	r.tokens = tokens
	return nil
}

// Init is SendMetadata(pages, -1, nil, 0): the whole prompt's destination
// pages, no aux row, no state, no prefix.
func (r *Receiver) Init(pages []int32) error { return r.SendMetadata(pages, -1, nil, 0) }

// SendMetadata (SGLang send_metadata(kv_indices, aux_index, state_indices,
// decode_prefix_len)) gives the destination pages of the prompt tokens after
// prefixTokens (indices into this rank's KV buffers, in token order; may be
// non-contiguous), the aux row the request's aux data lands in (-1: none),
// the state slots (nil: none) and the prompt tokens this rank already holds
// (whole pages; their pages are not sent), and lets the receiver send
// TRANSFER as soon as its producers are resolved. Errors: a page beyond a
// buffer or given twice (naming its index in pages), an aux index beyond the
// aux buffers, a state index beyond the state buffers or given twice, a
// prefix that is negative or not whole pages, a second call, or the receiver
// already failed.
func (r *Receiver) SendMetadata(pages []int32, auxIndex int, stateIndices []int32, prefixTokens int) error {
	g := r.m.geo
	if err := checkDstPages(pages, g); err != nil {
		return fmt.Errorf("engine: receiver room %d: %w", r.room, err)
	}
	if err := checkAux(auxIndex, g); err != nil {
		return fmt.Errorf("engine: receiver room %d: %w", r.room, err)
	}
	if err := checkState(stateIndices, g); err != nil {
		return fmt.Errorf("engine: receiver room %d: %w", r.room, err)
	}
	if prefixTokens < 0 || prefixTokens%g.PageSize != 0 {
		return fmt.Errorf("engine: receiver room %d: decode_prefix_len %d: want whole pages of %d tokens (>= 0)", r.room, prefixTokens, g.PageSize)
	}
	if p, err := r.st.get(); p == KVFailed {
		return fmt.Errorf("engine: receiver room %d already failed: %w", r.room, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.initDone {
		return fmt.Errorf("engine: receiver room %d: SendMetadata called twice", r.room)
	}
	r.initDone = true
	r.pages = append([]int32(nil), pages...)
	r.auxIndex, r.state, r.prefix = max(auxIndex, -1), slices.Clone(stateIndices), prefixTokens
	close(r.pagesSet)
	return nil
}

// AuxIndex is the aux row given to SendMetadata (-1: none).
func (r *Receiver) AuxIndex() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.auxIndex
}

// AuxRow returns a copy of the request's row of aux buffer i once the
// receiver reached Success (the prefill wrote it after the KV and before its
// metadata record's commit word). Errors: not Success yet, no aux row asked
// for, i out of range, or a failed device copy.
func (r *Receiver) AuxRow(i int) ([]byte, error) {
	if p := r.Poll(); p != KVSuccess {
		return nil, fmt.Errorf("engine: receiver room %d: aux row read in state %s; it is valid at Success", r.room, p)
	}
	aux := r.AuxIndex()
	bufs := r.m.cfg.KV.AuxBuffers
	switch {
	case aux < 0:
		return nil, fmt.Errorf("engine: receiver room %d: no aux row was asked for (SendMetadata aux_index -1)", r.room)
	case i < 0 || i >= len(bufs):
		return nil, fmt.Errorf("engine: receiver room %d: aux buffer %d not in [0, %d)", r.room, i, len(bufs))
	}
	var scratch []byte
	b, err := readMem(bufs[i].Memory, uint64(aux)*bufs[i].ItemLen, bufs[i].ItemLen, &scratch)
	if err != nil {
		return nil, fmt.Errorf("engine: receiver room %d: aux buffer %d row %d: %w", r.room, i, aux, err)
	}
	return slices.Clone(b), nil
}

// TransferMetric returns the room's transfer figures so far: Latency from
// TRANSFER (sent once SendMetadata gave the pages and ring slots are held)
// to Success (0 before), the wait before it (BootstrapWait), the KV bytes
// the producers' records state, aux and state bytes, pages, and the prefix
// and the bytes it saved.
func (r *Receiver) TransferMetric() TransferMetric {
	r.mu.Lock()
	defer r.mu.Unlock()
	mt := TransferMetric{Latency: r.latency, Pages: len(r.pages), PrefixTokens: r.prefix, TransferStart: r.sentAt}
	if !r.sentAt.IsZero() {
		mt.BootstrapWait = r.sentAt.Sub(r.tr.created)
	}
	ps := r.m.geo.PageSize
	prefixPages := uint64(r.prefix / ps)
	for _, t := range r.targets {
		mt.Bytes += t.bytes
		for _, pr := range t.pairs {
			mt.SkippedBytes += prefixPages * pr.PageBytes(ps)
		}
		if t.extras && t.done {
			mt.AuxBytes += r.extrasBytesLocked()
		}
	}
	return mt
}

// extrasBytesLocked is the aux and state bytes one request moves.
func (r *Receiver) extrasBytesLocked() uint64 {
	var n uint64
	if r.auxIndex >= 0 {
		for _, b := range r.m.cfg.KV.AuxBuffers {
			n += b.ItemLen
		}
	}
	for _, b := range r.m.cfg.KV.StateBuffers {
		n += uint64(len(r.state)) * b.ItemLen
	}
	return n
}

func (r *Receiver) run() {
	defer close(r.runDone)
	if err := r.resolve(); err != nil {
		if r.failLocal(err) {
			// Producers already looked up learn the room's outcome now
			// (e.g. a refused registration) instead of at their
			// bootstrap timeout; when none was, they are found as a
			// matching decode would find them.
			r.mu.Lock()
			eps := r.resolvedEPs
			r.mu.Unlock()
			for _, ep := range eps {
				go r.m.sendAbort(ep, r.room, err.Error(), 0, r.attempt)
			}
			// Not when the topology lookup itself failed: no producer
			// was found to tell, and a second lookup of that bootstrap
			// would only fail the same way while outliving the room
			// (it runs for the whole bootstrap timeout).
			var tl topologyLookupError
			if len(eps) == 0 && !errors.As(err, &tl) {
				r.abortUnresolved(err)
			}
		}
		return
	}
	if r.m.prefillComplete() {
		// Nothing is reserved until every producer computed the request.
		if err := r.awaitPrefillComplete(); err != nil {
			r.failLocal(err)
			return
		}
		if r.ctx.Err() != nil {
			return
		}
	}
	r.st.advance(KVWaitingForInput)
	select {
	case <-r.pagesSet:
	case <-r.ctx.Done():
		return
	}
	if err := r.acquireSlots(); err != nil {
		r.failLocal(err)
		return
	}
	r.mu.Lock()
	ts := r.targets
	r.transferred = true
	r.sentAt = time.Now()
	r.mu.Unlock()
	r.st.advance(KVTransferring)
	for _, t := range ts {
		// Mark the producer as told before telling it: a failure from now
		// on waits for it to be fenced, and its ABORT waits for this
		// TRANSFER to be handed to the socket (sendMu).
		r.sendMu.Lock()
		r.mu.Lock()
		if p, _ := r.st.get(); p == KVFailed {
			r.mu.Unlock()
			r.sendMu.Unlock()
			return
		}
		t.sent = true
		msg := r.transferMsgLocked(t)
		r.mu.Unlock()
		err := r.m.send(t.endpoint, msg.Encode(), false)
		r.sendMu.Unlock()
		if err != nil {
			r.failLocal(fmt.Errorf("engine: room %d: TRANSFER to prefill %s: %w", r.room, t.endpoint, err))
			return
		}
		r.tr.note(StepTransfer, t.endpoint, "TRANSFER sent")
	}
	r.mu.Lock()
	left := r.remaining
	r.mu.Unlock()
	if left == 0 {
		r.succeed()
	}
}

// acquireSlots takes one metadata ring slot per real producer, once the
// destination pages are known and before TRANSFER. While every slot is in
// use the room waits for one, first come first served, within the waiting
// timeout (backpressure: more rooms in flight than ring slots queue instead
// of failing, issue 18 case 6); the room stays WaitingForInput meanwhile.
// It returns nil, holding nothing new, when the room failed or was closed
// during the wait (failLocal already told its producers).
func (r *Receiver) acquireSlots() error {
	r.mu.Lock()
	ts := r.targets
	r.mu.Unlock()
	ctx, cancel := context.WithTimeoutCause(r.ctx, r.m.cfg.WaitingTimeout,
		fmt.Errorf("%w: no slot freed within the waiting timeout %s (raise --ring-slots or keep fewer rooms in flight)", ErrTimeout, r.m.cfg.WaitingTimeout))
	defer cancel()
	start := time.Now()
	for _, t := range ts {
		if t.rank.Dummy {
			continue
		}
		slot, gen, err := r.m.dec.ring.AcquireWait(ctx)
		if err != nil {
			if r.ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("engine: room %d: %w", r.room, err)
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			r.m.dec.ring.Release(slot)
			return nil
		}
		t.slot, t.gen = slot, gen
		r.slots = append(r.slots, slot)
		r.mu.Unlock()
	}
	if waited := time.Since(start); waited > 100*time.Millisecond {
		r.tr.note(StepTransfer, "", fmt.Sprintf("waited %s for a metadata ring slot (all %d in use)", waited.Round(time.Millisecond), r.m.dec.ring.Slots()))
		r.tr.log("").Debug("room waited for a metadata ring slot", "waited", waited.Round(time.Millisecond), "ring_slots", r.m.dec.ring.Slots())
	}
	return nil
}

// succeed runs ManagerConfig.VerifyKV, records the latency and moves the
// room to Success (unless a producer's Failed STATUS came first, or it
// already failed), then sends the verdict to every producer.
func (r *Receiver) succeed() {
	r.mu.Lock()
	gate, gated := r.gate, r.gated
	r.gated = true
	r.mu.Unlock()
	if gate == nil {
		r.succeedChecked()
		return
	}
	if gated {
		return // the gate runs once
	}
	r.tr.event(StepVerify, "", "every producer's record verified; waiting for the verdict gate (the held prefix's own rooms)")
	r.m.wg.Add(1)
	go func() {
		defer r.m.wg.Done()
		if err := gate(r.ctx); err != nil {
			r.failLocal(fmt.Errorf("engine: room %d: %w", r.room, err))
			return
		}
		r.succeedChecked()
	}()
}

// SetVerdictGate sets a check that must pass before the decode reports
// Success, to its caller and to its producers (their verdict): it runs
// once, after every producer's record was verified and before
// ManagerConfig.VerifyKV, in its own goroutine, with a context canceled when
// the room fails or is closed; an error fails the room on both sides (ABORT
// naming it). The gate must bound its own wait (the producers keep waiting
// for the verdict meanwhile, up to their waiting timeout). A decode that
// reuses pages another room is still receiving (a held prefix) gates on
// that room's outcome, so both sides of this room report the same. Call it
// before SendMetadata.
func (r *Receiver) SetVerdictGate(gate func(ctx context.Context) error) {
	r.mu.Lock()
	r.gate = gate
	r.mu.Unlock()
}

// succeedChecked runs ManagerConfig.VerifyKV, records the latency and
// moves the room to Success (see succeed).
func (r *Receiver) succeedChecked() {
	if vf := r.m.cfg.VerifyKV; vf != nil {
		r.mu.Lock()
		kv := ReceivedKV{Room: r.room, Pages: r.pages, PrefixTokens: r.prefix, AuxIndex: r.auxIndex}
		r.mu.Unlock()
		if err := vf(kv); err != nil {
			r.failLocal(fmt.Errorf("engine: room %d: KV verification failed: %w", r.room, err))
			return
		}
	}
	r.mu.Lock()
	if r.peerFail != nil {
		err := r.peerFail
		r.mu.Unlock()
		r.failLocal(err)
		return
	}
	if !r.sentAt.IsZero() && r.latency == 0 {
		r.latency = time.Since(r.sentAt)
	}
	ts := append([]*recvTarget(nil), r.targets...)
	// Counted before the decision is visible: a caller that sees Success
	// and closes the manager at once still sends these (verdicts.go). Once
	// Close began it waits for no new verdict: the room fails as closed,
	// on both sides, instead of a Success its producers might never hear
	// of (issue 22 case 1).
	if !r.m.verdictFlight.admit(len(ts)) {
		r.mu.Unlock()
		r.failLocal(fmt.Errorf("%w: room %d: every record was verified while the manager was closing, too late to deliver a Success verdict; the room fails as every room in flight at the close does", ErrManagerClosed, r.room))
		return
	}
	if !r.st.advance(KVSuccess) {
		r.mu.Unlock()
		r.m.verdictFlight.done(len(ts))
		return
	}
	r.mu.Unlock()
	r.m.rememberVerdict(r.room, true, "", r.attempt)
	for _, t := range ts {
		r.m.goVerdict(t.endpoint, r.room, t.epoch, r.attempt)
	}
	r.updateFence()
}

// topologyLookupError is a room's failure to fetch its prefill instance's
// topology (GET /route with all -1) from the bootstrap server: the error it
// wraps, unchanged, marked so that run does not look the same bootstrap up
// again to find producers to ABORT.
type topologyLookupError struct{ error }

func (e topologyLookupError) Unwrap() error { return e.error }

// abortUnresolved tells the producers of a room that failed before any of
// its producers was looked up (a refused pairing: kv_cache_dtype or page
// size mismatch, ...) that the room failed, so that a prefill already
// holding the request fails it now instead of at its bootstrap timeout. Best
// effort: it finds the producers as a matching decode would.
func (r *Receiver) abortUnresolved(cause error) {
	m := r.m
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	inst, err := m.instance(ctx, r.addr)
	if err != nil || inst.info == nil {
		return
	}
	dp, ok := bootstrap.SelectDPRank(*inst.info, r.room)
	if r.dpRank >= 0 {
		dp, ok = r.dpRank, true
	}
	if !ok {
		got, err := inst.client.QueryDPRanks(ctx, []uint64{r.room})
		if err != nil {
			return
		}
		if dp, ok = got[r.room]; !ok {
			return
		}
	}
	g := m.geo
	// Page size and dtype left out (0, ""): not checked, so the refused
	// pairing still yields the producers to tell.
	var coords []bootstrap.Coord
	tg, err := bootstrap.TargetRanks(*inst.info, bootstrap.DecodeRank{AttnTPSize: g.TPSize, AttnTPRank: g.TPRank, AttnCPSize: 1,
		PPSize: g.PPSize, PPRank: g.PPRank, IsMLA: g.MLA}, dp)
	if err == nil {
		for _, tr := range tg.Ranks {
			coords = append(coords, tr.Coord())
		}
	} else {
		// No mapping exists (an unsupported TP or PP pairing): every rank
		// of the DP group may hold the request, so every one is told.
		for cp := range max(inst.info.AttnCPSize, 1) {
			for tp := range max(inst.info.AttnTPSize, 1) {
				for pp := range max(inst.info.PPSize, 1) {
					coords = append(coords, bootstrap.Coord{DP: dp, CP: cp, TP: tp, PP: pp})
				}
			}
		}
	}
	for _, c := range coords {
		ep, err := inst.rank(ctx, c)
		if err != nil {
			continue
		}
		r.tr.event(r.tr.step(), ep, "ABORT sent (refused before the producers were resolved)")
		m.sendAbort(ep, r.room, cause.Error(), 0, r.attempt)
	}
}

// Refuse fails the room for a reason of the decode's own before it gave
// any destination: its KV pool cannot hold the request, or no page came
// free within the waiting timeout. Like every failure it is sticky and
// reaches the producers as ABORT naming the reason, here even when they
// were not resolved yet (the receiver then finds them, as abortUnresolved
// does), so a prefill holding the request fails it at once instead of at its
// bootstrap timeout. It returns at once; a room already terminal is left
// as it is.
func (r *Receiver) Refuse(cause error) {
	r.mu.Lock()
	told := map[string]bool{}
	for _, t := range r.targets {
		told[t.endpoint] = true
	}
	r.mu.Unlock()
	if !r.failLocal(cause) {
		return
	}
	r.m.wg.Add(1)
	go func() {
		defer r.m.wg.Done()
		// The resolution stops at the failure (its context is canceled);
		// what it found by then is told below, the rest looked up.
		select {
		case <-r.runDone:
		case <-r.m.done:
			return
		}
		r.mu.Lock()
		eps := append([]string(nil), r.resolvedEPs...)
		for _, t := range r.targets {
			eps = append(eps, t.endpoint)
		}
		r.mu.Unlock()
		if len(eps) == 0 {
			r.abortUnresolved(cause)
			return
		}
		for _, ep := range eps {
			if !told[ep] {
				told[ep] = true
				r.m.sendAbort(ep, r.room, cause.Error(), 0, r.attempt)
			}
		}
	}()
}

func (r *Receiver) resolve() error {
	m := r.m
	g := m.geo
	ctx, cancel := context.WithTimeout(r.ctx, m.cfg.BootstrapTimeout)
	defer cancel()
	inst, err := m.instance(ctx, r.addr)
	if err != nil {
		return topologyLookupError{fmt.Errorf("engine: room %d: could not fetch prefill parallel info from http://%s: %w", r.room, r.addr, err)}
	}
	dp, ok := bootstrap.SelectDPRank(*inst.info, r.room)
	if r.dpRank >= 0 {
		if r.dpRank >= max(inst.info.DPSize, 1) {
			return fmt.Errorf("engine: room %d: prefill dp rank %d given, but the prefill instance at %s has dp size %d", r.room, r.dpRank, r.addr, inst.info.DPSize)
		}
		dp, ok = r.dpRank, true
	}
	r.tr.note(StepResolveTopology, r.addr, "PrefillServerInfo")
	if err := m.checkAllocationPolicy(r.addr, inst.info); err != nil {
		return fmt.Errorf("engine: room %d: %w", r.room, err)
	}
	if !ok {
		err := retry(ctx, fmt.Sprintf("query the prefill dp rank of room %d at %s", r.room, r.addr), func(ctx context.Context) error {
			got, err := inst.client.QueryDPRanks(ctx, []uint64{r.room})
			if err != nil {
				return err
			}
			d, ok := got[r.room]
			if !ok {
				return fmt.Errorf("room %d not registered yet", r.room)
			}
			dp = d
			return nil
		})
		if err != nil {
			return err
		}
	}
	tg, err := bootstrap.TargetRanks(*inst.info, bootstrap.DecodeRank{AttnTPSize: g.TPSize, AttnTPRank: g.TPRank, AttnCPSize: 1,
		PPSize: g.PPSize, PPRank: g.PPRank, IsMLA: g.MLA, PageSize: g.PageSize, KVCacheDtype: m.cfg.KVCacheDtype}, dp)
	if err == nil {
		err = checkProducersCovered(inst.info.AttnTPSize, g.TPSize)
	}
	if err != nil {
		return fmt.Errorf("engine: room %d: %w", r.room, err)
	}
	r.tr.mark(StepResolveTopology, r.addr, fmt.Sprintf("prefill dp rank %d, %d target ranks", dp, len(tg.Ranks)))
	var ts []*recvTarget
	for _, tr := range tg.Ranks {
		ep, err := inst.rank(ctx, tr.Coord())
		if err != nil {
			return fmt.Errorf("engine: room %d: could not fetch bootstrap info for %s: %w", r.room, tr.Coord(), err)
		}
		ts = append(ts, &recvTarget{rank: tr, endpoint: ep, producer: ProducerRank(tr.TP, inst.info.PPSize, tr.PP)})
		r.tr.peer(StepResolveRank, ep, tr.Coord().String())
		r.mu.Lock()
		r.resolvedEPs = append(r.resolvedEPs, ep)
		r.mu.Unlock()
	}
	real := 0
	for _, t := range ts {
		if !t.rank.Dummy {
			real++
		}
	}
	if real != tg.RequiredPrefillResponseNum {
		return fmt.Errorf("engine: room %d: %d real producers but required_prefill_response_num is %d (unsupported CP layout?)", r.room, real, tg.RequiredPrefillResponseNum)
	}
	r.tr.mark(StepResolveRank, "", "")
	// hg is this rank's geometry with its KV heads known: a decode whose
	// KVArgs stated none (SGLang's) takes them from its producers'
	// REGISTER_ACK geometry, as PairBuffers does on both sides.
	hg, hgFrom := g, ""
	for _, t := range ts {
		var pg *kvargs.Geometry
		for try := 0; ; try++ {
			ep, geo, err := m.ensureRegistered(ctx, t.endpoint, inst.instanceOf(t.endpoint))
			if err != nil {
				return fmt.Errorf("engine: room %d: register with prefill %s: %w", r.room, t.endpoint, err)
			}
			t.epoch, pg = ep, geo
			m.awaitEpochSettled(ctx, r, t.endpoint, ep)
			if try == 2 || !m.epochFencing(t.endpoint, ep) {
				break // a registration being fenced is dropped: register again
			}
		}
		r.tr.peer(StepConnect, t.endpoint, "REGISTER_ACK")
		if t.rank.Dummy {
			continue
		}
		if t.pairs, err = kvargs.PairBuffers(pg, g, t.endpoint, m.endpoint); err != nil {
			return fmt.Errorf("engine: room %d: %w", r.room, err)
		}
		rp, rg, err := kvargs.ResolveHeads(pg, g, t.endpoint, m.endpoint)
		if err != nil {
			return fmt.Errorf("engine: room %d: %w", r.room, err)
		}
		if hgFrom != "" && (rg.KVHeadNum != hg.KVHeadNum || rg.TotalKVHeadNum != hg.TotalKVHeadNum) {
			return fmt.Errorf("engine: room %d: decode %s states no KV head counts, and its producers disagree: prefill %s has %d KV heads (%d per decode rank), prefill %s has %d (%d per decode rank); run every prefill rank with the same model",
				r.room, m.endpoint, hgFrom, hg.TotalKVHeadNum, hg.KVHeadNum, t.endpoint, rg.TotalKVHeadNum, rg.KVHeadNum)
		}
		hg, hgFrom = rg, t.endpoint
		t.geo = rp
	}
	for _, d := range replicaDummies(ts) {
		r.tr.note(StepConnect, d.t.endpoint, fmt.Sprintf("dummy: holds a replica of KV head %d, which prefill tp rank %d writes", d.head, d.writer))
		real--
	}
	r.tr.expectPeers(real)
	var writer *recvTarget // writes the aux row and state: last PP stage, lowest TP rank
	for _, t := range ts {
		if !t.rank.Dummy && t.geo.EndLayer == g.EndLayer && (writer == nil || t.geo.TPRank < writer.geo.TPRank) {
			writer = t
		}
	}
	if writer != nil {
		writer.extras = true
	}
	if err := checkLayerCoverage(g, ts, m.endpoint); err != nil {
		return fmt.Errorf("engine: room %d: %w", r.room, err)
	}
	if err := checkHeadCoverage(hg, ts); err != nil {
		return fmt.Errorf("engine: room %d: %w", r.room, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// Known producers are told when the room fails, even before TRANSFER.
	r.targets = ts
	if r.closed {
		return ErrManagerClosed
	}
	if p, err := r.st.get(); p == KVFailed {
		return err
	}
	r.remaining, r.requiredDst = real, tg.RequiredDstInfoNum
	r.resolved = true
	return nil
}

func (r *Receiver) hasTarget(ep string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range r.targets {
		if t.endpoint == ep {
			return true
		}
	}
	return false
}

// usesEpoch reports whether a producer of this room is (ep, epoch), one
// registering again after that registration's eviction aside.
func (r *Receiver) usesEpoch(ep string, epoch uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range r.targets {
		if t.endpoint == ep && t.epoch == epoch && !t.moving {
			return true
		}
	}
	return false
}

// epochFenced marks the producers on the fenced data path (ep, epoch) fenced.
func (r *Receiver) epochFenced(ep string, epoch uint64) {
	r.mu.Lock()
	hit := false
	for _, t := range r.targets {
		if t.endpoint == ep && t.epoch == epoch {
			t.fenced, hit = true, true
		}
	}
	r.mu.Unlock()
	if hit {
		r.tr.event(StepConsume, ep, fmt.Sprintf("data path (epoch %d) fenced", epoch))
		r.updateFence()
	}
}

// onStatus handles a producer's STATUS for this room. Success, Failed and
// WaitingForInput count only when they name this room's registration epoch
// with the producer (or epoch 0); a Success or Failed of another epoch is
// put on the room's timeline and dropped.
func (r *Receiver) onStatus(v *control.StatusMsg) {
	r.mu.Lock()
	var t *recvTarget
	for _, c := range r.targets {
		if c.endpoint == v.Endpoint {
			t = c
		}
	}
	if t != nil && KVPoll(v.State) == KVSuccess && v.Epoch != 0 && v.Epoch != t.epoch {
		// A Success of another attempt (an earlier registration with this
		// producer, answered late, or one the decode has since replaced):
		// its record, if any, is not this attempt's, and neither checking
		// it (which failed the room) nor answering it with this room's
		// verdict is right. The room waits for its own producer's STATUS.
		epoch := t.epoch
		r.mu.Unlock()
		r.tr.event(r.tr.step(), v.Endpoint, fmt.Sprintf("stale STATUS Success ignored: it names registration epoch %d, this room's registration with prefill rank %d is epoch %d", v.Epoch, v.Producer, epoch))
		r.tr.log(v.Endpoint).Debug("STATUS Success of another registration ignored", "status_epoch", v.Epoch, "epoch", epoch)
		return
	}
	if t != nil && KVPoll(v.State) == KVFailed && t.moving && (v.Epoch == t.epoch || v.Epoch == 0) {
		// The prefill's rejection of this room's TRANSFER over the
		// registration it evicted: the room is registering again
		// (evictmove.go) and its TRANSFER follows over the new one.
		epoch := t.epoch
		r.mu.Unlock()
		r.tr.event(r.tr.step(), v.Endpoint, fmt.Sprintf("STATUS Failed of the evicted registration epoch %d ignored, the room registers again (%s)", epoch, v.Reason))
		return
	}
	if t != nil && KVPoll(v.State) == KVFailed && v.Epoch != 0 && v.Epoch != t.epoch {
		// A rejection of an earlier attempt (an earlier registration with
		// this producer, e.g. before a same-room retry re-registered):
		// like a stale Success (above) it says nothing about this attempt.
		epoch := t.epoch
		r.mu.Unlock()
		r.tr.event(r.tr.step(), v.Endpoint, fmt.Sprintf("stale STATUS Failed ignored: it names registration epoch %d, this room's registration with prefill rank %d is epoch %d (%s)", v.Epoch, v.Producer, epoch, v.Reason))
		r.tr.log(v.Endpoint).Warn("STATUS Failed of an earlier registration ignored", "status_epoch", v.Epoch, "epoch", epoch, "reason", v.Reason)
		return
	}
	p, ferr := r.st.get()
	if t != nil && KVPoll(v.State) == KVSuccess && !t.rank.Dummy && (v.Epoch == t.epoch || v.Epoch == 0) {
		t.wrote = true // it writes nothing more for this room
	}
	if t != nil && KVPoll(v.State) == KVWaitingForInput {
		r.onReadyLocked(t, v.Epoch)
	}
	if t != nil && KVPoll(v.State) == KVFailed && p != KVFailed && r.peerFail == nil {
		reason := v.Reason
		if reason == "" {
			reason = "Failed to get kvcache from prefill instance, it might be dead"
		}
		r.peerFail = peerFailed(fmt.Errorf("engine: room %d: prefill rank %d (%s) reported Failed: %s", r.room, v.Producer, v.Endpoint, reason))
	}
	peerFail := r.peerFail
	r.mu.Unlock()
	if t == nil {
		r.tr.log(v.Endpoint).Warn("STATUS from a prefill that is not a producer of this room")
		return
	}
	switch {
	case p == KVSuccess:
		// It missed the verdict (and may have given up waiting): the
		// decode's Success stands (sent again from a goroutine Close
		// waits for, and re-sent by Close until acknowledged).
		epoch := t.epoch
		r.m.goReanswer(func() { r.m.sendSuccessVerdict(v.Endpoint, r.room, epoch, r.attempt) })
	case p == KVFailed:
		if KVPoll(v.State) == KVSuccess { // it missed the ABORT
			epoch := t.epoch
			r.m.goReanswer(func() { r.m.sendAbort(v.Endpoint, r.room, ferr.Error(), epoch, r.attempt) })
		}
		r.updateFence()
	case KVPoll(v.State) == KVFailed:
		if r.failLocal(peerFail) {
			go r.tellCurrentProducers(v.Endpoint, peerFail) // wrongpeer.go
		}
	case KVPoll(v.State) == KVSuccess && !t.rank.Dummy:
		r.tr.peer(StepTransfer, v.Endpoint, "STATUS Success")
		if r.m.cfg.Checksum || r.m.cfg.VerifyKV != nil {
			// A CRC over the room's bytes, or the caller's check, takes
			// time: off the control loop (Close waits for it before the
			// ring goes).
			r.m.goTracked(func() { r.accept(t, v) })
			return
		}
		// Only the record to check (a few loads and compares): here, so
		// Success is not one goroutine wake-up later than STATUS (issue
		// 24's handover). What it may start (verdicts, the gate) runs on
		// goroutines of its own.
		r.accept(t, v)
	}
}

// accept verifies a producer's metadata record (and checksum) after its
// Success STATUS.
func (r *Receiver) accept(t *recvTarget, v *control.StatusMsg) {
	rec, err := r.m.dec.ring.Read(t.slot)
	if err != nil {
		r.failLocal(fmt.Errorf("engine: room %d: metadata slot %d: %w", r.room, t.slot, err))
		return
	}
	switch {
	case !rec.Committed() || rec.Generation != t.gen:
		r.failLocal(fmt.Errorf("engine: room %d: prefill rank %d reported Success but metadata slot %d is not committed for generation %d (commit word %#x, record generation %d)", r.room, t.producer, t.slot, t.gen, rec.Commit, rec.Generation))
		return
	case rec.Room != r.room:
		r.failLocal(fmt.Errorf("engine: %w: expected bootstrap_room %d, metadata record in slot %d has bootstrap_room %d (producer %d); the KV belongs to another request", ErrRoomMismatch, r.room, t.slot, rec.Room, rec.Producer))
		return
	case int(rec.Producer) != t.producer || v.Producer != t.producer:
		r.failLocal(fmt.Errorf("engine: room %d: metadata slot %d written by producer %d (STATUS from %d), expected producer %d", r.room, t.slot, rec.Producer, v.Producer, t.producer))
		return
	case rec.Epoch != t.epoch || v.Epoch != t.epoch:
		r.failLocal(fmt.Errorf("engine: room %d: metadata slot %d came through data-path epoch %d (STATUS says %d), but the registration with prefill rank %d is epoch %d: a stale writer's record, not this room's", r.room, t.slot, rec.Epoch, v.Epoch, t.producer, t.epoch))
		return
	}
	r.mu.Lock()
	pages := r.pages
	tokens := r.tokens
	r.mu.Unlock()
	if tokens != 0 && rec.TokenCount != 0 && int(rec.TokenCount) != tokens {
		r.failLocal(fmt.Errorf("%w: room %d: prefill rank %d covered %d tokens, the decode expects %d (the same request must reach both sides with the same prompt length)", ErrTokenMismatch, r.room, t.producer, rec.TokenCount, tokens))
		return
	}
	var wantBytes uint64
	for _, pr := range t.pairs {
		wantBytes += uint64(len(pages)) * pr.PageBytes(r.m.geo.PageSize)
	}
	if rec.PageCount != uint32(len(pages)) || rec.ByteCount != wantBytes {
		r.failLocal(fmt.Errorf("engine: room %d: producer %d wrote %d pages / %d bytes, expected %d pages / %d bytes", r.room, t.producer, rec.PageCount, rec.ByteCount, len(pages), wantBytes))
		return
	}
	if layers := t.geo.Layers(); rec.LayerCount != uint32(layers) {
		// A room sent layer by layer commits only after its last layer; a
		// record short of it is a partial room and never a Success.
		r.failLocal(fmt.Errorf("engine: room %d: producer %d's record covers %d of its %d layers (%d…%d): a partial room", r.room, t.producer, rec.LayerCount, layers, t.geo.StartLayer, t.geo.EndLayer-1))
		return
	}
	if r.m.cfg.Checksum {
		if !rec.HasChecksum() {
			r.failLocal(fmt.Errorf("%w: room %d: producer %d sent no checksum although the decode asked for one", ErrChecksum, r.room, t.producer))
			return
		}
		got, err := r.checksum(t, pages)
		if err != nil {
			r.failLocal(fmt.Errorf("engine: room %d: producer %d: checksum of the received pages: %w", r.room, t.producer, err))
			return
		}
		if got != rec.Checksum {
			r.failLocal(fmt.Errorf("%w: room %d: producer %d: record says %#08x, received bytes give %#08x", ErrChecksum, r.room, t.producer, rec.Checksum, got))
			return
		}
	}
	r.mu.Lock()
	if t.done {
		r.mu.Unlock()
		return
	}
	t.done = true
	t.bytes = rec.ByteCount
	r.remaining--
	left := r.remaining
	r.mu.Unlock()
	r.m.met.recvBytes.WithLabelValues(prefillPeerLabel(t.rank)).Add(float64(rec.ByteCount))
	r.tr.peer(StepVerify, t.endpoint, "metadata record verified")
	if left == 0 {
		r.succeed()
	}
}

// checksum recomputes the producer's CRC32C over the received bytes in the
// canonical order (crcPages on the consumer side, then crcExtras when this
// producer wrote the aux row and state slots).
func (r *Receiver) checksum(t *recvTarget, pages []int32) (uint32, error) {
	kv := r.m.cfg.KV
	var scratch []byte
	crc, err := crcPages(0, kv.KVBuffers, t.pairs, dstEnd, pages, r.m.geo.PageSize, &scratch)
	if err != nil || !t.extras {
		return crc, err
	}
	r.mu.Lock()
	aux, state := r.auxIndex, r.state
	r.mu.Unlock()
	return crcExtras(crc, kv, aux, state, &scratch)
}

func (r *Receiver) checkTimeout(now time.Time) {
	p, _ := r.st.get()
	if p != KVTransferring {
		return
	}
	r.mu.Lock()
	sent := r.sentAt
	left := r.remaining
	r.mu.Unlock()
	if !sent.IsZero() && now.Sub(sent) > r.m.cfg.WaitingTimeout {
		r.failLocal(fmt.Errorf("%w: room %d: no Success from %d producer(s) within %s of TRANSFER (%s, or check the prefill)", ErrTimeout, r.room, left, r.m.cfg.WaitingTimeout, waitingTimeoutHint))
	}
}

// prefillRankName names a producer as errors and progress lines do:
// "prefill tp1/pp0 at 127.0.0.1:46439".
func prefillRankName(rank bootstrap.TargetRank, ep string) string {
	return prefillPeerLabel(rank) + " at " + peerLabel(ep)
}

// progress logs the "room waiting" line (ManagerConfig.ProgressInterval)
// when the room has waited on its producers for another interval: its
// state and step, how long it waited, the producers that answered and those
// it waits for, each by rank and address, and the time left before its
// timeout fails it.
func (r *Receiver) progress(now time.Time) {
	every := r.m.cfg.ProgressInterval
	p, _ := r.st.get()
	if every <= 0 || (p != KVBootstrapping && p != KVTransferring) {
		return
	}
	registered := r.tr.peersDone(StepConnect) // before r.mu: the trace's lock is taken under it elsewhere
	step := r.tr.step()
	r.mu.Lock()
	last := r.progressAt
	if last.IsZero() {
		last = r.tr.created
	}
	if now.Sub(last) < every {
		r.mu.Unlock()
		return
	}
	r.progressAt = now
	var answered, waiting []string
	var left time.Duration
	switch {
	case p == KVTransferring:
		for _, t := range r.targets {
			switch {
			case t.rank.Dummy:
			case t.done:
				answered = append(answered, prefillRankName(t.rank, t.endpoint))
			case t.wrote:
				waiting = append(waiting, prefillRankName(t.rank, t.endpoint)+" (Success reported, metadata record not verified yet)")
			default:
				waiting = append(waiting, prefillRankName(t.rank, t.endpoint)+" (TRANSFER sent, no Success yet)")
			}
		}
		left = r.m.cfg.WaitingTimeout - now.Sub(r.sentAt)
	case r.resolved: // prefill_complete: waiting for the producers to compute the request
		for _, t := range r.targets {
			switch {
			case t.rank.Dummy:
			case t.ready:
				answered = append(answered, prefillRankName(t.rank, t.endpoint))
			default:
				waiting = append(waiting, prefillRankName(t.rank, t.endpoint)+" (SUBSCRIBE sent, request not computed yet)")
			}
		}
	default: // resolving producers and registering with them
		for _, ep := range r.resolvedEPs {
			if registered[ep] {
				answered = append(answered, "prefill at "+peerLabel(ep))
			} else {
				waiting = append(waiting, "prefill at "+peerLabel(ep)+" (REGISTER sent, no REGISTER_ACK yet)")
			}
		}
		if len(waiting) == 0 {
			what := "the next prefill rank's entry"
			if step == StepResolveTopology {
				what = "the prefill topology: not every prefill rank of the instance has registered yet"
			}
			waiting = append(waiting, "the bootstrap server at "+r.addr+" ("+what+")")
		}
		left = r.m.cfg.BootstrapTimeout - now.Sub(r.tr.created)
	}
	r.mu.Unlock()
	args := []any{"state", p.String(), "waited", now.Sub(r.tr.created).Round(time.Millisecond).String(),
		"answered", strings.Join(answered, "; "), "waiting_for", strings.Join(waiting, "; ")}
	if left > 0 {
		args = append(args, "fails_in", left.Round(time.Second).String())
	}
	r.tr.log("").Info("room waiting", args...)
}

// Abort fails the receiver (sticky) with ErrAborted; like every failure it
// sends ABORT to every producer so that they stop writing.
func (r *Receiver) Abort() {
	r.failLocal(fmt.Errorf("%w: room %d: aborted by the decode caller", ErrAborted, r.room))
}

// failLocal makes the room Failed (unless it is already terminal), sends
// ABORT with the reason to every known producer and starts fencing. It
// reports whether the state changed.
func (r *Receiver) failLocal(err error) bool {
	if !r.st.fail(err, true) {
		return false
	}
	r.cancel()
	r.m.rememberVerdict(r.room, false, err.Error(), r.attempt)
	r.mu.Lock()
	ts := append([]*recvTarget(nil), r.targets...)
	r.mu.Unlock()
	r.m.verdictFlight.add(len(ts)) // Close sends them first (verdicts.go)
	for _, t := range ts {
		go func() {
			defer r.m.verdictFlight.done(1)
			// Recorded before the send: the producer's ABORT_ACK can be
			// handled before a send returns, and the timeline must not show
			// the answer before the question.
			r.tr.event(r.tr.step(), t.endpoint, "ABORT sent")
			// After a TRANSFER run is sending to it (sendMu): on one
			// connection the producer then sees the ABORT last.
			r.sendMu.Lock()
			sent := r.m.sendAbort(t.endpoint, r.room, err.Error(), t.epoch, r.attempt)
			r.sendMu.Unlock()
			if !sent {
				r.tr.event(r.tr.step(), t.endpoint, "ABORT could not be sent (control socket refused it); the fence timeout decides")
			}
		}()
	}
	if !r.updateFence() {
		r.tr.event(StepConsume, "", "pages quarantined until every producer that got TRANSFER acknowledges the abort or is fenced")
		r.m.met.fence(RoleDecode, "quarantined") // its pages wait for the fence
		r.m.wg.Add(1)
		go r.fenceLoop()
	}
	return true
}

// onAbortAck: a producer will write nothing more for this attempt of the
// room (handleAbortAck took an acknowledgement of another attempt as of a
// closed room). A clean acknowledgement fences it; an unclean one (a batch
// abandoned, the data path broken) fences its data path.
func (r *Receiver) onAbortAck(v *control.AbortAckMsg) {
	r.mu.Lock()
	var t *recvTarget
	for _, c := range r.targets {
		if c.endpoint == v.Endpoint && !c.rank.Dummy {
			t = c
		}
	}
	if t == nil || (v.Epoch != 0 && v.Epoch != t.epoch) {
		r.mu.Unlock()
		return
	}
	if t.moving {
		// Its answer to the TRANSFER over the evicted registration (that
		// data path is fenced; the room registers again, evictmove.go).
		r.mu.Unlock()
		r.tr.event(r.tr.step(), v.Endpoint, "ABORT_ACK of the evicted registration ignored, the room registers again ("+v.Detail+")")
		return
	}
	if v.Clean {
		t.fenced = true
	}
	epoch, p := t.epoch, r.Poll()
	r.mu.Unlock()
	if v.Clean {
		r.tr.event(r.tr.step(), v.Endpoint, "ABORT_ACK: clean, nothing more will be written")
	} else {
		r.tr.event(r.tr.step(), v.Endpoint, "ABORT_ACK: unclean ("+v.Detail+"); fencing its data path")
	}
	if p != KVFailed && p != KVSuccess {
		// Its STATUS Failed went first on the same connection; this is
		// only reached if the producer fenced itself without one.
		r.failLocal(fmt.Errorf("%w: room %d: prefill rank %d (%s) stopped writing: %s", ErrAborted, r.room, t.producer, v.Endpoint, v.Detail))
	}
	if !v.Clean {
		r.m.fenceEpochAsync(v.Endpoint, epoch, fmt.Sprintf("prefill rank %d reported an unclean abort of room %d: %s", t.producer, r.room, v.Detail))
	}
	r.updateFence()
}

// updateFence closes fenceCh once the room is terminal and every producer
// that got TRANSFER is fenced (reported Success, acknowledged the abort
// cleanly, or its data path was fenced). It reports whether it is closed.
func (r *Receiver) updateFence() bool {
	r.mu.Lock()
	p, _ := r.st.get()
	ok := p == KVSuccess || p == KVFailed
	for _, t := range r.targets {
		if ok && t.sent && !t.rank.Dummy && !t.wrote && !t.fenced {
			ok = false
		}
	}
	r.mu.Unlock()
	if ok {
		r.fenceOnce.Do(func() {
			if p == KVFailed {
				r.tr.event(StepConsume, "", "every producer fenced: pages reusable")
			}
			close(r.fenceCh)
		})
	}
	return ok
}

// fenceLoop waits FenceTimeout for the producers' acknowledgements, then
// fences the data path of every producer still unfenced.
func (r *Receiver) fenceLoop() {
	defer r.m.wg.Done()
	t := time.NewTimer(r.m.cfg.FenceTimeout)
	defer t.Stop()
	select {
	case <-r.fenceCh:
		return
	case <-r.m.done:
		return
	case <-t.C:
	}
	r.mu.Lock()
	var late []*recvTarget
	for _, t := range r.targets {
		if t.sent && !t.rank.Dummy && !t.wrote && !t.fenced {
			late = append(late, t)
		}
	}
	r.mu.Unlock()
	for _, t := range late {
		r.tr.event(StepConsume, t.endpoint, fmt.Sprintf("no clean ABORT_ACK within %s: fencing its data path", r.m.cfg.FenceTimeout))
		r.m.fenceEpochAsync(t.endpoint, t.epoch, fmt.Sprintf("prefill rank %d did not acknowledge the abort of room %d within %s", t.producer, r.room, r.m.cfg.FenceTimeout))
	}
}

// Fenced returns a channel closed when the room's destination pages and
// metadata slot may be reused: the room succeeded, or it failed and every
// producer that was sent TRANSFER is fenced (see Close).
func (r *Receiver) Fenced() <-chan struct{} { return r.fenceCh }

// Close releases the room: an unfinished transfer is aborted first (ABORT to
// every producer). It returns when the caller may reuse the destination
// pages, and then releases the metadata slots:
//   - after Success: at once (every producer reported its last write);
//   - after a failure: once every producer that was sent TRANSFER is
//     fenced: it acknowledged the abort after its last write (normally
//     within milliseconds), or, when no clean acknowledgement came within
//     ManagerConfig.FenceTimeout (5 s by default), its data path was fenced
//     by the transports. For tcp and rdma that takes no longer; for shm,
//     whose sender maps this rank's memory, Close waits until that producer
//     has no copy in progress or has exited (a producer stopped with SIGSTOP
//     in the middle of a copy holds it until it is continued or killed).
//
// Close returns at once when the manager is closed. Idempotent; concurrent
// calls all return when the first completes.
func (r *Receiver) Close() {
	if p := r.Poll(); p != KVSuccess && p != KVFailed {
		r.Abort()
	}
	r.closeOnce.Do(func() {
		select {
		case <-r.fenceCh:
		case <-r.m.done:
		}
		r.mu.Lock()
		r.closed = true
		slots := r.slots
		r.slots = nil
		r.mu.Unlock()
		r.cancel()
		r.tr.event(StepConsume, "", "closed: pages and metadata slots released")
		select {
		case <-r.m.done: // the ring is going away with the manager
		default:
			for _, s := range slots {
				r.m.dec.ring.Release(s)
			}
		}
		r.m.mu.Lock()
		if r.m.dec.receivers[r.room] == r {
			delete(r.m.dec.receivers, r.room)
		}
		r.m.mu.Unlock()
		close(r.closedCh)
	})
	<-r.closedCh
}
