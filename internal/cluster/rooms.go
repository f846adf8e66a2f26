package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	directory "github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// The reference way to drive a Sender and a Receiver: what a prefill rank
// and a decode rank do for one request (room), as `kvxfer prefill` and
// `kvxfer decode` run them for every stdin line. The CLI adds the line
// protocol around them; an embedding program can call them the same way.

// Result is the outcome of one room on one rank, as the ranks' result
// lines carry it (JSON names as in the CLI's output).
type Result struct {
	OK bool `json:"ok"`
	// Error says what failed (never empty when OK is false).
	Error string `json:"error,omitempty"`
	// Pages is the room's page count for its prompt (prefill on Success:
	// the pages sent, after the decode's prefix).
	Pages int `json:"pages"`
	// Bytes is the KV bytes moved: what the prefill rank wrote (all
	// destinations) or what the decode rank received.
	Bytes uint64 `json:"bytes"`
	// AuxBytes is the aux-row bytes moved with the KV.
	AuxBytes uint64 `json:"aux_bytes,omitempty"`
	// PrefixTokens is the prompt tokens the decode already held (not sent);
	// SkippedBytes the KV bytes that saved.
	PrefixTokens int    `json:"prefix_tokens,omitempty"`
	SkippedBytes uint64 `json:"skipped_bytes,omitempty"`
	// Dummy (prefill) is a rank with nothing to send (MLA with prefill TP
	// > decode TP).
	Dummy bool `json:"dummy,omitempty"`
	// Writes (prefill) is the KV write requests the transfer took: one per
	// run of pages contiguous on both sides per buffer (engine
	// TransferMetric.Writes).
	Writes int `json:"writes,omitempty"`
	// ExtraWrites (prefill) is the room's other write requests: aux rows,
	// state slots, the metadata record and its commit word (engine
	// TransferMetric.ExtraWrites); Writes + ExtraWrites is what the room
	// adds to kvxfer_write_requests_total.
	ExtraWrites int `json:"extra_writes,omitempty"`
	// Transports (prefill) names the transports the room's bytes moved on.
	Transports []string `json:"transports,omitempty"`
	// StartUnixNS and EndUnixNS (prefill) bound the transfer (first Send,
	// Success) in Unix nanoseconds, so a driver on the same host can take
	// the union of concurrent transfers' intervals.
	StartUnixNS int64 `json:"start_unix_ns,omitempty"`
	EndUnixNS   int64 `json:"end_unix_ns,omitempty"`
	// Digest (decode, RoomConfig.Digest) is the SHA-256 of the room's
	// received KV bytes (workload.KVBuffers.Digest), taken after Hold.
	Digest string `json:"digest,omitempty"`
	// TransferUS, FillUS and VerifyUS are microseconds: the transfer
	// (prefill: first Send → Success; decode: its TRANSFER → every record
	// accepted, before the pattern check), the prefill's pattern fill and
	// the decode's pattern check. A failed decode room that sent its
	// TRANSFER reports Bytes (what landed) with its TransferUS too: to
	// every record accepted when --verify then refused the bytes (VerifyUS
	// the check), else to the failure; a failed prefill room reports
	// neither (both 0). BootstrapWaitUS (decode) is the wait
	// before its TRANSFER (resolving and registering with the producers
	// through the bootstrap server, a ring slot): not part of TransferUS.
	TransferUS      int64 `json:"transfer_us"`
	BootstrapWaitUS int64 `json:"bootstrap_wait_us,omitempty"`
	FillUS          int64 `json:"fill_us,omitempty"`
	VerifyUS        int64 `json:"verify_us,omitempty"`
	// ComputeStartUnixNS and ComputeEndUnixNS (prefill, with a compute
	// model: RoomConfig.LayerTime) bound the modeled forward pass, Unix
	// nanoseconds; SuccessUnixNS (decode) is when the room's every record
	// was accepted (before the pattern check of --verify, which a serving
	// decode does not run), so compute end → decode Success is the
	// handover and compute start → decode Success a TTFT proxy.
	ComputeStartUnixNS int64 `json:"compute_start_unix_ns,omitempty"`
	ComputeEndUnixNS   int64 `json:"compute_end_unix_ns,omitempty"`
	SuccessUnixNS      int64 `json:"success_unix_ns,omitempty"`
	// Layerwise (prefill) says the room was sent layer by layer.
	Layerwise bool `json:"layerwise,omitempty"`
}

