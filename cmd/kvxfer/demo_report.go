package main

// kvxfer demo's report: the summary, per-rank metrics, failed rooms'
// timelines and the ratio to kvxfer bench at the same write size.

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/debugsrv"
	"github.com/kvxfer/kvxfer/workload"
)

// report prints the demo's summary, every rank's metrics and the failed
// rooms' timelines (read from the ranks' debug servers before they stop),
// runs kvxfer bench at the demo's write size (--bench), writes --json, and
// returns an error when a request failed.
func (c *demoCluster) report(ctx context.Context, f *demoFlags, p *demoPlan, results []demoResult, wall time.Duration) error {
	sum := demoSummary{Model: p.model.Name, PrefillTP: f.prefillTP, PrefillPP: f.prefillPP, DecodeTP: f.decodeTP, PageSize: f.pageSize,
		Transports: c.transports, Checksum: f.checksum, CRC32CPath: engine.CRC32CPath(), Workload: p.workload, Requests: len(p.reqs),
		MaxTokens: p.capTokens, WallSeconds: wall.Seconds(), PrefixCacheBlocks: p.prefixBlocks, PrefixNote: p.prefixNote, Fragment: f.fragment,
		Warmup: p.nWarm, CapNote: p.capLine()}
	_, sum.CappedTokens, _ = p.capped()
	sum.tally(results, p.nWarm, wall, f.prefault)
	sum.prefillRoles(c.prefills, results)
	mctx, mcancel := context.WithTimeout(context.Background(), 10*time.Second)
	metrics := scrapeChildren(mctx, c.children)
	timelines := failedTimelines(mctx, c.children, results)
	mcancel()
	if f.bench {
		sum.BenchCase, sum.BenchGBps, sum.BenchNote = benchAt(ctx, sum, f, len(c.prefills))
		if sum.BenchGBps > 0 && sum.AggregateGBps > 0 {
			sum.BenchRatio = sum.AggregateGBps / sum.BenchGBps
		}
	} else {
		sum.BenchNote = "not run (--bench=false)"
	}
	printSummary(os.Stdout, sum, results)
	printMetrics(os.Stdout, metrics)
	printTimelines(os.Stdout, timelines)
	if f.jsonOut != "" {
		b, _ := json.MarshalIndent(struct {
			Summary  demoSummary    `json:"summary"`
			Requests []demoResult   `json:"requests"`
			Metrics  []childMetrics `json:"metrics"`
			// Timelines are the failed rooms' timelines on every rank.
			Timelines map[string][]engine.RoomTimeline `json:"failed_room_timelines,omitempty"`
		}{sum, results, metrics, timelines}, "", "  ")
		if err := os.WriteFile(f.jsonOut, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write --json %s: %w", f.jsonOut, err)
		}
	}
	return demoExitError(sum, results)
}

// demoExitError is the demo's outcome: nil when every request was verified;
// requests a stop signal kept from running are named as such, apart from
// those that failed transfer or verification.
func demoExitError(sum demoSummary, results []demoResult) error {
	if n := sum.Interrupted + sum.WarmupInterrupted; n > 0 {
		return fmt.Errorf("interrupted by a stop signal: %d of %d requests were not run or were cut short; %d failed transfer or verification",
			n, len(results), sum.Failures+sum.WarmupFailures)
	}
	if sum.Failures > 0 {
		return fmt.Errorf("%d of %d requests failed transfer or verification", sum.Failures, sum.Requests)
	}
	if sum.WarmupFailures > 0 {
		return fmt.Errorf("%d of %d warm-up requests failed transfer or verification", sum.WarmupFailures, sum.Warmup)
	}
	return nil
}

