package main

// kvxfer demo --layerwise: the same requests sent whole-room and layer by
// layer in one run, each prefill running a modeled forward pass, and what
// the decode waits for after the compute (the handover) and from its start
// (a TTFT proxy) compared (issue 24).

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/workload"
)

const (
	modeWhole = "whole-room"
	modeLayer = "layer-wise"
)

// layerwiseFlags are demo --layerwise's flags.
type layerwiseFlags struct {
	on        bool
	tflops    float64
	layerTime time.Duration
	tokens    int
}

func (l *layerwiseFlags) add(fs *pflag.FlagSet) {
	fs.BoolVar(&l.on, "layerwise", false, "compare layer-wise sending with whole-room sending: every request runs twice (one room each way, one room at a time, alternating which goes first), each prefill rank running a modeled forward pass (--prefill-tflops or --prefill-layer-time) after the decode's destination is known; prints per request the compute, the handover (compute end → decode Success) and the TTFT proxy (compute start → decode Success), their medians and the targets")
	fs.Float64Var(&l.tflops, "prefill-tflops", 400, "with --layerwise: effective TFLOPS of one prefill rank (its layer's FLOPs over --prefill-tp ranks, from the model's shape and the prompt length: workload.ComputeShape)")
	fs.DurationVar(&l.layerTime, "prefill-layer-time", 0, "with --layerwise: a measured compute time per layer for every request instead of the FLOPs model (e.g. 4.8ms); 0 = the model")
	fs.IntVar(&l.tokens, "prompt-tokens", 0, "with --layerwise: every request's prompt length in tokens (0 = the workload's lengths)")
}

func (l *layerwiseFlags) validate(f *demoFlags) error {
	switch {
	case f.prefillPP > 1:
		return fmt.Errorf("--layerwise with --prefill-pp %d: the demo's compute model runs one pipeline stage (each PP stage sending its own layers is covered by the engine's tests); use --prefill-pp 1", f.prefillPP)
	case l.layerTime < 0 || l.layerTime > time.Minute:
		return fmt.Errorf("--prefill-layer-time %s: want 0 (the FLOPs model) … 1m", l.layerTime)
	case l.layerTime == 0 && (l.tflops <= 0 || l.tflops > 1e5):
		return fmt.Errorf("--prefill-tflops %g: want > 0 (effective TFLOPS of one prefill rank, e.g. 400 for an H100 at about 40%% of its bf16 peak), or give --prefill-layer-time", l.tflops)
	case l.tokens < 0:
		return fmt.Errorf("--prompt-tokens %d: want >= 1, or 0 for the workload's lengths", l.tokens)
	}
	return nil
}

// layerTimeFor is the modeled compute time of one layer for a prompt of
// tokens tokens on one prefill rank.
func (l *layerwiseFlags) layerTimeFor(shape workload.ComputeShape, tokens, tp int) time.Duration {
	if l.layerTime > 0 {
		return l.layerTime
	}
	return shape.LayerTime(tokens, l.tflops, tp)
}

// layerwiseSummary is what --layerwise reports, per mode and against each
// other.
type layerwiseSummary struct {
	Model     string `json:"model"`
	Layers    int    `json:"layers"`
	Transport string `json:"transport"`
	// ComputeModel says where the per-layer time came from.
	ComputeModel string  `json:"compute_model"`
	PrefillTP    int     `json:"prefill_tp"`
	DecodeTP     int     `json:"decode_tp"`
	ChunkPages   int     `json:"chunk_pages"`
	Requests     int     `json:"requests"`
	Failures     int     `json:"failures"`
	LoadStart    string  `json:"loadavg_start"`
	LoadEnd      string  `json:"loadavg_end"`
	CPUs         int     `json:"cpus"`
	Whole        modeSum `json:"whole_room"`
	Layer        modeSum `json:"layer_wise"`
	// OneLayerMS is the transfer time of one layer: the whole-room
	// handover median (the room's transfer after its compute) over the
	// layers.
	OneLayerMS float64 `json:"one_layer_transfer_ms"`
	// HandoverRatio is the layer-wise handover median over OneLayerMS
	// (target <= 1.5); TTFTRatio the layer-wise TTFT proxy median over the
	// whole-room one (target <= 0.6 at 4K tokens when transfer >= compute
	// / 2); TransferOverCompute the whole-room transfer over the compute
	// (medians); IdealTTFTRatio what perfect overlap would give:
	// (max(C,T) + min(C,T)/L) / (C + T).
	HandoverRatio       float64 `json:"handover_ratio"`
	TTFTRatio           float64 `json:"ttft_ratio"`
	TransferOverCompute float64 `json:"transfer_over_compute"`
	IdealTTFTRatio      float64 `json:"ideal_ttft_ratio"`
}

// modeSum is one mode's medians (and p99 of the handover), ms.
type modeSum struct {
	ComputeP50  float64 `json:"compute_p50_ms"`
	HandoverP50 float64 `json:"handover_p50_ms"`
	HandoverP99 float64 `json:"handover_p99_ms"`
	TTFTP50     float64 `json:"ttft_proxy_p50_ms"`
	TTFTP99     float64 `json:"ttft_proxy_p99_ms"`
}