// RoomConfig is how a rank drives its rooms (the CLI's role flags).
type RoomConfig struct {
	// Bootstrap is the decode's bootstrap server (host:port) for a room
	// that names none.
	Bootstrap string
	// BootstrapTimeout and WaitingTimeout are the manager's (SGLang's)
	// timeouts; they bound the waits here, and the waits for free pages.
	BootstrapTimeout, WaitingTimeout time.Duration
	// ChunkPages (prefill) sends a room in Send calls of this many pages
	// (0: one call).
	ChunkPages int
	// Fill (prefill) writes the test pattern (workload.FillPattern) into the
	// source pages and aux row before sending.
	Fill bool
	// PatternRoom (prefill), when set, is the room whose test pattern Fill
	// writes instead of the room's own: a harness that retries a room
	// with the same bootstrap_room (kvxfer chaos) gives each attempt bytes
	// of its own, so a write of one attempt found in the other's pages is
	// told apart.
	PatternRoom *uint64
	// Verifier (decode), when set, is the engine's VerifyKV hook
	// (ManagerConfig.VerifyKV = Verifier.VerifyKV); DecodeRoom reports its
	// time and checks a held prefix's blocks.
	Verifier *Verifier
	// Hold (decode) keeps a successful room's pages this long before the
	// digest and release (to observe late writes).
	Hold time.Duration
	// Digest (decode) hashes the received KV bytes into Result.Digest.
	Digest bool
	// Layerwise (prefill) sends each layer of each chunk as the forward
	// pass finishes it (engine.Sender.SendLayers) instead of each chunk
	// after all its layers (layers.go).
	Layerwise bool
	// LayerTime (prefill) is the modeled compute time of one layer over the
	// whole prompt (0: none). With it (or Layerwise) the prefill runs the
	// forward pass layer by layer, chunk by chunk, after the decode's
	// destination is known, sleeping each layer's share of the time and
	// holding no lock (a GPU computes while the host waits; the pattern
	// the decode checks was written before, with Fill).
	LayerTime time.Duration
	// AfterLayers (prefill, fault injection), when set, is called once the
	// writes of each layer-wise call have landed, with the calls made so
	// far; false stops sending (the room then ends as a stalled prefill's).
	AfterLayers func(room uint64, calls int) bool
}

// AllocWait allocates n items from a (KV pages or aux rows; what names them
// in errors), waiting up to limit for finished requests to free some
// (workload.PageAllocator.AllocWait). A request larger than the pool fails
// at once, naming the pool's capacity (--pool-mb for pages).
func AllocWait(ctx context.Context, a *workload.PageAllocator, what string, n int, limit time.Duration) ([]int32, error) {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	p, err := a.AllocWait(wctx, n)
	switch {
	case err == nil:
		return p, nil
	case errors.Is(err, workload.ErrPoolTooSmall) && what == "pages":
		return nil, fmt.Errorf("request needs %d pages, the KV buffers hold %d (raise --pool-mb)", n, a.Capacity())
	case errors.Is(err, workload.ErrPoolTooSmall):
		return nil, fmt.Errorf("request needs %d %s, there are %d", n, what, a.Capacity())
	case ctx.Err() != nil:
		return nil, ctx.Err()
	}
	return nil, fmt.Errorf("%s: %w", what, err)
}

