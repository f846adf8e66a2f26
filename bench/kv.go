package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// KVResult is one KV-room case. Push (Mode "push"): the whole main-job path
// in this process — a bootstrap server, a prefill and a decode KV manager
// over one transport, each on per-layer K/V buffers and aux buffers built by
// workload exactly as a serving engine holds them — moving one request of
// Tokens tokens per repetition with the prefill's WRITEs (Send → the
// decode's Success, metadata record verified). Pull (Mode "pull", RunKVPull):
// the same buffers registered with a prefill and a decode segment engine;
// the decode READs the request's pages and aux row from the prefill's
// registered memory (the NIXL/vLLM pattern: SubmitPeerReads → completed),
// then checks them.
type KVResult struct {
	// Transport is the engine registry name.
	Transport string `json:"transport"`
	// Mode is "push" (the prefill WRITEs, KV managers) or "pull" (the
	// decode READs, segment engines).
	Mode string `json:"mode,omitempty"`
	// PushRatio (pull cases) is this case's median GB/s over the push case
	// of the same transport in the same run (0 when that one is missing).
	PushRatio float64 `json:"push_ratio,omitempty"`
	// Model and Tokens describe the request; Buffers is the KV buffers per
	// rank and Bytes the KV bytes one request moves.
	Model   string `json:"model"`
	Tokens  int    `json:"tokens"`
	Buffers int    `json:"buffers"`
	Bytes   uint64 `json:"bytes"`
	// GBps and LatencyMS summarise the timed repetitions.
	GBps      Stat `json:"gbps"`
	LatencyMS Stat `json:"latency_ms"`
	// Verified is true when every repetition's KV and aux row were checked
	// byte for byte (Config.Verify).
	Verified bool `json:"verified"`
	// Err is the failure, if the case did not complete.
	Err string `json:"error,omitempty"`
}

// DefaultKVModel and DefaultKVTokens are the KV-room case `kvxfer bench`
// runs without flags.
const (
	DefaultKVModel  = "llama-3.1-8b"
	DefaultKVTokens = 4096
)

// RunKV measures the KV-room path on transport: cfg.Warmup untimed and
// cfg.Reps timed requests of cfg.KVTokens tokens of cfg.KVModel, each into
// zeroed decode pages and (cfg.Verify) checked against the test pattern. A
// failure is returned in KVResult.Err.
func RunKV(ctx context.Context, cfg Config, transport string) (res KVResult) {
	return runKVCase(ctx, cfg, transport, "push", runKV)
}

// RunKVPull measures the pull-mode KV room on transport (see KVResult):
// cfg.Warmup untimed and cfg.Reps timed requests of cfg.KVTokens tokens of
// cfg.KVModel, each read by the decode into zeroed pages and (cfg.Verify)
// checked against the test pattern. A failure is returned in KVResult.Err.
func RunKVPull(ctx context.Context, cfg Config, transport string) KVResult {
	return runKVCase(ctx, cfg, transport, "pull", runKVPull)
}