// prefillRoles records which prefill ranks wrote KV and which were
// dummies for the verified requests (a rank a dummy for some rooms and a
// writer for others is listed as a writer).
func (s *demoSummary) prefillRoles(prefills []*child, results []demoResult) {
	dummy := map[string]bool{}
	for _, r := range results {
		if r.OK {
			for _, d := range r.DummyRanks {
				dummy[d] = true
			}
		}
	}
	for _, c := range prefills {
		rank := strings.TrimPrefix(c.name, "prefill ")
		if dummy[rank] {
			s.DummyRanks = append(s.DummyRanks, rank)
		} else {
			s.WriterRanks = append(s.WriterRanks, rank)
		}
	}
}

// percentile returns the p-th percentile (nearest rank) of sorted xs.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	k := int(float64(len(xs))*p/100+0.999999) - 1
	return xs[max(0, min(k, len(xs)-1))]
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// interruptedNote is ", N interrupted (stop signal: not run or cut short)"
// when a stop signal interrupted n requests, else "".
func interruptedNote(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(", %d interrupted (stop signal: not run or cut short)", n)
}

func printSummary(w io.Writer, s demoSummary, rs []demoResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "model\t%s (prefill tp %d × pp %d → decode tp %d, page %d tokens)\n", s.Model, s.PrefillTP, s.PrefillPP, s.DecodeTP, s.PageSize)
	fmt.Fprintf(tw, "transport\t%s (offered %s); checksum %s (CRC32C available: %s)\n", strings.Join(s.Used, ","), strings.Join(s.Transports, ","), onOff(s.Checksum), strings.NewReplacer("(", "", ")", "").Replace(s.CRC32CPath))
	fmt.Fprintf(tw, "workload\t%s\n", s.Workload)
	if s.CapNote != "" {
		fmt.Fprintf(tw, "prompts cut\t%s\n", s.CapNote)
	} else {
		fmt.Fprintf(tw, "prompts cut\tnone (one request may have up to %d tokens)\n", s.MaxTokens)
	}
	if len(s.DummyRanks) > 0 {
		fmt.Fprintf(tw, "prefill ranks\t%s wrote the KV; %s: dummy (nothing to send: MLA keeps one latent KV per token, which one rank writes for a decode with fewer TP ranks)\n",
			strings.Join(s.WriterRanks, ", "), strings.Join(s.DummyRanks, ", "))
	}
	fmt.Fprintf(tw, "requests\t%d (%d verified, %d failed%s)\n", s.Requests, s.Verified, s.Failures, interruptedNote(s.Interrupted))
	if s.Warmup > 0 {
		fmt.Fprintf(tw, "warm-up\t%d requests first, verified, not counted below (%d failed%s)\n", s.Warmup, s.WarmupFailures, interruptedNote(s.WarmupInterrupted))
	}
	fmt.Fprintf(tw, "tokens\t%d\n", s.Tokens)
	fmt.Fprintf(tw, "pages\t%d (decode side)\n", s.Pages)
	fmt.Fprintf(tw, "bytes\t%d (%.2f GiB)\n", s.Bytes, float64(s.Bytes)/(1<<30))
	fmt.Fprintf(tw, "prefix reuse\t%s\n", prefixLine(s))
	fmt.Fprintf(tw, "wall time\t%.2f s\n", s.WallSeconds)
	fmt.Fprintf(tw, "GB/s\t%.2f aggregate transfer (bytes / union of the transfer intervals, %.2f s); %.2f per request (bytes / Σ per-request transfer time); %.2f goodput (bytes / wall, incl. fill + verify)\n",
		s.AggregateGBps, s.TransferSeconds, s.TransferGBps, s.GoodputGBps)
	fmt.Fprintf(tw, "writes\t%.1f KV write requests per room (%d in all; %s per write on average; pages %s) + %d for aux rows, state slots, metadata records and commit words = %d write requests (kvxfer_write_requests_total of these rooms)\n",
		s.WritesPerRoom, s.Writes, fmtBytes(s.WriteBytes), fragmentWord(s.Fragment), s.ExtraWrites, s.Writes+s.ExtraWrites)
	if s.BenchGBps > 0 {
		fmt.Fprintf(tw, "vs bench\t%.2f× aggregate over kvxfer bench %s: %.2f GB/s\n", s.BenchRatio, s.BenchCase, s.BenchGBps)
	} else {
		fmt.Fprintf(tw, "vs bench\t%s\n", s.BenchNote)
	}
	fmt.Fprintf(tw, "transfer latency\tp50 %.1f ms, p99 %.1f ms, max %.1f ms (prefill Send → Success)\n", s.LatencyP50MS, s.LatencyP99MS, s.LatencyMaxMS)
	if s.FirstMS > 0 && s.LaterP50MS > 0 {
		fmt.Fprintf(tw, "first request\t%.1f ms transfer, %.2f× the later requests' p50 %.1f ms (buffers prefaulted: %s)\n",
			s.FirstMS, s.FirstMS/s.LaterP50MS, s.LaterP50MS, onOff(s.Prefault))
	}
	fmt.Fprintf(tw, "failures\t%d\n", s.Failures)
	if n := s.Interrupted + s.WarmupInterrupted; n > 0 {
		fmt.Fprintf(tw, "interrupted\t%d (a stop signal kept them from running or cut them short; not failures)\n", n)
	}
	_ = tw.Flush()
	n := 0
	for _, r := range rs {
		if !r.OK && !r.Interrupted && n < 10 {
			what := "room"
			if r.Warmup {
				what = "warm-up room"
			}
			fmt.Fprintf(w, "FAILED %s %d (%d tokens): %s\n", what, r.Room, r.Tokens, r.Error)
			n++
		}
	}
}