// PrefillRoom sends one room's KV: it opens a Sender for room, takes the
// prompt's pages and an aux row from pool and rows (waiting up to
// WaitingTimeout for free ones), fills them when Fill, marks the request
// computed (Sender.MarkPrefillComplete), waits for the decode's
// destination (up to BootstrapTimeout), sends the pages after the decode's
// prefix in ChunkPages pieces and waits for the decode's verdict. A failure
// here aborts the room so the decode learns the reason.
func PrefillRoom(ctx context.Context, m *engine.Manager, pool *workload.KVBuffers, rows *workload.PageAllocator, c RoomConfig, room uint64, tokens int) Result {
	n := m.PagesForTokens(tokens)
	fail := func(err error) Result { return Result{Error: err.Error(), Pages: n} }
	s, err := m.NewSender(room)
	if err != nil {
		return fail(err)
	}
	defer s.Close()
	// A failure here (no pages, a bad token count) reaches the decode with
	// its reason, now or when its TRANSFER arrives.
	fail = func(err error) Result {
		s.AbortWith(err)
		return Result{Error: err.Error(), Pages: n}
	}
	if err := s.SetTokens(tokens); err != nil {
		return fail(err)
	}
	// The prefill computes the whole prompt's KV (here: the test pattern)
	// and its aux row while the decode resolves; only the pages after the
	// decode's prefix are sent.
	src, err := AllocWait(ctx, pool.PageAllocator, "pages", n, c.WaitingTimeout)
	if err != nil {
		return fail(err)
	}
	defer pool.Free(src)
	aux, err := AllocWait(ctx, rows, "aux rows", 1, c.WaitingTimeout)
	if err != nil {
		return fail(err)
	}
	defer rows.Free(aux)
	var r Result
	modeled := c.LayerTime > 0 || c.Layerwise
	if c.Fill {
		t := time.Now()
		pattern := room
		if c.PatternRoom != nil {
			pattern = *c.PatternRoom
		}
		if err := workload.FillPattern(pool, pattern, src, 0); err != nil {
			return fail(err)
		}
		if err := workload.FillAux(pool, pattern, int(aux[0])); err != nil {
			return fail(err)
		}
		r.FillUS = time.Since(t).Microseconds()
	}
	// The request is computed: under the prefill_complete allocation
	// policy its decodes reserve their pages only now (a no-op under early).
	if err := s.MarkPrefillComplete(); err != nil {
		return fail(err)
	}
	wctx, cancel := context.WithTimeout(ctx, c.BootstrapTimeout+time.Second)
	st := s.Wait(wctx, engine.KVWaitingForInput)
	cancel()
	if st != engine.KVWaitingForInput {
		if err := s.Failure(); err != nil {
			return fail(err)
		}
		return fail(Unfinished(ctx, room, "sender", st, " after the bootstrap timeout"))
	}
	if !s.HasRealDst() {
		// A dummy rank (MLA with prefill TP > decode TP): nothing to send.
		r.Dummy = true
		src = src[:0]
	} else {
		send, err := s.InitTokens(tokens, int(aux[0]))
		if err != nil {
			return fail(err)
		}
		src = src[len(src)-send:]
	}
	t0 := time.Now()
	if modeled {
		ct, err := forwardPass(ctx, s, pool, c, room, src)
		if err != nil {
			return fail(err)
		}
		r.ComputeStartUnixNS, r.ComputeEndUnixNS, r.Layerwise = ct.start.UnixNano(), ct.end.UnixNano(), c.Layerwise
		t0 = ct.firstSend
	} else if err := sendChunks(s, src, c.ChunkPages); err != nil {
		return fail(err)
	}
	// Success needs the decode's verdict; the engine bounds that wait by
	// the waiting timeout, this bound is only a backstop.
	wctx, cancel = context.WithTimeout(ctx, 2*c.WaitingTimeout+5*time.Second)
	st = s.Wait(wctx, engine.KVSuccess)
	cancel()
	t1 := time.Now()
	r.TransferUS = t1.Sub(t0).Microseconds()
	r.StartUnixNS, r.EndUnixNS = t0.UnixNano(), t1.UnixNano()
	if st != engine.KVSuccess {
		if err := s.Failure(); err != nil {
			return fail(err)
		}
		return fail(Unfinished(ctx, room, "sender", st, " after twice the waiting timeout"))
	}
	mt := s.TransferMetric()
	r.OK, r.Pages, r.Transports, r.Bytes = true, len(src), s.TransportNames(), mt.Bytes
	r.PrefixTokens, r.SkippedBytes, r.AuxBytes, r.Writes, r.ExtraWrites = mt.PrefixTokens, mt.SkippedBytes, mt.AuxBytes, mt.Writes, mt.ExtraWrites
	return r
}