// runKVCase runs one KV-room case (run: runKV or runKVPull) within its
// budget.
func runKVCase(ctx context.Context, cfg Config, transport, mode string, run func(context.Context, Config, *KVResult) error) (res KVResult) {
	res = KVResult{Transport: transport, Mode: mode, Model: cfg.KVModel, Tokens: cfg.KVTokens}
	budget := cfg.CaseTimeout
	if budget <= 0 {
		// As CaseBudget: the base plus every room's KV bytes at the floor rate.
		budget = caseBudgetBase
		if l, err := kvLayout(cfg); err == nil {
			room := float64(l.NumBuffers()) * float64(l.NumPages) * float64(l.ItemLen())
			budget += time.Duration(room * float64(cfg.Warmup+cfg.Reps) / caseBudgetFloor * float64(time.Second))
		}
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	if err := run(ctx, cfg, &res); err != nil {
		res.Err = err.Error()
	}
	return res
}

// kvLayout is the KV geometry of the KV-room cases: cfg.KVModel, pages
// for cfg.KVTokens tokens.
func kvLayout(cfg Config) (*workload.Layout, error) {
	model, err := workload.LookupModel(cfg.KVModel)
	if err != nil {
		return nil, err
	}
	return workload.NewLayout(model, workload.LayoutOptions{PageSize: workload.DefaultPageSize, NumPages: (cfg.KVTokens + workload.DefaultPageSize - 1) / workload.DefaultPageSize})
}

// kvBuffersHint ends a failed allocation of a KV-room side's buffers with
// what sizes them: --kv-tokens tokens of --kv-model (bench has no pool).
func kvBuffersHint(cfg Config, l *workload.Layout, err error) error {
	return fmt.Errorf("%w; each side of the KV room holds %s of --kv-tokens %d of --kv-model %s: lower --kv-tokens, or --kv-model \"\" to skip the KV room",
		err, FormatSize(l.PoolBytes()), cfg.KVTokens, cfg.KVModel)
}

func runKV(ctx context.Context, cfg Config, res *KVResult) error {
	l, err := kvLayout(cfg)
	if err != nil {
		return err
	}
	res.Buffers = l.NumBuffers()
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0, Logger: quietLogger()})
	sctx, stop := context.WithCancel(context.Background())
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Start(sctx) }()
	defer func() { stop(); <-srvDone }()
	select {
	case <-srv.Ready():
	case err := <-srvDone:
		return fmt.Errorf("bootstrap server: %w", err)
	case <-ctx.Done():
		return ctx.Err()
	}
	type side struct {
		bufs *workload.KVBuffers
		tr   transport.Transport
		m    *engine.Manager
	}
	open := func(role engine.Role) (*side, error) {
		s := &side{}
		var err error
		if s.bufs, err = workload.NewKVBuffers(l, workload.BufferOptions{Name: "bench-" + role.String(), Device: -1, Aux: workload.DefaultAux, AuxRows: 2}); err != nil {
			return nil, kvBuffersHint(cfg, l, err)
		}
		_ = s.bufs.Prefault() // first-touch faults are not the transport's cost
		if s.tr, err = transport.OpenTransport(res.Transport, cfg.transportOptions()); err != nil {
			s.bufs.Close()
			return nil, err
		}
		mc := engine.ManagerConfig{Role: role, KV: s.bufs.Args(), Transports: []transport.Transport{s.tr}, BootstrapAddr: srv.Addr(),
			BootstrapTimeout: cfg.CaseTimeout, WaitingTimeout: cfg.CaseTimeout, Logger: quietLogger()}
		if role == engine.RoleDecode {
			mc.BootstrapAddr = ""
		}
		if s.m, err = engine.NewManager(ctx, mc); err != nil {
			s.tr.Close()
			s.bufs.Close()
			return nil, err
		}
		return s, nil
	}
	closeSide := func(s *side) {
		s.m.Close()
		s.tr.Close()
		s.bufs.Close()
	}
	pre, err := open(engine.RolePrefill)
	if err != nil {
		return fmt.Errorf("prefill: %w", err)
	}
	defer closeSide(pre)
	dec, err := open(engine.RoleDecode)
	if err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	defer closeSide(dec)
	pages := make([]int32, l.NumPages)
	for i := range pages {
		pages[i] = int32(i)
	}
	const fillRoom = 1 // the pattern every repetition moves
	if err := workload.FillPattern(pre.bufs, fillRoom, pages, 0); err != nil {
		return err
	}
	if err := workload.FillAux(pre.bufs, fillRoom, 0); err != nil {
		return err
	}
	var gbps, lat []float64
	for i := 0; i < cfg.Warmup+cfg.Reps; i++ {
		for b := 0; b < l.NumBuffers(); b++ {
			clear(dec.bufs.Bytes(b))
		}
		clear(dec.bufs.AuxRow(0, 1))
		room := uint64(i + 1)
		r, err := dec.m.NewReceiver(srv.Addr(), room)
		if err != nil {
			return err
		}
		s, err := pre.m.NewSender(room)
		if err != nil {
			r.Close()
			return err
		}
		dt, bytes, err := kvOnce(ctx, s, r, pages)
		s.Close()
		r.Close()
		if err != nil {
			return fmt.Errorf("request %d: %w", i+1, err)
		}
		res.Bytes = bytes
		if cfg.Verify {
			if err := workload.VerifyPattern(dec.bufs, fillRoom, pages, 0); err != nil {
				return err
			}
			if err := workload.VerifyAux(dec.bufs, fillRoom, 1); err != nil {
				return err
			}
		}
		if i >= cfg.Warmup {
			gbps = append(gbps, float64(bytes)/dt.Seconds()/1e9)
			lat = append(lat, float64(dt.Microseconds())/1000)
		}
	}
	res.GBps, res.LatencyMS, res.Verified = Summarize(gbps), Summarize(lat), cfg.Verify
	return nil
}