// runLayerwiseDemo is runDemo for --layerwise.
func runLayerwiseDemo(ctx context.Context, f *demoFlags, p *demoPlan) error {
	if err := f.lw.validate(f); err != nil {
		return err
	}
	shape, err := workload.LookupCompute(f.model)
	if err != nil && f.lw.layerTime == 0 {
		return fmt.Errorf("--layerwise: %w", err)
	}
	// The same prompt twice in a row must not hit the decode's prefix
	// cache: every room sends its whole prompt.
	p.prefixBlocks, p.prefixNote = 0, "off with --layerwise (both rooms of a request send the whole prompt)"
	for i := range p.reqs {
		p.reqs[i].HashIDs = nil
		if f.lw.tokens > 0 {
			p.reqs[i].InputLength = f.lw.tokens
		}
	}
	rng := rand.New(rand.NewPCG(p.seed, 0x6c61796572))
	used := map[uint64]bool{}
	for _, r := range p.rooms {
		used[r] = true
	}
	rooms2 := make([]uint64, len(p.rooms))
	for i := range rooms2 {
		for rooms2[i] = rng.Uint64() >> 1; used[rooms2[i]]; rooms2[i] = rng.Uint64() >> 1 {
		}
		used[rooms2[i]] = true
	}
	p.announce(os.Stderr)
	if f.lw.tokens > 0 {
		fmt.Fprintf(os.Stderr, "kvxfer demo: --layerwise: every prompt is %d tokens (--prompt-tokens)\n", f.lw.tokens)
	}
	load0 := bench.ReadLoadAvg()
	c, err := startDemoCluster(ctx, f, p)
	if err != nil {
		return err
	}
	defer c.close()
	var results []demoResult
	for i, rq := range p.reqs {
		tokens := min(rq.InputLength, p.capTokens)
		lt := f.lw.layerTimeFor(shape, tokens, f.prefillTP)
		modes := []string{modeWhole, modeLayer}
		if i%2 == 1 {
			modes = []string{modeLayer, modeWhole}
		}
		for _, mode := range modes {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			room := p.rooms[i]
			if mode == modeLayer {
				room = rooms2[i]
			}
			res := c.runModeled(p, room, tokens, rq.InputLength > p.capTokens, mode, lt)
			res.Warmup = i < p.nWarm
			results = append(results, res)
		}
	}
	what := fmt.Sprintf("FLOPs model (workload.ComputeShape of %s: 2·T·%.3g weights + 2·T²·%d per layer) at %g TFLOPS per prefill rank over TP %d", shape.Name, shape.LayerParams, shape.AttnDim, f.lw.tflops, f.prefillTP)
	if f.lw.layerTime > 0 {
		what = fmt.Sprintf("--prefill-layer-time %s per layer for every request", f.lw.layerTime)
	}
	sum := layerwiseSummary{Model: p.model.Name, Layers: p.model.NumLayers, Transport: fmt.Sprint(c.transports), ComputeModel: what, PrefillTP: f.prefillTP,
		DecodeTP: f.decodeTP, ChunkPages: f.chunkPages, LoadStart: load0, LoadEnd: bench.ReadLoadAvg(), CPUs: runtime.NumCPU()}
	sum.tally(results)
	printLayerwise(os.Stdout, sum, results)
	if f.jsonOut != "" {
		b, _ := json.MarshalIndent(struct {
			Summary  layerwiseSummary `json:"summary"`
			Requests []demoResult     `json:"requests"`
		}{sum, results}, "", "  ")
		if err := os.WriteFile(f.jsonOut, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write --json %s: %w", f.jsonOut, err)
		}
	}
	if sum.Failures > 0 {
		return fmt.Errorf("%d of %d rooms failed", sum.Failures, 2*sum.Requests)
	}
	return nil
}

// runModeled runs one room with the compute model on every prefill rank,
// whole-room or layer-wise, and derives its compute, handover and TTFT.
func (c *demoCluster) runModeled(p *demoPlan, room uint64, tokens int, capped bool, mode string, layerTime time.Duration) demoResult {
	res := demoResult{Room: room, Tokens: tokens, Capped: capped, Mode: mode, OK: true}
	dq := requestLine{Room: room, Tokens: tokens}
	pq := dq
	pq.Layerwise, pq.LayerComputeUS = mode == modeLayer, max(layerTime.Microseconds(), 1)
	var chs []<-chan replyLine
	for _, ch := range c.decodes {
		chs = append(chs, ch.submit(dq))
	}
	for _, ch := range c.prefills {
		chs = append(chs, ch.submit(pq))
	}
	for k, ch := range chs {
		res.add(<-ch, k < len(c.decodes))
	}
	if res.OK && res.ComputeStartUnixNS > 0 && res.SuccessUnixNS > 0 {
		ms := func(a, b int64) float64 { return float64(b-a) / 1e6 }
		res.ComputeMS = ms(res.ComputeStartUnixNS, res.ComputeEndUnixNS)
		res.HandoverMS = ms(res.ComputeEndUnixNS, res.SuccessUnixNS)
		res.TTFTMS = ms(res.ComputeStartUnixNS, res.SuccessUnixNS)
	}
	return res
}