// sendChunks sends src in Send calls of chunk pages (0: one call).
func sendChunks(s *engine.Sender, src []int32, chunk int) error {
	if chunk <= 0 {
		chunk = len(src) + 1
	}
	for i := 0; ; i += chunk {
		end := min(i+chunk, len(src))
		if err := s.Send(src[i:end], end == len(src)); err != nil {
			return err
		}
		if end == len(src) {
			return nil
		}
	}
}

// DecodeRoom receives one room: it takes destination pages and an aux row
// (waiting up to WaitingTimeout), opens a Receiver for room at bootstrap
// (RoomConfig.Bootstrap when empty) -- under the prefill_complete
// allocation policy it opens the Receiver first and takes the pages once
// the prefill computed the request (WaitingForInput) --, sends its metadata and waits for
// Success (up to BootstrapTimeout + WaitingTimeout). With a prefix cache
// lease it asks only for the pages after the held prefix and, once Success,
// waits for the prefix blocks' own requests so the whole prompt is verified.
// It returns the result and release, which closes the receiver and frees
// the destination pages and aux row: for a failed room that waits until
// every producer is fenced (engine.Receiver.Close), so the caller reports
// the result first.
func DecodeRoom(ctx context.Context, m *engine.Manager, pool *workload.KVBuffers, rows *workload.PageAllocator, lease *workload.Lease, c RoomConfig, room uint64, tokens int, bootstrap string) (out Result, release func()) {
	n := m.PagesForTokens(tokens)
	var frees []func() // run in reverse order by release
	release = func() {
		for i := len(frees) - 1; i >= 0; i-- {
			frees[i]()
		}
	}
	fail := func(err error) (Result, func()) { return Result{Error: err.Error(), Pages: n}, release }
	addr := bootstrap
	if addr == "" {
		addr = c.Bootstrap
	}
	var r *engine.Receiver
	var t0 time.Time
	if m.DecodeAllocationPolicy() == directory.PolicyPrefillComplete {
		// Nothing is reserved until the prefill computed the request: the
		// receiver resolves and subscribes first (Bootstrapping), the pages
		// are taken once it is WaitingForInput.
		var err error
		if r, t0, err = openReceiver(m, addr, room, tokens); err != nil {
			return fail(err)
		}
		wctx, cancel := context.WithTimeout(ctx, c.BootstrapTimeout+c.WaitingTimeout)
		st := r.Wait(wctx, engine.KVWaitingForInput)
		cancel()
		if st != engine.KVWaitingForInput {
			err := r.Failure()
			if err == nil {
				err = Unfinished(ctx, room, "receiver", st, " waiting for the prefill to compute the request")
			}
			r.Close()
			return fail(err)
		}
	}
	// refuse fails the room for want of pages or an aux row: the receiver
	// (opened now if the policy had not) tells the prefill the reason, so
	// it fails the room at once rather than at its bootstrap timeout.
	refuse := func(err error) (Result, func()) {
		if r == nil {
			if rr, _, oerr := openReceiver(m, addr, room, tokens); oerr == nil {
				r = rr
			}
		}
		if r != nil {
			r.Refuse(fmt.Errorf("decode refused room %d: %w", room, err))
			r.Close()
		}
		return fail(err)
	}
	alloc := func(k int) ([]int32, error) { return AllocWait(ctx, pool.PageAllocator, "pages", k, c.WaitingTimeout) }
	var pages []int32
	var err error
	prefix := 0
	if lease != nil {
		frees = append(frees, func() { lease.Finish(out.OK) })
		prefix = lease.PrefixTokens
		pages, err = lease.Pages(ctx, alloc)
	} else {
		pages, err = alloc(n)
		if err == nil {
			frees = append(frees, func() { pool.Free(pages) })
		}
	}
	if err != nil {
		return refuse(err)
	}
	held := prefix / m.PageSize()
	aux, err := AllocWait(ctx, rows, "aux rows", 1, c.WaitingTimeout)
	if err != nil {
		release()
		frees = nil
		return refuse(err)
	}
	frees = append(frees, func() { rows.Free(aux) })
	if r == nil {
		if r, t0, err = openReceiver(m, addr, room, tokens); err != nil {
			return fail(err)
		}
	}
	frees = append(frees, r.Close) // closed before the pages and aux row are freed
	if c.Verifier != nil {
		defer c.Verifier.times.Delete(room)
		defer c.Verifier.calls.Delete(room)
	}
	// The held prefix's blocks are another room's pages, possibly still in
	// flight: this room's verdict waits for their rooms (and checks their
	// pattern), so a lost prefix fails this room on both sides instead of
	// after the prefill was told Success.
	if lease != nil && lease.PrefixTokens > 0 {
		r.SetVerdictGate(func(ctx context.Context) error {
			wctx, cancel := context.WithTimeout(ctx, c.WaitingTimeout)
			defer cancel()
			sg, err := lease.WaitPrefix(wctx)
			if err != nil {
				return fmt.Errorf("held prefix: %w", err)
			}
			if c.Verifier != nil {
				for _, b := range sg {
					if err := workload.VerifyPattern(pool, b.Room, b.Pages, b.FirstPage); err != nil {
						return fmt.Errorf("held prefix block: %w", c.Verifier.hinted(err))
					}
				}
			}
			return nil
		})
	}
	if err := r.SendMetadata(pages[held:], int(aux[0]), nil, prefix); err != nil {
		return fail(err)
	}
	wctx, cancel := context.WithTimeout(ctx, c.BootstrapTimeout+c.WaitingTimeout)
	st := r.Wait(wctx, engine.KVSuccess)
	cancel()
	out = Result{Pages: n, TransferUS: time.Since(t0).Microseconds(), SuccessUnixNS: time.Now().UnixNano()}
	if at, ok := c.Verifier.accepted(room); ok {
		out.SuccessUnixNS = at.UnixNano() // before the pattern check
	}
	mt := r.TransferMetric()
	if st != engine.KVSuccess {
		err := r.Failure()
		if err == nil {
			err = Unfinished(ctx, room, "receiver", st, "")
		}
		res, rel := fail(err)
		// What landed before the failure (the room's pages are not usable),
		// and how long it took to land: from the TRANSFER to every record
		// accepted when the verifier then refused the bytes (its check
		// apart, as on Success), else to the failure.
		res.Bytes, res.AuxBytes, res.PrefixTokens = mt.Bytes, mt.AuxBytes, mt.PrefixTokens
		if !mt.TransferStart.IsZero() {
			res.TransferUS = time.Unix(0, out.SuccessUnixNS).Sub(mt.TransferStart).Microseconds()
			res.BootstrapWaitUS = mt.BootstrapWait.Microseconds()
		}
		if c.Verifier != nil {
			res.VerifyUS = c.Verifier.took(room)
		}
		return res, rel
	}
	out.Bytes, out.AuxBytes, out.PrefixTokens, out.SkippedBytes = mt.Bytes, mt.AuxBytes, mt.PrefixTokens, mt.SkippedBytes
	if !mt.TransferStart.IsZero() { // the transfer proper: the bootstrap wait apart
		out.TransferUS = time.Unix(0, out.SuccessUnixNS).Sub(mt.TransferStart).Microseconds()
		out.BootstrapWaitUS = mt.BootstrapWait.Microseconds()
	}
	if c.Verifier != nil {
		// This room's pages and aux row were checked inside the engine,
		// and the held prefix blocks by the verdict gate, both before the
		// verdict (so a failure fails the prefill too).
		out.VerifyUS = c.Verifier.took(room)
	}
	if c.Hold > 0 {
		select {
		case <-ctx.Done():
		case <-time.After(c.Hold):
		}
	}
	if c.Digest {
		if out.Digest, err = pool.Digest(pages[held:]); err != nil {
			return fail(err)
		}
	}
	out.OK = true
	return out, release
}

