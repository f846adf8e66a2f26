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
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// KVResult is one KV-room case: the whole main-job path in this process —
// a bootstrap server, a prefill and a decode KV manager over one transport,
// each on per-layer K/V buffers and aux buffers built by workload exactly as
// a serving engine holds them — moving one request of Tokens tokens per
// repetition (Send → the decode's Success, metadata record verified).
type KVResult struct {
	// Transport is the engine registry name.
	Transport string `json:"transport"`
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
	res = KVResult{Transport: transport, Model: cfg.KVModel, Tokens: cfg.KVTokens}
	budget := cfg.CaseTimeout
	if budget <= 0 {
		// As CaseBudget: the base plus every room's KV bytes at the floor rate.
		budget = caseBudgetBase
		if model, err := workload.LookupModel(cfg.KVModel); err == nil {
			pages := (cfg.KVTokens + workload.DefaultPageSize - 1) / workload.DefaultPageSize
			if l, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: workload.DefaultPageSize, NumPages: pages}); err == nil {
				room := float64(l.NumBuffers()) * float64(pages) * float64(l.ItemLen())
				budget += time.Duration(room * float64(cfg.Warmup+cfg.Reps) / caseBudgetFloor * float64(time.Second))
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	if err := runKV(ctx, cfg, &res); err != nil {
		res.Err = err.Error()
	}
	return res
}

func runKV(ctx context.Context, cfg Config, res *KVResult) error {
	model, err := workload.LookupModel(cfg.KVModel)
	if err != nil {
		return err
	}
	l, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: workload.DefaultPageSize, NumPages: (cfg.KVTokens + workload.DefaultPageSize - 1) / workload.DefaultPageSize})
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
			return nil, err
		}
		_ = s.bufs.Prefault() // first-touch faults are not the transport's cost
		if s.tr, err = transport.OpenTransport(res.Transport, transport.DefaultOptions()); err != nil {
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
	fmt.Fprintln(tw, "\nKV rooms (prefill → decode managers in one process, per-layer buffers from workload, Send → decode Success):")
	fmt.Fprintln(tw, "transport\tmodel\ttokens\tbuffers\tMiB/request\tGB/s median [min–max]\tlatency ms median\tverified")
	for _, k := range rep.KV {
		if k.Err != "" {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t\tFAILED: %s\t\t\n", k.Transport, k.Model, k.Tokens, k.Buffers, k.Err)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.0f\t%.2f [%.2f–%.2f]\t%.1f\t%v\n", k.Transport, k.Model, k.Tokens, k.Buffers,
			float64(k.Bytes)/(1<<20), k.GBps.Median, k.GBps.Min, k.GBps.Max, k.LatencyMS.Median, k.Verified)
	}
	return tw.Flush()
}

// quietLogger keeps the KV managers' per-request info logs out of the
// benchmark's output; warnings and errors still reach stderr.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