// kvOnce moves one request: the decode asks for pages (aux row 1), the
// prefill sends them (aux row 0) in one chunk; the time runs from Send to the
// decode's Success.
func kvOnce(ctx context.Context, s *engine.Sender, r *engine.Receiver, pages []int32) (time.Duration, uint64, error) {
	if err := r.SendMetadata(pages, 1, nil, 0); err != nil {
		return 0, 0, err
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		return 0, 0, fmt.Errorf("sender %s: %w", st, errors.Join(s.Failure(), ctx.Err()))
	}
	if err := s.Init(len(pages), 0); err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	if err := s.Send(pages, true); err != nil {
		return 0, 0, err
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		return 0, 0, fmt.Errorf("receiver %s: %w", st, errors.Join(r.Failure(), ctx.Err()))
	}
	dt := time.Since(t0)
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		return 0, 0, fmt.Errorf("sender %s: %w", st, errors.Join(s.Failure(), ctx.Err()))
	}
	return dt, r.TransferMetric().Bytes, nil
}

// WriteKVTable prints the KV-room cases of rep (nothing when there are none).
func WriteKVTable(w io.Writer, rep *Report) error {
	if len(rep.KV) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\nKV rooms (one process, per-layer buffers from workload; push: prefill → decode KV managers, Send → decode Success;")
	fmt.Fprintln(tw, "pull: the decode's segment engine READs the prefill's registered pages and aux row, submit → completed):")
	fmt.Fprintln(tw, "transport\tmode\tmodel\ttokens\tbuffers\tMiB/request\tGB/s median [min–max]\tlatency ms median\t×push\tverified")
	for _, k := range rep.KV {
		mode := k.Mode
		if mode == "" {
			mode = "push"
		}
		if k.Err != "" {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t\tFAILED: %s\t\t\t\n", k.Transport, mode, k.Model, k.Tokens, k.Buffers, k.Err)
			continue
		}
		ratio := ""
		if mode == "pull" {
			ratio = fmtRatio(k.PushRatio)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%.0f\t%.2f [%.2f–%.2f]\t%.1f\t%s\t%v\n", k.Transport, mode, k.Model, k.Tokens, k.Buffers,
			float64(k.Bytes)/(1<<20), k.GBps.Median, k.GBps.Min, k.GBps.Max, k.LatencyMS.Median, ratio, k.Verified)
	}
	return tw.Flush()
}

// setPushRatios fills KVResult.PushRatio of the pull cases from the push
// case of the same transport.
func setPushRatios(kv []KVResult) {
	push := map[string]float64{}
	for _, k := range kv {
		if k.Mode != "pull" && k.Err == "" {
			push[k.Transport] = k.GBps.Median
		}
	}
	for i := range kv {
		if k := &kv[i]; k.Mode == "pull" && k.Err == "" && push[k.Transport] > 0 {
			k.PushRatio = k.GBps.Median / push[k.Transport]
		}
	}
}

// runKVPull is the pull-mode KV room (see KVResult): the prefill's and the
// decode's buffers registered with a segment engine each (P2P: the decode
// opens the prefill's segment by its RPC address), the prefill's pages
// filled with the test pattern once, then per request one read batch of
// one READ per KV buffer (the request's pages are one run) and one per aux
// buffer (prefill row 0 into decode row 1).
func runKVPull(ctx context.Context, cfg Config, res *KVResult) error {
	l, err := kvLayout(cfg)
	if err != nil {
		return err
	}
	res.Buffers = l.NumBuffers()
	type side struct {
		bufs *workload.KVBuffers
		te   *segengine.TransferEngine
	}
	open := func(name string) (*side, error) {
		s := &side{}
		var err error
		if s.bufs, err = workload.NewKVBuffers(l, workload.BufferOptions{Name: "bench-pull-" + name, Device: -1, Aux: workload.DefaultAux, AuxRows: 2}); err != nil {
			return nil, kvBuffersHint(cfg, l, err)
		}
		_ = s.bufs.Prefault()
		tr, err := transport.OpenTransport(res.Transport, cfg.transportOptions())
		if err != nil {
			s.bufs.Close()
			return nil, err
		}
		if s.te, err = segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{Transport: tr, Logger: quietLogger()}); err != nil {
			tr.Close()
			s.bufs.Close()
			return nil, err
		}
		args := s.bufs.Args()
		for _, b := range append(args.KVBuffers, args.AuxBuffers...) {
			if _, err := s.te.RegisterMemory(b.Memory); err != nil {
				s.te.Close()
				s.bufs.Close()
				return nil, fmt.Errorf("%s: register %d bytes at %#x: %w", name, b.Memory.Length, b.Memory.Addr, err)
			}
		}
		return s, nil
	}
	pre, err := open("prefill")
	if err != nil {
		return fmt.Errorf("prefill: %w", err)
	}
	defer func() { pre.te.Close(); pre.bufs.Close() }()
	dec, err := open("decode")
	if err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	defer func() { dec.te.Close(); dec.bufs.Close() }()
	seg, err := dec.te.OpenSegment(ctx, pre.te.Name())
	if err != nil {
		return fmt.Errorf("decode: open the prefill's segment %s: %w", pre.te.Name(), err)
	}
	defer seg.Close()
	pages := make([]int32, l.NumPages)
	for i := range pages {
		pages[i] = int32(i)
	}
	const fillRoom = 1
	if err := workload.FillPattern(pre.bufs, fillRoom, pages, 0); err != nil {
		return err
	}
	if err := workload.FillAux(pre.bufs, fillRoom, 0); err != nil {
		return err
	}
	pa, da := pre.bufs.Args(), dec.bufs.Args()
	var reads []segengine.PeerRead
	var kvBytes uint64
	for i := range pa.KVBuffers {
		n := uint64(len(pages)) * l.ItemLen()
		reads = append(reads, segengine.PeerRead{Local: da.KVBuffers[i].Memory.Addr, PeerAddr: uint64(pa.KVBuffers[i].Memory.Addr), Length: n})
		kvBytes += n
	}
	for i := range pa.AuxBuffers {
		row := pa.AuxBuffers[i].ItemLen
		reads = append(reads, segengine.PeerRead{Local: da.AuxBuffers[i].Memory.Addr + uintptr(row), PeerAddr: uint64(pa.AuxBuffers[i].Memory.Addr), Length: row})
	}
	res.Bytes = kvBytes
	var gbps, lat []float64
	for i := 0; i < cfg.Warmup+cfg.Reps; i++ {
		for b := 0; b < l.NumBuffers(); b++ {
			clear(dec.bufs.Bytes(b))
		}
		for a := range da.AuxBuffers {
			clear(dec.bufs.AuxRow(a, 1))
		}
		t0 := time.Now()
		id, err := seg.SubmitPeerReads(ctx, reads)
		if err != nil {
			return fmt.Errorf("request %d: submit the reads: %w", i+1, err)
		}
		st, err := seg.Wait(ctx, id)
		dt := time.Since(t0)
		seg.Release(id)
		switch {
		case err != nil:
			return fmt.Errorf("request %d: wait for the reads: %w", i+1, err)
		case st.State != transport.BatchCompleted:
			return fmt.Errorf("request %d: reads %v after %d bytes: %w", i+1, st.State, st.BytesDone, st.Err)
		}
		if cfg.Verify {
			if err := workload.VerifyPattern(dec.bufs, fillRoom, pages, 0); err != nil {
				return err
			}
			if err := workload.VerifyAux(dec.bufs, fillRoom, 1); err != nil {
				return err
			}
		}
		if i >= cfg.Warmup {
			gbps = append(gbps, float64(kvBytes)/dt.Seconds()/1e9)
			lat = append(lat, float64(dt.Microseconds())/1000)
		}
	}
	res.GBps, res.LatencyMS, res.Verified = Summarize(gbps), Summarize(lat), cfg.Verify
	return nil
}

// quietLogger keeps the KV managers' per-request info logs out of the
// benchmark's output; warnings and errors still reach stderr.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