// openReceiver opens room's Receiver and declares its token count; t0 is
// when it was opened (the transfer time counts from it).
func openReceiver(m *engine.Manager, addr string, room uint64, tokens int) (*engine.Receiver, time.Time, error) {
	r, err := m.NewReceiver(addr, room)
	if err != nil {
		return nil, time.Time{}, err
	}
	t0 := time.Now()
	if err := r.SetTokens(tokens); err != nil {
		r.Close()
		return nil, t0, err
	}
	return r, t0, nil
}

// Verifier checks received rooms against the test pattern the prefill's
// Fill wrote (workload.VerifyPattern, VerifyAux) and remembers how long each
// check took. Its VerifyKV is the engine's ManagerConfig.VerifyKV hook: the
// check runs inside the engine, before the decode's verdict, so a room that
// fails it fails on the prefill too.
type Verifier struct {
	// Hint, when set, is appended to an error whose bytes differ from the
	// pattern (workload.ErrPatternMismatch): what the caller's setup makes
	// the likely cause (kvxfer decode --verify: the prefill's --fill).
	Hint string

	pool     *workload.KVBuffers
	pageSize int      // tokens per page
	times    sync.Map // room → µs the check took
	calls    sync.Map // room → time.Time the engine called the check
}

// NewVerifier returns a Verifier of pool's pages (pageSize tokens each).
func NewVerifier(pool *workload.KVBuffers, pageSize int) *Verifier {
	return &Verifier{pool: pool, pageSize: pageSize}
}

