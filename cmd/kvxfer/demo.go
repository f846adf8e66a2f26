package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine"
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
output_length, hash_ids); without it a chat-like generator draws prompt
lengths (mean ≈ 12k tokens) and hash_ids (a shared system-prompt block, half
the prompts continuing an earlier conversation). Prompts longer than the pools
allow are capped.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runDemo(cmd.Context(), &f) },
	}
	fs := cmd.Flags()
	fs.IntVar(&f.requests, "requests", 6, "number of requests, >= 1 (with --trace: the first N of the trace; 0 = the whole trace, only with --trace)")
	fs.StringVar(&f.trace, "trace", "", "Mooncake-format JSONL trace (e.g. ../shared/data/traces/conversation_trace.jsonl)")
	fs.StringVar(&f.model, "model", "llama-3.1-8b", "built-in model name or Hugging Face config.json path")
	fs.IntVar(&f.prefillTP, "prefill-tp", 1, "prefill attention-TP size (processes per PP stage)")
	fs.IntVar(&f.prefillPP, "prefill-pp", 1, "prefill pipeline-parallel size")
	fs.IntVar(&f.decodeTP, "decode-tp", 1, "decode attention-TP size (processes)")
	fs.IntVar(&f.pageSize, "page-size", workload.DefaultPageSize, "KV page size in tokens (>= 1)")
	fs.IntVar(&f.poolMB, "pool-mb", 2048, "KV pool per rank in MiB (caps the prompt length)")
	fs.IntVar(&f.concurrency, "concurrency", 2, "requests in flight at once")
	fs.StringVar(&f.transport, "transport", "auto", "data transport(s) every rank opens: auto (all usable; the prefill picks the highest priority both sides have), tcp, shm, or a comma list")
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
	DecodeMS   float64 `json:"decode_wait_ms"`
	OK         bool    `json:"ok"`
	Error      string  `json:"error,omitempty"`
	Transport  string  `json:"transport,omitempty"`
	// PrefixTokens is the prompt tokens the decode already held (not sent);
	// SkippedBytes the KV bytes that saved (all decode ranks).
	PrefixTokens int    `json:"prefix_tokens,omitempty"`
	SkippedBytes uint64 `json:"skipped_bytes,omitempty"`
	// Writes is the KV write requests the prefill ranks made for the room
	// (one per run of pages contiguous on both sides per buffer).
	Writes int `json:"writes"`
	// StartUnixNS and EndUnixNS bound the room's transfer over all prefill
	// ranks (earliest first Send, latest Success), Unix nanoseconds.
	StartUnixNS int64 `json:"start_unix_ns,omitempty"`
	EndUnixNS   int64 `json:"end_unix_ns,omitempty"`
	// Warmup marks an untimed warm-up request (--warmup).
	Warmup bool `json:"warmup,omitempty"`
}

type demoSummary struct {
	Model          string   `json:"model"`
	PrefillTP      int      `json:"prefill_tp"`
	PrefillPP      int      `json:"prefill_pp"`
	DecodeTP       int      `json:"decode_tp"`
	PageSize       int      `json:"page_size"`
	Transports     []string `json:"transports_offered"`
	Used           []string `json:"transports_used"`
	Checksum       bool     `json:"checksum"`
	CRC32CPath     string   `json:"crc32c_path"`
	Workload       string   `json:"workload"`
	Requests       int      `json:"requests"`
	Verified       int      `json:"verified"`
	Failures       int      `json:"failures"`
	CappedRequests int      `json:"capped_requests"`
	MaxTokens      int      `json:"max_tokens"`
	Tokens         int64    `json:"tokens"`
	Pages          int64    `json:"pages"`
	Bytes          uint64   `json:"bytes"`
	Fragment       bool     `json:"fragment"`
	// Warmup is the untimed requests run first; WarmupFailures how many of
	// them failed (the demo then fails).
	Warmup         int     `json:"warmup"`
	WarmupFailures int     `json:"warmup_failures"`
	WallSeconds    float64 `json:"wall_seconds"`
	GoodputGBps    float64 `json:"goodput_gbps"`
	// AggregateGBps is Bytes over TransferSeconds, the length of the union
	// of the verified requests' transfer intervals (1e9 B/s).
	AggregateGBps   float64 `json:"aggregate_transfer_gbps"`
	TransferSeconds float64 `json:"transfer_union_seconds"`
	// TransferGBps is the per-request figure: Bytes over the sum of the
	// per-request transfer times.
	TransferGBps float64 `json:"per_request_transfer_gbps"`
	// Writes is the KV write requests of the verified requests; WritesPerRoom
	// their mean per request; WriteBytes the effective write size (KV bytes
	// sent / Writes).
	Writes        int64   `json:"writes"`
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
}