// prefixLine is the summary's prefix-reuse line: held prompt tokens and the
// KV bytes sent against what full transfers would have sent.
func prefixLine(s demoSummary) string {
	if s.PrefixCacheBlocks == 0 {
		return s.PrefixNote
	}
	pct := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return 100 * a / b
	}
	return fmt.Sprintf("%d of %d prompt tokens already on the decode (%.1f%%; cache of %d blocks of %d tokens per decode rank); KV bytes sent %d (%.2f GiB) vs %d (%.2f GiB) for full transfers, %.1f%% saved",
		s.PrefixTokens, s.Tokens, pct(float64(s.PrefixTokens), float64(s.Tokens)), s.PrefixCacheBlocks, workload.DefaultBlockTokens,
		s.Bytes, float64(s.Bytes)/(1<<30), s.FullBytes, float64(s.FullBytes)/(1<<30), pct(float64(s.FullBytes-s.Bytes), float64(s.FullBytes)))
}

// unionNS returns the total length of the union of the intervals [a, b]
// (nanoseconds): overlapping transfers count once.
func unionNS(spans [][2]int64) int64 {
	spans = slices.Clone(spans)
	slices.SortFunc(spans, func(x, y [2]int64) int { return cmp.Compare(x[0], y[0]) })
	var total, end int64
	start := int64(0)
	for i, sp := range spans {
		switch {
		case i == 0:
			start, end = sp[0], sp[1]
		case sp[0] > end:
			total += end - start
			start, end = sp[0], sp[1]
		default:
			end = max(end, sp[1])
		}
	}
	if len(spans) > 0 {
		total += end - start
	}
	return total
}

func fragmentWord(on bool) string {
	if on {
		return "handed out in random order (--fragment)"
	}
	return "handed out lowest first (fresh pools; --fragment scatters them)"
}