// VerifyKV checks the room's pages (after its prefix) and its aux row; the
// error names the first byte that differs.
func (v *Verifier) VerifyKV(kv engine.ReceivedKV) error {
	t := time.Now()
	v.calls.Store(kv.Room, t)
	defer func() { v.times.Store(kv.Room, time.Since(t).Microseconds()) }()
	if err := workload.VerifyPattern(v.pool, kv.Room, kv.Pages, kv.PrefixTokens/v.pageSize); err != nil {
		return v.hinted(err)
	}
	if kv.AuxIndex >= 0 {
		return v.hinted(workload.VerifyAux(v.pool, kv.Room, kv.AuxIndex))
	}
	return nil
}

// hinted appends v.Hint to err when err is a pattern mismatch.
func (v *Verifier) hinted(err error) error {
	if err == nil || v.Hint == "" || !errors.Is(err, workload.ErrPatternMismatch) {
		return err
	}
	return fmt.Errorf("%w (%s)", err, v.Hint)
}

// accepted returns (and forgets) when the engine called VerifyKV for room:
// every producer's record had been accepted (v may be nil).
func (v *Verifier) accepted(room uint64) (time.Time, bool) {
	if v == nil {
		return time.Time{}, false
	}
	if t, ok := v.calls.LoadAndDelete(room); ok {
		return t.(time.Time), true
	}
	return time.Time{}, false
}

// took returns (and forgets) how long VerifyKV took for room, µs.
func (v *Verifier) took(room uint64) int64 {
	if d, ok := v.times.LoadAndDelete(room); ok {
		return d.(int64)
	}
	return 0
}

// Unfinished is the error of a room whose wait ended with no engine
// failure: the rank shutting down (ctx cancelled by SIGINT/SIGTERM) says so,
// anything else names the state the room was left in (who: "sender" or
// "receiver") and the bound hit.
func Unfinished(ctx context.Context, room uint64, who string, st engine.KVPoll, bound string) error {
	if ctx.Err() != nil {
		return fmt.Errorf("room %d: aborted: the rank is shutting down (%v) while the %s was %s", room, context.Cause(ctx), who, st)
	}
	return fmt.Errorf("room %d: %s still %s%s", room, who, st, bound)
}
