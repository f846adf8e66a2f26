package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

type demoFlags struct {
	requests     int
	trace        string
	model        string
	prefillTP    int
	prefillPP    int
	decodeTP     int
	pageSize     int
	poolMB       int
	concurrency  int
	transport    string
	checksum     bool
	jsonOut      string
	seed         uint64
	timeout      time.Duration
	chunkPages   int
	noProgress   bool
	childLog     string
	device       string
	prefixMB     int
	authToken    string
	prefault     bool
	metadata     string
	metadataTTL  time.Duration
	fragment     bool
	bench        bool
	warmup       int
	otlpEndpoint string
	lw           layerwiseFlags
}

func init() {
	var f demoFlags
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "the main job: bootstrap + prefill + decode processes on loopback, N requests transferred and verified",
		Long: `Start an embedded bootstrap server, the prefill ranks (prefill-tp × prefill-pp
processes) and the decode ranks (decode-tp processes) of this binary on
loopback, and drive requests through them. Each request gets a random 63-bit
bootstrap_room; every prefill rank fills its source pages with a deterministic
pattern of (room, layer, token, head, offset), the decode ranks receive the
pages, verify the metadata record (room, commit word, CRC32C) and every byte,
and the demo prints a summary (requests, tokens, pages, bytes, prefix reuse,
throughput, write requests per room, transfer latency p50/p99, failures).
Exits non-zero if any request fails.

Throughput: "aggregate" is the KV bytes over the union of the requests'
transfer intervals (prefill first Send → Success; concurrent transfers
overlap), "per request" the bytes over the sum of the per-request transfer
times, "goodput" the bytes over the wall time (fill and verify included).
With --bench (the default) the demo then runs kvxfer bench on the transport
it used, at its effective write size (KV bytes per write request) and depth
(write requests per room and prefill rank), and prints the aggregate rate
over that figure: what the KV-room layer costs against the transport alone.
--fragment makes every rank's pool hand out pages in random order, as a
long-running server's does, so nothing coalesces (each page of each layer
buffer is one write: 4 KiB for Llama-3.1-8B at TP 8).

Every rank holds its KV as a serving engine does: one buffer per layer for K
and for V (one per layer for MLA) plus SGLang's aux buffers, built by the
workload package; an aux row travels with each request. Each decode rank keeps
a prefix cache (--prefix-cache-mb) of the 512-token blocks it received, keyed
by the requests' hash_ids chain, and asks the prefill only for the pages after
the longest prefix it holds (SGLang's decode_prefix_len); verification still
covers the whole prompt.

Workload: --trace FILE reads a Mooncake JSONL trace (timestamp, input_length,
output_length, hash_ids). --trace conversation or --trace synthetic names one of
the Mooncake FAST'25 traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces;
not in this repository): the file is read from $KVXFER_TRACE_DIR or
../shared/data/traces (from the working directory or beside the binary's
checkout) when there, and otherwise a workload of that trace's shape is
generated (its length distributions, arrivals and prefix sharing); the demo
says which. Without --trace a chat-like generator draws prompt lengths (mean
≈ 12k tokens) and hash_ids (a shared system-prompt block, half the prompts
continuing an earlier conversation). Prompts longer than one request may be
(the smallest rank's pool over --concurrency) are cut to that length, and the
demo says how many and why before it starts and in the summary.

While the ranks start, the demo shows how much of their KV buffers they have
prefaulted: a progress bar on a terminal, a line every 5 s otherwise.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runDemo(cmd.Context(), &f) },
	}
	fs := cmd.Flags()
	fs.IntVar(&f.requests, "requests", 6, "number of requests, >= 1 (with --trace: the first N of the trace; 0 = the whole trace, only with --trace)")
	fs.StringVar(&f.trace, "trace", "", "requests from a Mooncake-format JSONL trace: a file path, or conversation / synthetic, the Mooncake FAST'25 traces, read from $KVXFER_TRACE_DIR or ../shared/data/traces when there and otherwise generated with that trace's shape (lengths, arrivals, prefix sharing); empty: a chat-like generator")
	fs.StringVar(&f.model, "model", "llama-3.1-8b", "built-in model name or Hugging Face config.json path")
	fs.IntVar(&f.prefillTP, "prefill-tp", 1, "prefill attention-TP size (processes per PP stage)")
	fs.IntVar(&f.prefillPP, "prefill-pp", 1, "prefill pipeline-parallel size")
	fs.IntVar(&f.decodeTP, "decode-tp", 1, "decode attention-TP size (processes)")
	fs.IntVar(&f.pageSize, "page-size", workload.DefaultPageSize, "KV page size in tokens (>= 1)")
	fs.IntVar(&f.poolMB, "pool-mb", 2048, "KV pool per rank in MiB (caps the prompt length)")
	fs.IntVar(&f.concurrency, "concurrency", 2, "requests in flight at once")
	fs.StringVar(&f.transport, "transport", "auto", "data transport(s) every rank opens: auto (all usable; the prefill picks the highest priority both sides have), tcp, shm, cma, or a comma list")
	fs.BoolVar(&f.prefault, "prefault", true, "ranks make their host buffers resident when they register them, so the first request runs at the speed of the rest (--prefault=false shows the cold first request)")
	fs.BoolVar(&f.checksum, "checksum", false, "CRC32C over the transferred bytes, checked by the decode before Success (every byte is verified against the pattern anyway)")
	fs.StringVar(&f.jsonOut, "json", "", "write the summary and per-request results as JSON to this file")
	fs.Uint64Var(&f.seed, "seed", 0, "workload and room seed (0 = random)")
	fs.DurationVar(&f.timeout, "timeout", 120*time.Second, "per-request bootstrap and waiting timeout (> 0)")
	fs.IntVar(&f.chunkPages, "chunk-pages", 0, "prefill sends each request in chunks of this many pages (0 = one chunk)")
	fs.BoolVar(&f.noProgress, "no-progress", false, "no progress bar")
	fs.StringVar(&f.childLog, "child-log-level", "warn", "log level of the prefill/decode processes")
	fs.IntVar(&f.prefixMB, "prefix-cache-mb", 1024, "per decode rank, MiB of KV kept as a prefix cache of prompt blocks named by the workload's hash_ids (LRU): later requests ask the prefill only for the pages after the longest held prefix; 0 = off")
	fs.StringVar(&f.device, "device", "", "KV pools of every rank in host memory (empty) or on CUDA device cuda:N (patterns filled and verified through host copies; transports that cannot move device memory are not used)")
	fs.BoolVar(&f.fragment, "fragment", false, "every rank hands out KV pages in the random order of a warm server's free list (a request's pages are scattered over its pool, so each page of each layer buffer is its own write) instead of lowest first")
	fs.IntVar(&f.warmup, "warmup", 0, "run this many untimed requests first (verified, not counted in the summary): a fresh process's first transfers pay one-time costs (connections, kernel socket memory, on a VM the host backing its memory) that a warm server does not")
	fs.BoolVar(&f.bench, "bench", true, "after the requests, run kvxfer bench on the transport used at the demo's effective write size (KV bytes / write requests) and print the ratio of the demo's aggregate transfer rate to it (about 2 s)")
	fs.StringVar(&f.authToken, "bootstrap-auth-token", "", "run the bootstrap server with this bearer token required and give it to every rank (through their environment, not their command line); "+
		"default: env KVXFER_BOOTSTRAP_AUTH_TOKEN, then SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN; none: no authentication")
	addMetadataFlags(fs, &f.metadata, &f.metadataTTL)
	f.lw.add(fs)
	fs.StringVar(&f.otlpEndpoint, "otlp-endpoint", "", "every rank sends OpenTelemetry spans to this OTLP/HTTP endpoint (see kvxfer prefill --help); default: none (the children still honour OTEL_EXPORTER_OTLP_ENDPOINT)")
	rootCmd.AddCommand(cmd)
}

// demoResult is one request's outcome.
type demoResult struct {
	Room   uint64 `json:"room"`
	Tokens int    `json:"tokens"`
	Capped bool   `json:"capped,omitempty"`
	Pages  int    `json:"pages"`
	Bytes  uint64 `json:"bytes"`
	// SentBytes is the KV bytes the prefill ranks report sending (equal to
	// Bytes, the decode side's count, when the transfer is whole).
	SentBytes  uint64  `json:"sent_bytes"`
	TransferMS float64 `json:"transfer_ms"`
	// DecodeMS is the slowest decode rank's transfer (its TRANSFER → every
	// record accepted); BootstrapWaitMS the longest wait of a decode rank
	// before its TRANSFER (resolving and registering through the bootstrap
	// server), which DecodeMS does not include.
	DecodeMS        float64 `json:"decode_wait_ms"`
	BootstrapWaitMS float64 `json:"bootstrap_wait_ms,omitempty"`
	OK              bool    `json:"ok"`
	Error           string  `json:"error,omitempty"`
	// Interrupted marks a request a stop signal (Ctrl-C, SIGTERM) kept
	// from running or cut short (a rank refused or cancelled it while
	// draining): not counted as failed.
	Interrupted bool   `json:"interrupted,omitempty"`
	Transport   string `json:"transport,omitempty"`
	// PrefixTokens is the prompt tokens the decode already held (not sent);
	// SkippedBytes the KV bytes that saved (all decode ranks).
	PrefixTokens int    `json:"prefix_tokens,omitempty"`
	SkippedBytes uint64 `json:"skipped_bytes,omitempty"`
	// Writes is the KV write requests the prefill ranks made for the room
	// (one per run of pages contiguous on both sides per buffer);
	// ExtraWrites their other write requests (aux rows, state slots,
	// metadata records and commit words). Writes + ExtraWrites is what the
	// room adds to kvxfer_write_requests_total.
	Writes      int `json:"writes"`
	ExtraWrites int `json:"extra_writes"`
	// StartUnixNS and EndUnixNS bound the room's transfer over all prefill
	// ranks (earliest first Send, latest Success), Unix nanoseconds.
	StartUnixNS int64 `json:"start_unix_ns,omitempty"`
	EndUnixNS   int64 `json:"end_unix_ns,omitempty"`
	// Warmup marks an untimed warm-up request (--warmup).
	Warmup bool `json:"warmup,omitempty"`
	// DummyRanks are the prefill ranks ("tp1 pp0") that had nothing to
	// send for the room (MLA with prefill TP > decode TP: one latent KV per
	// token, written by one rank).
	DummyRanks []string `json:"dummy_ranks,omitempty"`
	// With --layerwise: Mode is "whole-room" or "layer-wise"; the compute
	// interval over the prefill ranks (earliest start, latest end) and the
	// decode ranks' latest Success (every record accepted), Unix ns; and
	// from them ComputeMS, HandoverMS (compute end → decode Success) and
	// TTFTMS (compute start → decode Success).
	Mode               string  `json:"mode,omitempty"`
	ComputeStartUnixNS int64   `json:"compute_start_unix_ns,omitempty"`
	ComputeEndUnixNS   int64   `json:"compute_end_unix_ns,omitempty"`
	SuccessUnixNS      int64   `json:"success_unix_ns,omitempty"`
	ComputeMS          float64 `json:"compute_ms,omitempty"`
	HandoverMS         float64 `json:"handover_ms,omitempty"`
	TTFTMS             float64 `json:"ttft_proxy_ms,omitempty"`
}

type demoSummary struct {
	Model      string   `json:"model"`
	PrefillTP  int      `json:"prefill_tp"`
	PrefillPP  int      `json:"prefill_pp"`
	DecodeTP   int      `json:"decode_tp"`
	PageSize   int      `json:"page_size"`
	Transports []string `json:"transports_offered"`
	Used       []string `json:"transports_used"`
	Checksum   bool     `json:"checksum"`
	CRC32CPath string   `json:"crc32c_path"`
	Workload   string   `json:"workload"`
	Requests   int      `json:"requests"`
	Verified   int      `json:"verified"`
	Failures   int      `json:"failures"`
	// Interrupted is the timed requests a stop signal kept from running or
	// cut short (demoResult.Interrupted), counted apart from Failures.
	Interrupted    int    `json:"interrupted"`
	CappedRequests int    `json:"capped_requests"`
	MaxTokens      int    `json:"max_tokens"`
	Tokens         int64  `json:"tokens"`
	Pages          int64  `json:"pages"`
	Bytes          uint64 `json:"bytes"`
	Fragment       bool   `json:"fragment"`
	// Warmup is the untimed requests run first; WarmupFailures how many of
	// them failed (the demo then fails).
	Warmup            int     `json:"warmup"`
	WarmupFailures    int     `json:"warmup_failures"`
	WarmupInterrupted int     `json:"warmup_interrupted"`
	WallSeconds       float64 `json:"wall_seconds"`
	GoodputGBps       float64 `json:"goodput_gbps"`
	// AggregateGBps is Bytes over TransferSeconds, the length of the union
	// of the verified requests' transfer intervals (1e9 B/s).
	AggregateGBps   float64 `json:"aggregate_transfer_gbps"`
	TransferSeconds float64 `json:"transfer_union_seconds"`
	// TransferGBps is the per-request figure: Bytes over the sum of the
	// per-request transfer times.
	TransferGBps float64 `json:"per_request_transfer_gbps"`
	// Writes is the KV write requests of the verified requests; WritesPerRoom
	// their mean per request; WriteBytes the effective write size (KV bytes
	// sent / Writes). ExtraWrites is their other write requests (aux rows,
	// state slots, metadata records, commit words): Writes + ExtraWrites is
	// what they added to kvxfer_write_requests_total (which also counts
	// warm-up and failed rooms' completed batches).
	Writes        int64   `json:"writes"`
	ExtraWrites   int64   `json:"extra_writes"`
	WritesPerRoom float64 `json:"writes_per_room"`
	WriteBytes    uint64  `json:"effective_write_bytes"`
	// Bench is kvxfer bench on the transport used at WriteBytes (BenchCase
	// names the case); BenchRatio = AggregateGBps / BenchGBps; BenchNote says
	// why it was not measured.
	BenchCase    string  `json:"bench_case,omitempty"`
	BenchGBps    float64 `json:"bench_gbps,omitempty"`
	BenchRatio   float64 `json:"bench_ratio,omitempty"`
	BenchNote    string  `json:"bench_note,omitempty"`
	LatencyP50MS float64 `json:"transfer_latency_p50_ms"`
	LatencyP99MS float64 `json:"transfer_latency_p99_ms"`
	LatencyMaxMS float64 `json:"transfer_latency_max_ms"`
	// PrefixCacheBlocks is each decode rank's prefix cache (512-token
	// blocks; 0 = off, PrefixNote says why); PrefixTokens the verified
	// requests' held prompt tokens; FullBytes the KV bytes full transfers
	// would have moved (Bytes + what the held prefixes saved).
	PrefixCacheBlocks int    `json:"prefix_cache_blocks"`
	PrefixNote        string `json:"prefix_note,omitempty"`
	PrefixTokens      int64  `json:"prefix_tokens"`
	FullBytes         uint64 `json:"full_bytes"`
	// FirstMS is the transfer latency of the first request submitted (the
	// cold one: connections, handshakes, first touch of the buffers), and
	// LaterP50MS the median of the others; 0 when not measured.
	FirstMS    float64 `json:"first_request_transfer_ms"`
	LaterP50MS float64 `json:"later_requests_transfer_p50_ms"`
	// Prefault is whether the ranks prefaulted their buffers (--prefault).
	Prefault bool `json:"prefault"`
	// CapNote says how many prompts were cut to MaxTokens and why ("" when
	// none was); CappedTokens is the prompt tokens the cut left out.
	CapNote      string `json:"cap_note,omitempty"`
	CappedTokens int64  `json:"capped_tokens"`
	// DummyRanks are the prefill ranks that were dummies (nothing to send:
	// MLA with prefill TP > decode TP) for the verified requests, and
	// WriterRanks those that wrote KV.
	DummyRanks  []string `json:"dummy_prefill_ranks,omitempty"`
	WriterRanks []string `json:"writer_prefill_ranks,omitempty"`
}

// runDemo runs the demo: its flags are checked (validateDemoFlags), the
// workload and its limits planned (planDemo), the bootstrap server and the
// ranks started (startDemoCluster), the requests driven through them
// (runRequests) and the results reported (report).
func runDemo(parent context.Context, f *demoFlags) error {
	if parent == nil {
		parent = context.Background()
	}
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := validateDemoFlags(f); err != nil {
		return err
	}
	plan, err := planDemo(f)
	if err != nil {
		return err
	}
	if f.lw.on {
		return runLayerwiseDemo(ctx, f, plan)
	}
	plan.announce(os.Stderr)
	c, err := startDemoCluster(ctx, f, plan)
	if err != nil {
		return err
	}
	defer c.close()
	results, wall := c.runRequests(ctx, f, plan)
	return c.report(ctx, f, plan, results, wall)
}

// demoPlan is what a validated demo runs: the model, how long one prompt
// may be, the decode's prefix cache, the requests (warm-up first) and
// their rooms.
type demoPlan struct {
	model workload.ModelConfig
	// capTokens is the longest prompt one request may have (the smallest
	// rank's pool over --concurrency); capWhy says so in words.
	capTokens int
	capWhy    string
	// prefixBlocks is each decode rank's prefix cache (0: off, prefixNote
	// says why).
	prefixBlocks int
	prefixNote   string
	seed         uint64
	// reqs are the requests, the nWarm warm-up ones first; workload
	// describes where they come from; rooms their bootstrap_rooms.
	reqs     []workload.Request
	nWarm    int
	workload string
	rooms    []uint64
}

// planDemo resolves the model, the prompt cap, the prefix cache and the
// workload (with its warm-up requests and random rooms).
func planDemo(f *demoFlags) (*demoPlan, error) {
	model, err := workload.LookupModel(f.model)
	if err != nil {
		return nil, err
	}
	p := &demoPlan{model: model, seed: f.seed}
	if p.seed == 0 {
		p.seed = rand.Uint64()
	}
	if err := p.planCap(f); err != nil {
		return nil, err
	}
	if err := p.planPrefix(f); err != nil {
		return nil, err
	}
	if p.reqs, p.workload, err = demoWorkload(f, p.seed); err != nil {
		return nil, err
	}
	// Warm-up requests: the first prompts' lengths again, without hash_ids
	// (they must not fill the decode's prefix cache for the timed ones).
	if f.warmup > 0 && len(p.reqs) > 0 {
		p.nWarm = f.warmup
		warm := make([]workload.Request, p.nWarm)
		for i := range warm {
			warm[i] = p.reqs[i%len(p.reqs)]
			warm[i].HashIDs = nil
		}
		p.reqs = append(warm, p.reqs...)
	}
	rng := rand.New(rand.NewPCG(p.seed, 0x726f6f6d))
	used := map[uint64]bool{}
	p.rooms = make([]uint64, len(p.reqs))
	for i := range p.rooms {
		for p.rooms[i] = rng.Uint64() >> 1; used[p.rooms[i]]; p.rooms[i] = rng.Uint64() >> 1 {
		}
		used[p.rooms[i]] = true
	}
	return p, nil
}

// planCap sets the longest prompt one request may have: the token capacity
// of the smallest rank's pool, shared by the requests in flight.
func (p *demoPlan) planCap(f *demoFlags) error {
	p.capTokens = 1 << 30
	for _, side := range []struct {
		name string
		o    workload.LayoutOptions
	}{
		{fmt.Sprintf("prefill rank (TP %d, PP %d)", f.prefillTP, f.prefillPP), workload.LayoutOptions{PageSize: f.pageSize, TPSize: f.prefillTP, PPSize: f.prefillPP}},
		{fmt.Sprintf("decode rank (TP %d)", f.decodeTP), workload.LayoutOptions{PageSize: f.pageSize, TPSize: f.decodeTP, PPSize: 1}},
	} {
		n, err := workload.PagesForBytes(p.model, side.o, uint64(f.poolMB)<<20)
		if err != nil {
			return err
		}
		if c := n * f.pageSize / f.concurrency; c < p.capTokens {
			p.capTokens = c
			p.capWhy = fmt.Sprintf("the --pool-mb %d of a %s of %s holds %d tokens, shared by --concurrency %d requests in flight",
				f.poolMB, side.name, p.model.Name, n*f.pageSize, f.concurrency)
		}
	}
	if p.capTokens < 1 {
		return fmt.Errorf("%s: less than one token per request; raise --pool-mb or lower --concurrency", p.capWhy)
	}
	return nil
}

// planPrefix sizes the decode's prefix cache: whole 512-token blocks
// (Mooncake hash_ids) within --prefix-cache-mb.
func (p *demoPlan) planPrefix(f *demoFlags) error {
	dl, err := workload.NewLayout(p.model, workload.LayoutOptions{PageSize: f.pageSize, TPSize: f.decodeTP, NumPages: 1})
	switch {
	case err != nil:
		return err
	case f.prefixMB == 0:
		p.prefixNote = "off (--prefix-cache-mb 0)"
	case workload.DefaultBlockTokens%f.pageSize != 0:
		p.prefixNote = fmt.Sprintf("off: --page-size %d does not divide the %d-token hash_ids blocks", f.pageSize, workload.DefaultBlockTokens)
	default:
		blockBytes := uint64(workload.DefaultBlockTokens/f.pageSize) * dl.ItemLen() * uint64(dl.NumBuffers())
		if p.prefixBlocks = int((uint64(f.prefixMB) << 20) / blockBytes); p.prefixBlocks == 0 {
			p.prefixNote = fmt.Sprintf("off: --prefix-cache-mb %d holds no %d-token block of %s (%d MiB)", f.prefixMB, workload.DefaultBlockTokens, p.model.Name, blockBytes>>20)
		}
	}
	return nil
}

// capped counts the timed prompts longer than capTokens and the prompt
// tokens the cap leaves out of a total.
func (p *demoPlan) capped() (n int, cut, total int64) {
	for _, r := range p.reqs[p.nWarm:] {
		total += int64(r.InputLength)
		if r.InputLength > p.capTokens {
			n++
			cut += int64(r.InputLength - p.capTokens)
		}
	}
	return n, cut, total
}

// capLine says how many prompts are cut and why ("" when none is).
func (p *demoPlan) capLine() string {
	n, cut, total := p.capped()
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("%d of %d prompts are longer than %d tokens and are cut to it (%d of their %d prompt tokens are not sent): %s; raise --pool-mb or lower --concurrency to send them whole",
		n, len(p.reqs)-p.nWarm, p.capTokens, cut, total, p.capWhy)
}

// announce tells, before anything starts, where the requests come from and
// how many are cut.
func (p *demoPlan) announce(w io.Writer) {
	fmt.Fprintf(w, "kvxfer demo: workload: %s\n", p.workload)
	if l := p.capLine(); l != "" {
		fmt.Fprintf(w, "kvxfer demo: %s\n", l)
	}
}

// traceDirs are where --trace conversation|synthetic looks for the
// Mooncake trace files: $KVXFER_TRACE_DIR, ../shared/data/traces from the
// working directory, and, for a binary in a checkout's bin/, the same
// beside that checkout (bin/kvxfer → ../../shared/data/traces).
func traceDirs() []string {
	dirs := []string{os.Getenv("KVXFER_TRACE_DIR"), filepath.Join("..", "shared", "data", "traces")}
	if exe, err := os.Executable(); err == nil && filepath.Base(filepath.Dir(exe)) == "bin" {
		dirs = append(dirs, filepath.Join(filepath.Dir(exe), "..", "..", "shared", "data", "traces"))
	}
	return dirs
}

// demoWorkload returns the demo's requests and what they are: a trace
// file, a named Mooncake trace (its file when found, else requests of its
// shape), or the chat-like generator.
func demoWorkload(f *demoFlags, seed uint64) ([]workload.Request, string, error) {
	if f.trace == "" {
		return workload.Generate(f.requests, seed, 64, 0), "generated chat-like (mean ≈ 12k tokens)", nil
	}
	tf, err := workload.ResolveTrace(f.trace, traceDirs())
	if err != nil {
		return nil, "", fmt.Errorf("--trace: %w", err)
	}
	if tf.Path != "" {
		reqs, err := workload.LoadMooncake(tf.Path, f.requests)
		if err != nil {
			return nil, "", err
		}
		what := "trace " + tf.Path
		if tf.Shape.Name != "" {
			what += " (the Mooncake FAST'25 " + tf.Shape.Name + " trace)"
		}
		return reqs, fmt.Sprintf("%s, %d requests", what, len(reqs)), nil
	}
	n := f.requests
	if n == 0 {
		n = tf.Shape.Requests
	}
	return workload.GenerateTrace(tf.Shape, n, seed), fmt.Sprintf("%d requests generated with the shape of the Mooncake %s trace (mean input %.0f tokens, output %.0f, %.0f%% of prompt blocks on a shared prefix): "+
		"%s was not found in %s; the real file is one of %s", n, tf.Shape.Name, tf.Shape.MeanInput, tf.Shape.MeanOutput, 100*tf.Shape.PrefixHit,
		tf.Shape.File, strings.Join(tf.Looked, ", "), workload.TraceSource), nil
}

// validateDemoFlags checks the demo's flags before any process starts, so a
// bad value gives one error naming the demo flag (not the children's).
func validateDemoFlags(f *demoFlags) error {
	switch {
	case f.prefillTP < 1 || f.prefillPP < 1 || f.decodeTP < 1:
		return fmt.Errorf("--prefill-tp %d, --prefill-pp %d, --decode-tp %d: each must be >= 1", f.prefillTP, f.prefillPP, f.decodeTP)
	case f.concurrency < 1:
		return fmt.Errorf("--concurrency %d: must be >= 1", f.concurrency)
	case f.requests < 0:
		return fmt.Errorf("--requests %d: must be >= 0 (0 = the whole trace, with --trace)", f.requests)
	case f.requests == 0 && f.trace == "":
		return fmt.Errorf("--requests 0 means the whole trace and needs --trace FILE; without a trace give --requests >= 1")
	case f.pageSize < 1:
		return fmt.Errorf("--page-size %d: must be >= 1 token (default %d)", f.pageSize, workload.DefaultPageSize)
	case f.poolMB < 1:
		return fmt.Errorf("--pool-mb %d: must be >= 1 MiB", f.poolMB)
	case f.timeout <= 0:
		return fmt.Errorf("--timeout %s: must be > 0 (the per-request bootstrap and waiting timeout, e.g. 120s)", f.timeout)
	case f.chunkPages < 0:
		return fmt.Errorf("--chunk-pages %d: must be >= 0 (0 = one chunk)", f.chunkPages)
	case f.prefixMB < 0:
		return fmt.Errorf("--prefix-cache-mb %d: must be >= 0 (0 = no prefix reuse)", f.prefixMB)
	case f.warmup < 0:
		return fmt.Errorf("--warmup %d: must be >= 0 (untimed requests before the measured ones)", f.warmup)
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(f.childLog)); err != nil {
		return fmt.Errorf("--child-log-level %q: want debug, info, warn or error", f.childLog)
	}
	if _, onDevice, err := parseDevice(f.device); err != nil {
		return err
	} else if onDevice {
		if err := cuda.Available(); err != nil {
			return fmt.Errorf("--device %s: CUDA is not usable on this host: %w (drop --device to keep the KV pools in host memory)", f.device, err)
		}
	}
	if err := checkOutputFile("--json", f.jsonOut); err != nil {
		return err
	}
	return checkTransportSpec(f.transport)
}

// checkTransportSpec checks a --transport value before ranks start: "auto"
// (or empty) needs one usable transport; a comma list may name only
// registered transports, each usable on this host.
func checkTransportSpec(spec string) error {
	known := transport.Transports()
	if spec == "" || spec == "auto" {
		var reasons []string
		for _, n := range known {
			err := transport.ProbeTransport(n)
			if err == nil {
				return nil
			}
			reasons = append(reasons, fmt.Sprintf("%s: %v", n, err))
		}
		return fmt.Errorf("--transport auto: no transport is usable on this host (%s)", strings.Join(reasons, "; "))
	}
	names, err := transport.ParseTransportList(spec)
	if err != nil {
		return fmt.Errorf("--transport: %w", err)
	}
	var usable []string
	for _, n := range known {
		if transport.ProbeTransport(n) == nil {
			usable = append(usable, n)
		}
	}
	for _, n := range names {
		if err := transport.ProbeTransport(n); err != nil {
			return fmt.Errorf("--transport %s: %v (usable here: %s; or use auto)", n, err, strings.Join(usable, ", "))
		}
	}
	return nil
}

// benchMaxWrite bounds the write size the demo benchmarks (its region is
// one batch of such writes, at most 128 MiB).
const benchMaxWrite = 64 << 20