// fmtBytes prints a byte count with a binary unit (4.0 KiB, 1.5 MiB).
func fmtBytes(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// benchAt runs kvxfer bench (bench.RunCase: two transport instances in this
// process, the same code as `kvxfer bench`) on the transport the demo used,
// with the demo's effective write size as the block size, the mean write
// requests per room and prefill rank as the depth (1..4096) and the demo's
// concurrency as batches in flight; 3 repetitions, median. It returns the
// case label and GB/s, or a note saying why it did not run.
func benchAt(ctx context.Context, s demoSummary, f *demoFlags, prefillRanks int) (string, float64, string) {
	switch {
	case f.device != "":
		return "", 0, "not run: --device (kvxfer bench moves host memory)"
	case len(s.Used) != 1 || strings.Contains(s.Used[0], ","):
		return "", 0, fmt.Sprintf("not run: the requests used %d transport sets %v, not one transport", len(s.Used), s.Used)
	case s.Writes == 0 || s.WriteBytes == 0:
		return "", 0, "not run: no verified request wrote KV"
	case s.WriteBytes > benchMaxWrite:
		return "", 0, fmt.Sprintf("not run: effective write size %s is over %s", fmtBytes(s.WriteBytes), fmtBytes(benchMaxWrite))
	}
	depth := int(math.Round(s.WritesPerRoom / float64(max(prefillRanks, 1))))
	depth = min(max(depth, 1), 4096)
	cfg := bench.DefaultConfig()
	cfg.Transports, cfg.BlockSizes, cfg.Depths, cfg.Streams = []string{s.Used[0]}, []uint64{s.WriteBytes}, []int{depth}, []int{0}
	cfg.Inflight, cfg.Reps, cfg.Memcpy = f.concurrency, 3, false
	c := cfg.Cases()[0]
	if err := transport.ProbeTransport(c.Transport); err != nil {
		return "", 0, fmt.Sprintf("not run: %s: %v", c.Transport, err)
	}
	label := fmt.Sprintf("(%s, %s writes, depth %d, %d in flight)", c.Transport, fmtBytes(s.WriteBytes), depth, c.Inflight)
	res := bench.RunCase(ctx, cfg, c)
	switch {
	case res.Err != "":
		return label, 0, "bench failed: " + res.Err
	case res.VerifyErr != "":
		return label, 0, "bench verification failed: " + res.VerifyErr
	}
	return label, res.GBps.Median, ""
}

// childMetrics is one rank's kvxfer_* series at the end of the demo.
type childMetrics struct {
	Rank    string             `json:"rank"`
	Addr    string             `json:"addr"`
	Samples map[string]float64 `json:"samples,omitempty"`
	Error   string             `json:"error,omitempty"`
}

func scrapeChildren(ctx context.Context, children []*child) []childMetrics {
	out := make([]childMetrics, len(children))
	var wg sync.WaitGroup
	for i, c := range children {
		out[i] = childMetrics{Rank: c.name, Addr: c.metrics}
		if c.metrics == "" {
			out[i].Error = "the rank reported no metrics address"
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := scrapeMetrics(ctx, c.metrics)
			if err != nil {
				out[i].Error = err.Error()
				return
			}
			out[i].Samples = s
		}()
	}
	wg.Wait()
	return out
}

// printMetrics prints one line per rank from its scraped metrics: rooms by
// outcome, bytes written and batches.
func printMetrics(w io.Writer, ms []childMetrics) {
	for _, m := range ms {
		if m.Error != "" {
			fmt.Fprintf(w, "metrics %s: %s\n", m.Rank, m.Error)
			continue
		}
		s := m.Samples
		line := fmt.Sprintf("metrics %s (%s/metrics): rooms %g ok, %g failed", m.Rank, m.Addr,
			sumSeries(s, engine.MetricRooms, `state="success"`), sumSeries(s, engine.MetricRooms, `state="failed"`))
		if b := sumSeries(s, engine.MetricBytes); b > 0 {
			line += fmt.Sprintf("; %.0f bytes in %g write requests (KV, aux, state, records; warm-up rooms included), %g batches", b, sumSeries(s, engine.MetricWriteRequests), sumSeries(s, engine.MetricBatches))
		}
		if b := sumSeries(s, engine.MetricReceivedBytes); b > 0 {
			line += fmt.Sprintf("; %.0f bytes received", b)
		}
		fmt.Fprintln(w, line)
	}
}

// failedTimelines fetches, for the failed rooms (at most 10), every rank's
// timeline of the room: "room N" → one timeline per rank that has it.
func failedTimelines(ctx context.Context, children []*child, results []demoResult) map[string][]engine.RoomTimeline {
	out := map[string][]engine.RoomTimeline{}
	n := 0
	for _, r := range results {
		if r.OK || r.Interrupted || n >= 10 {
			continue
		}
		n++
		for _, c := range children {
			if c.metrics == "" {
				continue
			}
			if tl, ok, err := debugsrv.Fetch(ctx, c.metrics, r.Room); err == nil && ok {
				k := fmt.Sprintf("room %d", r.Room)
				out[k] = append(out[k], tl)
			}
		}
	}
	return out
}

func printTimelines(w io.Writer, tls map[string][]engine.RoomTimeline) {
	keys := make([]string, 0, len(tls))
	for k := range tls {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "timeline of %s:\n", k)
		for _, tl := range tls[k] {
			fmt.Fprintf(w, "  %s\n", tl)
		}
	}
}