func runDemo(parent context.Context, f *demoFlags) error {
	if parent == nil {
		parent = context.Background()
	}
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := validateDemoFlags(f); err != nil {
		return err
	}
	if _, onDevice, err := parseDevice(f.device); err != nil {
		return err
	} else if onDevice {
		if err := cuda.Available(); err != nil {
			return fmt.Errorf("--device %s: CUDA is not usable on this host: %w (drop --device to keep the KV pools in host memory)", f.device, err)
		}
	}
	model, err := workload.LookupModel(f.model)
	if err != nil {
		return err
	}
	// Token capacity of the smallest pool, shared by the requests in flight.
	capTokens := 1 << 30
	for _, o := range []workload.LayoutOptions{
		{PageSize: f.pageSize, TPSize: f.prefillTP, PPSize: f.prefillPP},
		{PageSize: f.pageSize, TPSize: f.decodeTP, PPSize: 1},
	} {
		n, err := workload.PagesForBytes(model, o, uint64(f.poolMB)<<20)
		if err != nil {
			return err
		}
		capTokens = min(capTokens, n*f.pageSize/f.concurrency)
	}
	if capTokens < 1 {
		return fmt.Errorf("--pool-mb %d is too small for %s at concurrency %d", f.poolMB, model.Name, f.concurrency)
	}
	// The decode's prefix cache: whole 512-token blocks (Mooncake hash_ids).
	prefixBlocks, prefixNote := 0, ""
	switch dl, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: f.pageSize, TPSize: f.decodeTP, NumPages: 1}); {
	case err != nil:
		return err
	case f.prefixMB == 0:
		prefixNote = "off (--prefix-cache-mb 0)"
	case workload.DefaultBlockTokens%f.pageSize != 0:
		prefixNote = fmt.Sprintf("off: --page-size %d does not divide the %d-token hash_ids blocks", f.pageSize, workload.DefaultBlockTokens)
	default:
		blockBytes := uint64(workload.DefaultBlockTokens/f.pageSize) * dl.ItemLen() * uint64(dl.NumBuffers())
		if prefixBlocks = int((uint64(f.prefixMB) << 20) / blockBytes); prefixBlocks == 0 {
			prefixNote = fmt.Sprintf("off: --prefix-cache-mb %d holds no %d-token block of %s (%d MiB)", f.prefixMB, workload.DefaultBlockTokens, model.Name, blockBytes>>20)
		}
	}
	seed := f.seed
	if seed == 0 {
		seed = rand.Uint64()
	}
	var reqs []workload.Request
	wl := "generated chat-like (mean ≈ 12k tokens)"
	if f.trace != "" {
		if reqs, err = workload.LoadMooncake(f.trace, f.requests); err != nil {
			return err
		}
		wl = "trace " + f.trace
	} else {
		reqs = workload.Generate(f.requests, seed, 64, 0)
	}
	// Warm-up requests: the first prompts' lengths again, without hash_ids
	// (they must not fill the decode's prefix cache for the timed ones).
	nWarm := 0
	if f.warmup > 0 && len(reqs) > 0 {
		nWarm = f.warmup
		warm := make([]workload.Request, nWarm)
		for i := range warm {
			warm[i] = reqs[i%len(reqs)]
			warm[i].HashIDs = nil
		}
		reqs = append(warm, reqs...)
	}
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}

	// Bootstrap server.
	token := bootstrapToken(f.authToken, os.Getenv)
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0, AuthToken: token})
	sctx, cancelSrv := context.WithCancel(context.Background())
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Start(sctx) }()
	defer func() { cancelSrv(); <-srvDone }()
	select {
	case <-srv.Ready():
	case err := <-srvDone:
		return fmt.Errorf("bootstrap server: %w", err)
	}
	addr := srv.Addr()
	store, err := openMetadata(ctx, f.metadata, f.metadataTTL)
	if err != nil {
		return err
	}
	if store != nil {
		defer store.Close()
		pctx, stopPub := context.WithCancel(context.Background())
		pubDone := make(chan struct{})
		go func() { defer close(pubDone); store.PublishInstanceLoop(pctx, addr, srv.Snapshot, 0, 0) }()
		defer func() { stopPub(); <-pubDone }()
	}

	rankSeed := func(i int) []string { // distinct, non-zero free-list seeds per rank
		if !f.fragment {
			return nil
		}
		return []string{"--fragment-seed", strconv.FormatUint(seed*0x9e3779b97f4a7c15+uint64(i)+1|1, 10)}
	}
	common := []string{"--log-level", f.childLog, "--model", f.model, "--page-size", strconv.Itoa(f.pageSize),
		"--pool-mb", strconv.Itoa(f.poolMB), "--transport", f.transport, "--bootstrap", addr,
		"--bootstrap-timeout", f.timeout.String(), "--waiting-timeout", f.timeout.String(), "--prefault=" + strconv.FormatBool(f.prefault),
		"--metrics-addr", "127.0.0.1:0"}
	if f.otlpEndpoint != "" {
		common = append(common, "--otlp-endpoint", f.otlpEndpoint)
	}
	if f.device != "" {
		common = append(common, "--device", f.device)
	}
	var childEnv []string
	if store != nil {
		// Through the environment: the URL may carry credentials one day.
		childEnv = append(childEnv, metadataEnv+"="+f.metadata)
		common = append(common, "--metadata-ttl", f.metadataTTL.String())
	}
	if token != "" {
		childEnv = append(childEnv, "KVXFER_BOOTSTRAP_AUTH_TOKEN="+token)
	}
	var children, prefills, decodes []*child
	defer func() {
		var wg sync.WaitGroup
		for _, c := range children {
			wg.Add(1)
			go func() { defer wg.Done(); c.stop(10 * time.Second) }()
		}
		wg.Wait()
	}()
	for tp := 0; tp < f.prefillTP; tp++ {
		for pp := 0; pp < f.prefillPP; pp++ {
			args := append([]string{"prefill"}, common...)
			args = append(args, "--tp-size", strconv.Itoa(f.prefillTP), "--tp-rank", strconv.Itoa(tp),
				"--pp-size", strconv.Itoa(f.prefillPP), "--pp-rank", strconv.Itoa(pp), "--chunk-pages", strconv.Itoa(f.chunkPages))
			args = append(args, rankSeed(len(children))...)
			c, err := startChild(exe, fmt.Sprintf("prefill tp%d pp%d", tp, pp), args, childEnv)
			if err != nil {
				return err
			}
			children = append(children, c)
			prefills = append(prefills, c)
		}
	}
	for tp := 0; tp < f.decodeTP; tp++ {
		args := append([]string{"decode"}, common...)
		args = append(args, "--tp-size", strconv.Itoa(f.decodeTP), "--tp-rank", strconv.Itoa(tp), "--verify", "--checksum="+strconv.FormatBool(f.checksum))
		args = append(args, rankSeed(len(children))...)
		if prefixBlocks > 0 {
			args = append(args, "--prefix-cache-blocks", strconv.Itoa(prefixBlocks), "--prefix-block-tokens", strconv.Itoa(workload.DefaultBlockTokens))
		}
		c, err := startChild(exe, fmt.Sprintf("decode tp%d", tp), args, childEnv)
		if err != nil {
			return err
		}
		children = append(children, c)
		decodes = append(decodes, c)
	}
	transports, err := waitReady(ctx, f, children)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "kvxfer demo: bootstrap %s; %d prefill rank(s) (tp %d × pp %d), %d decode rank(s); model %s; %d requests; transports %v\n",
		addr, len(prefills), f.prefillTP, f.prefillPP, len(decodes), model.Name, len(reqs), transports)

	var bar *progressbar.ProgressBar
	// No bar when stderr is not a terminal (make demo > log, CI): its \r
	// frames would fill the log and run into the summary.
	if !f.noProgress && term.IsTerminal(int(os.Stderr.Fd())) {
		bar = progressbar.NewOptions(len(reqs), progressbar.OptionSetWriter(os.Stderr), progressbar.OptionSetDescription("transfer+verify"),
			progressbar.OptionShowCount(), progressbar.OptionSetWidth(30), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
	}
	rng := rand.New(rand.NewPCG(seed, 0x726f6f6d))
	results := make([]demoResult, len(reqs))
	used := map[uint64]bool{}
	rooms := make([]uint64, len(reqs))
	for i := range rooms {
		for {
			r := rng.Uint64() >> 1
			if !used[r] {
				used[r] = true
				rooms[i] = r
				break
			}
		}
	}
	sem := make(chan struct{}, f.concurrency)
	var decodeOrder sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for i, rq := range reqs {
		if i == nWarm && nWarm > 0 {
			wg.Wait() // the timed requests start on a warm system
			start = time.Now()
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			results[i] = demoResult{Room: rooms[i], Error: "interrupted"}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			tokens := rq.InputLength
			res := demoResult{Room: rooms[i], Tokens: min(tokens, capTokens), Capped: tokens > capTokens}
			q := requestLine{Room: rooms[i], Tokens: res.Tokens}
			var chs []<-chan replyLine
			dq := q
			if prefixBlocks > 0 {
				dq.HashIDs = rq.HashIDs
			}
			// Every decode rank sees the requests in the same order, so
			// their prefix caches decide alike (as SGLang's TP ranks do).
			decodeOrder.Lock()
			for _, c := range decodes {
				chs = append(chs, c.submit(dq))
			}
			decodeOrder.Unlock()
			for _, c := range prefills {
				chs = append(chs, c.submit(q))
			}
			res.OK = true
			for k, ch := range chs {
				r := <-ch
				if !r.OK {
					res.OK = false
					if res.Error == "" {
						res.Error = fmt.Sprintf("%s tp%d pp%d: %s", r.Role, r.TPRank, r.PPRank, r.Error)
					}
				}
				if k < len(decodes) {
					res.Bytes += r.Bytes
					res.SkippedBytes += r.SkippedBytes
					res.PrefixTokens = max(res.PrefixTokens, r.PrefixTokens)
					res.Pages += r.Pages
					res.DecodeMS = max(res.DecodeMS, float64(r.TransferUS)/1000)
				} else {
					res.SentBytes += r.Bytes
					res.Writes += r.Writes
					if !r.Dummy && r.StartUnixNS > 0 {
						if res.StartUnixNS == 0 || r.StartUnixNS < res.StartUnixNS {
							res.StartUnixNS = r.StartUnixNS
						}
						res.EndUnixNS = max(res.EndUnixNS, r.EndUnixNS)
					}
					if !r.Dummy {
						res.TransferMS = max(res.TransferMS, float64(r.TransferUS)/1000)
						if len(r.Transports) > 0 {
							res.Transport = strings.Join(r.Transports, ",")
						}
					}
				}
			}
			results[i] = res
			if bar != nil {
				_ = bar.Add(1)
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	if bar != nil {
		_ = bar.Finish()
	}

	sum := demoSummary{Model: model.Name, PrefillTP: f.prefillTP, PrefillPP: f.prefillPP, DecodeTP: f.decodeTP, PageSize: f.pageSize,
		Transports: transports, Checksum: f.checksum, CRC32CPath: engine.CRC32CPath(), Workload: wl, Requests: len(reqs),
		MaxTokens: capTokens, WallSeconds: wall.Seconds(), PrefixCacheBlocks: prefixBlocks, PrefixNote: prefixNote, Fragment: f.fragment,
		Warmup: nWarm}
	sum.tally(results, nWarm, wall, f.prefault)
	// Every rank's engine metrics and, for failed rooms, both sides'
	// timelines, read from the children's debug servers before they stop.
	mctx, mcancel := context.WithTimeout(context.Background(), 10*time.Second)
	metrics := scrapeChildren(mctx, children)
	timelines := failedTimelines(mctx, children, results)
	mcancel()
	if f.bench {
		nPrefill := len(prefills)
		sum.BenchCase, sum.BenchGBps, sum.BenchNote = benchAt(ctx, sum, f, nPrefill)
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
	if sum.Failures > 0 {
		return fmt.Errorf("%d of %d requests failed transfer or verification", sum.Failures, sum.Requests)
	}
	if sum.WarmupFailures > 0 {
		return fmt.Errorf("%d of %d warm-up requests failed transfer or verification", sum.WarmupFailures, sum.Warmup)
	}
	return nil
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
	return checkTransportSpec(f.transport)
}

// checkTransportSpec checks a --transport value before ranks start: "auto"
// (or empty) needs one usable transport; a comma list may name only
// registered transports, each usable on this host.
func checkTransportSpec(spec string) error {
	known := engine.Transports()
	if spec == "" || spec == "auto" {
		var reasons []string
		for _, n := range known {
			err := engine.ProbeTransport(n)
			if err == nil {
				return nil
			}
			reasons = append(reasons, fmt.Sprintf("%s: %v", n, err))
		}
		return fmt.Errorf("--transport auto: no transport is usable on this host (%s)", strings.Join(reasons, "; "))
	}
	names, err := engine.ParseTransportList(spec)
	if err != nil {
		return fmt.Errorf("--transport: %w", err)
	}
	var usable []string
	for _, n := range known {
		if engine.ProbeTransport(n) == nil {
			usable = append(usable, n)
		}
	}
	for _, n := range names {
		if err := engine.ProbeTransport(n); err != nil {
			return fmt.Errorf("--transport %s: %v (usable here: %s; or use auto)", n, err, strings.Join(usable, ", "))
		}
	}
	return nil
}

// benchMaxWrite bounds the write size the demo benchmarks (its region is
// one batch of such writes, at most 128 MiB).
const benchMaxWrite = 64 << 20

// waitReady waits for every rank's ready line (recording its metrics
// address) and returns the transports the last one opened. Prefaulting
// makes every page of the pools resident and warm before a rank is ready
// (about one memory pass per rank: well under a second per GiB on bare
// metal, much longer in some VMs), so with --prefault it allows 10 minutes
// and says why after 15 s; else 60 s.
func waitReady(ctx context.Context, f *demoFlags, children []*child) ([]string, error) {
	var transports []string
	readyLimit := 60 * time.Second
	if f.prefault {
		readyLimit = 10 * time.Minute
	}
	slow := time.NewTimer(15 * time.Second)
	defer slow.Stop()
	deadline := time.NewTimer(readyLimit)
	defer deadline.Stop()
	for _, c := range children {
		var r replyLine
		for ready := false; !ready; {
			select {
			case r = <-c.ready:
				ready = true
			case <-slow.C:
				if f.prefault {
					fmt.Fprintf(os.Stderr, "kvxfer demo: ranks still starting: each prefaults its %d MiB of KV buffers so the first request runs at the later ones' speed (--prefault=false skips it)\n", f.poolMB)
				}
			case <-c.exit():
				return nil, fmt.Errorf("%s exited before it was ready: %v", c.name, c.proc.Err())
			case <-deadline.C:
				return nil, fmt.Errorf("%s not ready within %s", c.name, readyLimit)
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		transports = r.Transports
		c.metrics = r.Metrics
	}
	return transports, nil
}