// tally fills the per-mode medians and the ratios from the timed rooms.
func (s *layerwiseSummary) tally(results []demoResult) {
	var comp, hand, ttft [2][]float64
	for _, r := range results {
		if r.Warmup {
			continue
		}
		k := 0
		if r.Mode == modeLayer {
			k = 1
			s.Requests++
		}
		if !r.OK {
			s.Failures++
			continue
		}
		comp[k], hand[k], ttft[k] = append(comp[k], r.ComputeMS), append(hand[k], r.HandoverMS), append(ttft[k], r.TTFTMS)
	}
	for k, m := range []*modeSum{&s.Whole, &s.Layer} {
		slices.Sort(comp[k])
		slices.Sort(hand[k])
		slices.Sort(ttft[k])
		m.ComputeP50, m.HandoverP50, m.HandoverP99 = percentile(comp[k], 50), percentile(hand[k], 50), percentile(hand[k], 99)
		m.TTFTP50, m.TTFTP99 = percentile(ttft[k], 50), percentile(ttft[k], 99)
	}
	if s.Layers > 0 && s.Whole.HandoverP50 > 0 {
		s.OneLayerMS = s.Whole.HandoverP50 / float64(s.Layers)
		s.HandoverRatio = s.Layer.HandoverP50 / s.OneLayerMS
	}
	if s.Whole.TTFTP50 > 0 {
		s.TTFTRatio = s.Layer.TTFTP50 / s.Whole.TTFTP50
	}
	if c, t := s.Whole.ComputeP50, s.Whole.HandoverP50; c > 0 && t > 0 && s.Layers > 0 {
		s.TransferOverCompute = t / c
		s.IdealTTFTRatio = (max(c, t) + min(c, t)/float64(s.Layers)) / (c + t)
	}
}

// verdict says whether a ratio met its target.
func verdict(ratio, target float64) string {
	switch {
	case ratio == 0:
		return "unmeasured"
	case ratio <= target:
		return "met"
	}
	return "missed"
}

func printLayerwise(w io.Writer, s layerwiseSummary, rs []demoResult) {
	fmt.Fprintf(w, "layer-wise vs whole-room: model %s (%d layers), prefill TP %d, decode TP %d, transport %s, chunk pages %d\n", s.Model, s.Layers, s.PrefillTP, s.DecodeTP, s.Transport, s.ChunkPages)
	fmt.Fprintf(w, "compute model: %s\n", s.ComputeModel)
	fmt.Fprintf(w, "load average %s at the start, %s at the end (%d CPUs)\n", s.LoadStart, s.LoadEnd, s.CPUs)
	fmt.Fprintf(w, "%-20s %7s %-10s %11s %12s %10s  %s\n", "room", "tokens", "mode", "compute_ms", "handover_ms", "ttft_ms", "")
	for _, r := range rs {
		note := ""
		switch {
		case r.Warmup:
			note = "warm-up (not counted)"
		case !r.OK:
			note = "FAILED: " + r.Error
		}
		fmt.Fprintf(w, "%-20d %7d %-10s %11.1f %12.1f %10.1f  %s\n", r.Room, r.Tokens, r.Mode, r.ComputeMS, r.HandoverMS, r.TTFTMS, note)
	}
	for _, m := range []struct {
		name string
		s    modeSum
	}{{modeWhole, s.Whole}, {modeLayer, s.Layer}} {
		fmt.Fprintf(w, "%-10s: compute p50 %.1f ms, handover p50 %.1f ms (p99 %.1f), TTFT proxy p50 %.1f ms (p99 %.1f)\n", m.name, m.s.ComputeP50, m.s.HandoverP50, m.s.HandoverP99, m.s.TTFTP50, m.s.TTFTP99)
	}
	fmt.Fprintf(w, "one layer's transfer ≈ whole-room handover p50 / %d layers = %.2f ms\n", s.Layers, s.OneLayerMS)
	fmt.Fprintf(w, "target handover p50 <= 1.5 × one layer: layer-wise handover / one layer = %.2f (%s)\n", s.HandoverRatio, verdict(s.HandoverRatio, 1.5))
	fmt.Fprintf(w, "target TTFT proxy <= 0.6 × whole-room (at 4K tokens, transfer >= compute/2): layer-wise / whole-room = %.2f (%s); here transfer/compute = %.2f, perfect overlap would give %.2f\n",
		s.TTFTRatio, verdict(s.TTFTRatio, 0.6), s.TransferOverCompute, s.IdealTTFTRatio)
	fmt.Fprintf(w, "rooms: %d requests × 2 modes, %d failed\n", s.Requests, s.Failures)
}