// tally marks the first nWarm results as warm-up (counting their failures)
// and fills s's counts, bytes, prefix reuse, writes and latency figures from
// the rest; wall is the run's wall time.
func (s *demoSummary) tally(results []demoResult, nWarm int, wall time.Duration, prefault bool) {
	for i := range results[:nWarm] {
		results[i].Warmup = true
		switch {
		case results[i].Interrupted:
			s.WarmupInterrupted++
		case !results[i].OK:
			s.WarmupFailures++
		}
	}
	s.Requests -= nWarm
	var lats, later []float64
	var latSum float64
	var spans [][2]int64
	var sentBytes uint64
	for i, r := range results[nWarm:] {
		if r.Capped {
			s.CappedRequests++
		}
		if r.Transport != "" && !slices.Contains(s.Used, r.Transport) {
			s.Used = append(s.Used, r.Transport)
		}
		if r.Interrupted {
			s.Interrupted++
			continue
		}
		if !r.OK {
			s.Failures++
			continue
		}
		s.Verified++
		s.Tokens += int64(r.Tokens)
		s.Pages += int64(r.Pages)
		s.Bytes += r.Bytes
		s.PrefixTokens += int64(r.PrefixTokens)
		s.FullBytes += r.Bytes + r.SkippedBytes
		s.Writes += int64(r.Writes)
		s.ExtraWrites += int64(r.ExtraWrites)
		sentBytes += r.SentBytes
		lats = append(lats, r.TransferMS)
		latSum += r.TransferMS
		if i == 0 {
			s.FirstMS = r.TransferMS
		} else {
			later = append(later, r.TransferMS)
		}
		if r.EndUnixNS > r.StartUnixNS {
			spans = append(spans, [2]int64{r.StartUnixNS, r.EndUnixNS})
		}
	}
	s.TransferSeconds = float64(unionNS(spans)) / 1e9
	if s.TransferSeconds > 0 {
		s.AggregateGBps = float64(s.Bytes) / s.TransferSeconds / 1e9
	}
	if s.Verified > 0 {
		s.WritesPerRoom = float64(s.Writes) / float64(s.Verified)
	}
	if s.Writes > 0 {
		s.WriteBytes = sentBytes / uint64(s.Writes)
	}
	slices.Sort(later)
	s.LaterP50MS, s.Prefault = percentile(later, 50), prefault
	slices.Sort(lats)
	s.LatencyP50MS, s.LatencyP99MS = percentile(lats, 50), percentile(lats, 99)
	if len(lats) > 0 {
		s.LatencyMaxMS = lats[len(lats)-1]
	}
	s.GoodputGBps = float64(s.Bytes) / wall.Seconds() / 1e9
	if latSum > 0 {
		s.TransferGBps = float64(s.Bytes) / (latSum / 1000) / 1e9
	}
}
