package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestMain lets the demo re-execute this test binary as `kvxfer prefill` /
// `kvxfer decode` (the demo starts os.Executable() with those arguments).
func TestMain(m *testing.M) {
	if os.Getenv("KVXFER_TEST_AS_CLI") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestDemoTopologies(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	dir := t.TempDir()
	gqa := filepath.Join(dir, "gqa.json")
	mla := filepath.Join(dir, "mla.json")
	os.WriteFile(gqa, []byte(`{"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "torch_dtype": "bfloat16"}`), 0o644)
	os.WriteFile(mla, []byte(`{"num_hidden_layers": 3, "num_attention_heads": 16, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "torch_dtype": "bfloat16"}`), 0o644)
	cases := []struct {
		name          string
		model         string
		ptp, ppp, dtp int
		transport     string
		checksum      bool
	}{
		{"tp2-to-1", gqa, 2, 1, 1, "tcp", true},
		{"tp1-to-2", gqa, 1, 1, 2, "tcp", true},
		{"mla-tp2-to-1", mla, 2, 1, 1, "tcp", true},
		{"pp2-to-1", gqa, 1, 2, 1, "auto", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "out.json")
			f := &demoFlags{requests: 3, model: c.model, prefillTP: c.ptp, prefillPP: c.ppp, decodeTP: c.dtp, pageSize: 16,
				poolMB: 16, concurrency: 2, transport: c.transport, checksum: c.checksum, jsonOut: out, seed: 7,
				timeout: 60 * time.Second, noProgress: true, childLog: "warn"}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			if err := runDemo(ctx, f); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			var got struct {
				Summary  demoSummary    `json:"summary"`
				Requests []demoResult   `json:"requests"`
				Metrics  []childMetrics `json:"metrics"`
			}
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			s := got.Summary
			if s.Requests != 3 || s.Verified != 3 || s.Failures != 0 || s.Bytes == 0 || len(s.Used) == 0 {
				t.Fatalf("summary %+v", s)
			}
			// MLA with prefill TP 2 → decode TP 1: the summary names the
			// dummy rank (issue 26); other topologies have none.
			wantDummy := ""
			if c.model == mla {
				wantDummy = "tp1 pp0"
			}
			if strings.Join(s.DummyRanks, ",") != wantDummy || len(s.WriterRanks) != c.ptp*c.ppp-len(s.DummyRanks) {
				t.Errorf("dummy ranks %q, writers %q; want dummy %q", s.DummyRanks, s.WriterRanks, wantDummy)
			}
			// Every rank's engine metrics are in --json: 3 successful rooms each.
			if len(got.Metrics) != c.ptp*c.ppp+c.dtp {
				t.Fatalf("metrics of %d ranks, want %d: %+v", len(got.Metrics), c.ptp*c.ppp+c.dtp, got.Metrics)
			}
			for _, m := range got.Metrics {
				if m.Error != "" || sumSeries(m.Samples, engine.MetricRooms, `state="success"`) != 3 || sumSeries(m.Samples, engine.MetricRooms, `state="failed"`) != 0 {
					t.Errorf("%s metrics: %s %v", m.Rank, m.Error, m.Samples)
				}
			}
			// One definition of write requests (issue 26 item 9): the
			// summary's KV and other writes add up to the prefill ranks'
			// kvxfer_write_requests_total.
			var metricWrites float64
			for _, m := range got.Metrics {
				if strings.HasPrefix(m.Rank, "prefill") {
					metricWrites += sumSeries(m.Samples, engine.MetricWriteRequests)
				}
			}
			if s.ExtraWrites == 0 || float64(s.Writes+s.ExtraWrites) != metricWrites {
				t.Errorf("summary writes %d KV + %d others, kvxfer_write_requests_total %v", s.Writes, s.ExtraWrites, metricWrites)
			}
			for _, r := range got.Requests {
				// What the prefill ranks say they sent is what the decode
				// ranks received (prefill result line "bytes").
				if r.SentBytes != r.Bytes || r.Bytes == 0 {
					t.Errorf("room %d: prefill sent %d bytes, decode received %d", r.Room, r.SentBytes, r.Bytes)
				}
				// The decode's wait before its TRANSFER is reported apart
				// from its transfer.
				if r.BootstrapWaitMS <= 0 || r.DecodeMS <= 0 {
					t.Errorf("room %d: decode bootstrap wait %v ms, transfer %v ms; want both reported", r.Room, r.BootstrapWaitMS, r.DecodeMS)
				}
			}
		})
	}
}

// TestDemoPrefixReuse: with a trace whose prompts share hash_ids blocks, the
// decode ranks hold the shared blocks, the prefill sends only what follows
// them (its reported bytes equal the decode's), every prompt is verified
// whole, and the summary counts the held tokens and the bytes saved.
func TestDemoPrefixReuse(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	dir := t.TempDir()
	gqa := filepath.Join(dir, "gqa.json")
	os.WriteFile(gqa, []byte(`{"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "torch_dtype": "bfloat16"}`), 0o644)
	trace := filepath.Join(dir, "trace.jsonl")
	// Held: request 2 holds blocks 0-1 (1024 tokens), requests 3 and 4 block 0.
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]}
{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 3]}
{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 4, 5]}
{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [0, 6]}
`), 0o644)
	out := filepath.Join(dir, "out.json")
	f := &demoFlags{requests: 0, trace: trace, model: gqa, prefillTP: 2, prefillPP: 1, decodeTP: 2, pageSize: 16, poolMB: 16, prefixMB: 8,
		concurrency: 2, transport: "auto", checksum: true, jsonOut: out, seed: 3, timeout: 60 * time.Second, noProgress: true, childLog: "warn"}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := runDemo(ctx, f); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Summary  demoSummary  `json:"summary"`
		Requests []demoResult `json:"requests"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	s := got.Summary
	if s.Verified != 4 || s.PrefixCacheBlocks == 0 || s.PrefixTokens != 2048 || s.FullBytes <= s.Bytes || s.CappedRequests != 0 {
		t.Fatalf("summary %+v: want 4 verified, 2048 held prompt tokens, fewer bytes than full transfers", s)
	}
	// The first two run at once, in either order at the decode.
	held := []int{got.Requests[0].PrefixTokens + got.Requests[1].PrefixTokens, got.Requests[2].PrefixTokens, got.Requests[3].PrefixTokens}
	if held[0] != 1024 || held[1] != 512 || held[2] != 512 {
		t.Errorf("held tokens per request %v, want [0+1024 in either order, 512, 512]", held)
	}
	for i, r := range got.Requests {
		if r.SentBytes != r.Bytes || (r.PrefixTokens > 0) != (r.SkippedBytes > 0) {
			t.Errorf("request %d: %+v", i, r)
		}
	}
	// Bytes are whole pages: 8 buffers × 16 tokens × 8 heads × 64 × 2 bytes
	// per page over both decode ranks; 251 prompt pages, 128 of them held.
	const page = 8 * 16 * 8 * 64 * 2
	if s.FullBytes != 251*page || s.Bytes != (251-128)*page {
		t.Fatalf("bytes %d, full %d; want %d and %d", s.Bytes, s.FullBytes, (251-128)*page, 251*page)
	}
	var sb strings.Builder
	printSummary(&sb, s, nil)
	if !strings.Contains(sb.String(), "prefix reuse") || !strings.Contains(sb.String(), "2048 of 4000 prompt tokens already on the decode") {
		t.Fatalf("summary lacks the prefix line:\n%s", sb.String())
	}
}

func TestDemoRejectsBadFlags(t *testing.T) {
	good := func() demoFlags {
		return demoFlags{requests: 1, model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, concurrency: 1, poolMB: 16,
			pageSize: 16, timeout: time.Minute, transport: "auto", childLog: "warn"}
	}
	cases := []struct {
		name   string
		mod    func(*demoFlags)
		errHas string
	}{
		{"prefill tp 0", func(f *demoFlags) { f.prefillTP = 0 }, "--prefill-tp 0"},
		{"model", func(f *demoFlags) { f.model = "no-such-model" }, "unknown model"},
		{"model path", func(f *demoFlags) { f.model = "/nonexistent/config.json" }, "no such file"},
		{"concurrency", func(f *demoFlags) { f.concurrency = 0 }, "--concurrency 0"},
		{"trace", func(f *demoFlags) { f.trace = "/nonexistent.jsonl" }, "nonexistent.jsonl"},
		{"requests -1", func(f *demoFlags) { f.requests = -1 }, "--requests -1"},
		{"requests 0 without trace", func(f *demoFlags) { f.requests = 0 }, "needs --trace"},
		{"page 0", func(f *demoFlags) { f.pageSize = 0 }, "--page-size 0"},
		{"page -4", func(f *demoFlags) { f.pageSize = -4 }, "--page-size -4"},
		{"timeout 0", func(f *demoFlags) { f.timeout = 0 }, "--timeout 0s"},
		{"pool", func(f *demoFlags) { f.poolMB = 0 }, "--pool-mb 0"},
		{"chunk", func(f *demoFlags) { f.chunkPages = -2 }, "--chunk-pages -2"},
		{"child log", func(f *demoFlags) { f.childLog = "loud" }, "--child-log-level"},
		{"transport unknown", func(f *demoFlags) { f.transport = "foo" }, `unknown transport "foo"`},
		{"transport in list", func(f *demoFlags) { f.transport = "tcp,foo" }, `unknown transport "foo"`},
		{"prefix cache", func(f *demoFlags) { f.prefixMB = -1 }, "--prefix-cache-mb -1"},
		{"layerwise pp", func(f *demoFlags) { f.lw.on, f.lw.tflops, f.prefillPP = true, 400, 2 }, "--layerwise with --prefill-pp 2"},
		{"layerwise tflops", func(f *demoFlags) { f.lw.on, f.lw.tflops = true, 0 }, "--prefill-tflops 0"},
		{"layerwise time", func(f *demoFlags) { f.lw.on, f.lw.layerTime = true, -time.Second }, "--prefill-layer-time -1s"},
		{"layerwise tokens", func(f *demoFlags) { f.lw.on, f.lw.tflops, f.lw.tokens = true, 400, -3 }, "--prompt-tokens -3"},
	}
	for _, c := range cases {
		f := good()
		c.mod(&f)
		err := runDemo(context.Background(), &f)
		if err == nil || !strings.Contains(err.Error(), c.errHas) {
			t.Errorf("%s: err %v, want one containing %q", c.name, err, c.errHas)
		}
	}
	f := good()
	if err := validateDemoFlags(&f); err != nil {
		t.Errorf("good flags rejected: %v", err)
	}
}

// TestCheckTransportSpec: an unusable transport (rdma without a device) is
// refused up front with the probe's reason and the usable ones.
func TestCheckTransportSpec(t *testing.T) {
	for _, spec := range []string{"auto", "", "tcp", "tcp,shm"} {
		if err := checkTransportSpec(spec); err != nil {
			t.Errorf("%q: %v", spec, err)
		}
	}
	if err := transport.ProbeTransport("rdma"); err != nil {
		if err2 := checkTransportSpec("rdma"); err2 == nil || !strings.Contains(err2.Error(), "usable here") {
			t.Errorf("rdma unusable (%v) but checkTransportSpec says %v", err, err2)
		}
	}
}

func TestPrintSummaryChecksum(t *testing.T) {
	for _, on := range []bool{false, true} {
		var b strings.Builder
		printSummary(&b, demoSummary{PageSize: 16, Checksum: on, CRC32CPath: "hardware (SSE4.2 CRC32)"}, nil)
		want := "checksum off (CRC32C available: hardware SSE4.2 CRC32)"
		if on {
			want = "checksum on (CRC32C available: hardware SSE4.2 CRC32)"
		}
		if !strings.Contains(b.String(), want) || !strings.Contains(b.String(), "page 16 tokens") {
			t.Errorf("summary lacks %q:\n%s", want, b.String())
		}
	}
}

// TestDemoFragmentTP8 runs the TP 8 → TP 8 shape with fragmented pools on
// tcp and shm: one KV head per rank, pages in random order, so every page
// of every buffer is its own write. It checks the write count, the
// aggregate figure (union of the transfer intervals) against the
// per-request times, and that the bench ratio was measured.
func TestDemoFragmentTP8(t *testing.T) {
	if testing.Short() {
		t.Skip("starts 16 processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	dir := t.TempDir()
	gqa := filepath.Join(dir, "gqa8.json")
	// 8 KV heads of 64 dims: at TP 8 a page of 16 tokens is 2 KiB per buffer.
	os.WriteFile(gqa, []byte(`{"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "torch_dtype": "bfloat16"}`), 0o644)
	const pageBytes, buffers = 16 * 64 * 2, 8
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "out.json")
			f := &demoFlags{requests: 3, model: gqa, prefillTP: 8, prefillPP: 1, decodeTP: 8, pageSize: 16, poolMB: 4, concurrency: 2,
				transport: tr, jsonOut: out, seed: 11, timeout: 90 * time.Second, noProgress: true, childLog: "warn",
				fragment: true, warmup: 1, bench: true, prefault: true}
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			if err := runDemo(ctx, f); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			var got struct {
				Summary  demoSummary  `json:"summary"`
				Requests []demoResult `json:"requests"`
			}
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			s := got.Summary
			if s.Requests != 3 || s.Verified != 3 || s.Warmup != 1 || s.WarmupFailures != 0 || len(got.Requests) != 4 || !got.Requests[0].Warmup {
				t.Fatalf("summary %+v", s)
			}
			var sumSec, maxSec float64
			for _, r := range got.Requests[1:] {
				// Fragmented pools: about one write per page and buffer
				// (r.Pages counts pages over the 8 decode ranks).
				if r.Writes < r.Pages*buffers*9/10 || r.Writes > r.Pages*buffers {
					t.Errorf("room %d: %d writes for %d pages x %d buffers", r.Room, r.Writes, r.Pages, buffers)
				}
				sec := float64(r.EndUnixNS-r.StartUnixNS) / 1e9
				sumSec += sec
				maxSec = max(maxSec, sec)
			}
			if s.TransferSeconds < maxSec*0.999 || s.TransferSeconds > sumSec*1.001 || s.AggregateGBps <= 0 {
				t.Errorf("union of transfer intervals %.3f s, want between the longest %.3f s and the sum %.3f s; aggregate %.3f GB/s",
					s.TransferSeconds, maxSec, sumSec, s.AggregateGBps)
			}
			if s.WriteBytes < pageBytes || s.WriteBytes > 2*pageBytes {
				t.Errorf("effective write size %d bytes, want about one page (%d)", s.WriteBytes, pageBytes)
			}
			if s.BenchGBps <= 0 || s.BenchRatio <= 0 || !strings.Contains(s.BenchCase, tr) {
				t.Errorf("bench ratio not measured: case %q, %.3f GB/s, ratio %.3f, note %q", s.BenchCase, s.BenchGBps, s.BenchRatio, s.BenchNote)
			}
			var sb strings.Builder
			printSummary(&sb, s, got.Requests)
			for _, want := range []string{"aggregate transfer (bytes / union of the transfer intervals", "KV write requests per room", "random order (--fragment)", "× aggregate over kvxfer bench (" + tr, "warm-up"} {
				if !strings.Contains(sb.String(), want) {
					t.Errorf("summary lacks %q:\n%s", want, sb.String())
				}
			}
			t.Logf("%s: %.1f writes/room of %d bytes, aggregate %.3f GB/s over %.2f s, bench %s %.3f GB/s (%.2fx)", tr, s.WritesPerRoom, s.WriteBytes,
				s.AggregateGBps, s.TransferSeconds, s.BenchCase, s.BenchGBps, s.BenchRatio)
		})
	}
}

func TestUnionNS(t *testing.T) {
	for _, tc := range []struct {
		in   [][2]int64
		want int64
	}{
		{nil, 0},
		{[][2]int64{{10, 20}}, 10},
		{[][2]int64{{10, 20}, {15, 30}}, 20},            // overlap
		{[][2]int64{{40, 50}, {10, 20}}, 20},            // disjoint, unsorted
		{[][2]int64{{10, 100}, {20, 30}, {40, 50}}, 90}, // nested
		{[][2]int64{{10, 20}, {20, 30}}, 20},            // touching
		{[][2]int64{{0, 5}, {3, 8}, {10, 12}, {11, 15}}, 13},
	} {
		if got := unionNS(tc.in); got != tc.want {
			t.Errorf("unionNS(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

func TestBenchAtNotes(t *testing.T) {
	f := &demoFlags{concurrency: 2}
	for _, tc := range []struct {
		s    demoSummary
		dev  string
		want string
	}{
		{demoSummary{Used: []string{"tcp"}, Writes: 10, WriteBytes: 4096}, "cuda:0", "--device"},
		{demoSummary{Used: []string{"tcp", "shm"}, Writes: 10, WriteBytes: 4096}, "", "not one transport"},
		{demoSummary{Used: []string{"tcp"}}, "", "no verified request"},
		{demoSummary{Used: []string{"tcp"}, Writes: 1, WriteBytes: 1 << 30}, "", "is over"},
	} {
		f.device = tc.dev
		if _, gbps, note := benchAt(context.Background(), tc.s, f, 1); gbps != 0 || !strings.Contains(note, tc.want) {
			t.Errorf("%+v: %v %q, want a note containing %q", tc.s, gbps, note, tc.want)
		}
	}
}

// TestPlanDemoWorkload: --trace conversation reads the trace directory's
// file when there and otherwise generates requests of the trace's shape,
// saying where the real traces come from; a prompt cap names how many
// prompts it cuts and why (issue 26: 10 of 20 prompts were cut in
// silence); a missing trace path names the sources.
func TestPlanDemoWorkload(t *testing.T) {
	empty := t.TempDir()
	t.Chdir(empty) // no ../shared/data/traces here
	t.Setenv("KVXFER_TRACE_DIR", empty)
	f := &demoFlags{requests: 20, trace: "conversation", model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, pageSize: 16,
		poolMB: 256, concurrency: 2, seed: 3, prefixMB: 64}
	p, err := planDemo(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.reqs) != 20 || !strings.Contains(p.workload, "shape of the Mooncake conversation trace") || !strings.Contains(p.workload, "kvcache-ai/Mooncake") {
		t.Fatalf("%d requests, workload %q: want 20 generated with the conversation shape, naming the source", len(p.reqs), p.workload)
	}
	n, cut, _ := p.capped()
	if line := p.capLine(); n == 0 || cut == 0 || !strings.Contains(line, fmt.Sprintf("%d of 20 prompts are longer than %d tokens", n, p.capTokens)) ||
		!strings.Contains(line, "--pool-mb 256") || !strings.Contains(line, "--concurrency 2") {
		t.Errorf("cap line %q (%d cut)", line, n)
	}
	var sb strings.Builder
	p.announce(&sb)
	if !strings.Contains(sb.String(), "workload: ") || !strings.Contains(sb.String(), "prompts are longer") {
		t.Errorf("announcement:\n%s", sb.String())
	}
	// The file, when the trace directory has it.
	line := `{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0]}` + "\n"
	if err := os.WriteFile(filepath.Join(empty, "conversation_trace.jsonl"), []byte(strings.Repeat(line, 4)), 0o644); err != nil {
		t.Fatal(err)
	}
	if p, err = planDemo(f); err != nil || len(p.reqs) != 4 || !strings.Contains(p.workload, "conversation_trace.jsonl") || p.capLine() != "" {
		t.Fatalf("trace file: %v, %d requests, %q, cap %q", err, len(p.reqs), p.workload, p.capLine())
	}
	f.trace = "../shared/data/traces/conversation_trace.jsonl"
	if _, err := planDemo(f); err == nil || !strings.Contains(err.Error(), "kvcache-ai/Mooncake") || !strings.Contains(err.Error(), "--trace conversation") {
		t.Fatalf("missing trace path: %v", err)
	}
}

// TestStartProgressLines: without a terminal the ranks' start is reported
// in periodic lines naming the ranks ready and the KV bytes prefaulted.
func TestStartProgressLines(t *testing.T) {
	c, err := startChild("/bin/sleep", "sleeper", []string{"30"}, nil)
	if err != nil {
		t.Skip(err)
	}
	defer c.stop(0)
	var out strings.Builder
	p := newStartProgress(&out, &demoFlags{prefault: true, poolMB: 1024}, []*child{c})
	p.every = 0
	p.update()
	if !strings.Contains(out.String(), "0 of 1 ready") || !strings.Contains(out.String(), "prefaulted 0.00 of 1.00 GiB") {
		t.Fatalf("progress line %q", out.String())
	}
	if got := rssShmem(os.Getpid()); got < 0 {
		t.Errorf("rssShmem of this process: %d", got)
	}
}

// TestDemoLayerwise: demo --layerwise runs every request whole-room and
// layer-wise (alternating which goes first), each with the compute model,
// every byte verified by the decode, and reports per room the compute, the
// handover and the TTFT proxy (start <= end <= Success), and the ratios.
func TestDemoLayerwise(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	gqa := filepath.Join(t.TempDir(), "gqa.json")
	os.WriteFile(gqa, []byte(`{"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 1024, "intermediate_size": 2816, "torch_dtype": "bfloat16"}`), 0o644)
	f := &demoFlags{requests: 2, model: gqa, prefillTP: 2, prefillPP: 1, decodeTP: 1, pageSize: 16, poolMB: 16, concurrency: 1, transport: "tcp",
		jsonOut: filepath.Join(t.TempDir(), "out.json"), seed: 9, timeout: 60 * time.Second, noProgress: true, childLog: "warn", chunkPages: 2,
		lw: layerwiseFlags{on: true, tflops: 0.05, tokens: 96}}
	var got struct {
		Summary  layerwiseSummary `json:"summary"`
		Requests []demoResult     `json:"requests"`
	}
	runDemoJSON(t, f, &got)
	s := got.Summary
	if s.Requests != 2 || s.Failures != 0 || len(got.Requests) != 4 || s.Layers != 4 || s.OneLayerMS <= 0 || s.HandoverRatio <= 0 || s.TTFTRatio <= 0 {
		t.Fatalf("summary %+v", s)
	}
	for i, r := range got.Requests {
		want := []string{modeWhole, modeLayer, modeLayer, modeWhole}[i]
		if !r.OK || r.Mode != want || r.Tokens != 96 || r.ComputeStartUnixNS == 0 || r.ComputeEndUnixNS < r.ComputeStartUnixNS || r.SuccessUnixNS < r.ComputeEndUnixNS || r.Bytes == 0 {
			t.Errorf("room %d: %+v (want mode %s)", i, r, want)
		}
	}
}

// runDemoJSON runs the demo (3 minutes at most) and decodes its --json
// file (f.jsonOut) into out.
func runDemoJSON(t *testing.T, f *demoFlags, out any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := runDemo(ctx, f); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(f.jsonOut)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
}

// TestDemoExitError: requests a stop signal kept from running are reported
// as interrupted, not as transfer or verification failures.
func TestDemoExitError(t *testing.T) {
	ok, bad, intr := demoResult{OK: true}, demoResult{Error: "peer lost"}, demoResult{Error: demoInterrupted, Interrupted: true}
	for _, c := range []struct {
		name    string
		sum     demoSummary
		results []demoResult
		want    string
	}{
		{"all verified", demoSummary{Requests: 2}, []demoResult{ok, ok}, ""},
		{"failed", demoSummary{Requests: 2, Failures: 1}, []demoResult{ok, bad}, "1 of 2 requests failed transfer or verification"},
		{"warm-up failed", demoSummary{Requests: 1, Warmup: 1, WarmupFailures: 1}, []demoResult{bad, ok}, "1 of 1 warm-up requests failed"},
		{"interrupted", demoSummary{Requests: 3, Interrupted: 2}, []demoResult{ok, intr, intr}, "interrupted by a stop signal: 2 of 3 requests were not run or were cut short; 0 failed"},
		{"interrupted and failed", demoSummary{Requests: 3, Failures: 1, Interrupted: 1}, []demoResult{bad, intr, ok}, "1 of 3 requests were not run or were cut short; 1 failed"},
		{"warm-up interrupted", demoSummary{Requests: 1, Warmup: 1, WarmupInterrupted: 1, Interrupted: 1}, []demoResult{intr, intr}, "2 of 2 requests were not run or were cut short; 0 failed"},
	} {
		err := demoExitError(c.sum, c.results)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// TestDemoCountsInterruptedApart: requests a stop signal kept from running,
// and rooms the ranks refused or cancelled while draining after the same
// signal, are counted as interrupted in the summary, its JSON and the
// printed line, not as failed (before: "3 failed" for a Ctrl-C).
func TestDemoCountsInterruptedApart(t *testing.T) {
	for _, c := range []struct {
		err  string
		stop bool
	}{
		{"decode tp0 pp0: " + fmt.Sprintf(drainRefusal, "interrupt signal"), true},
		{"prefill tp0 pp0: engine: room 7: context canceled: a second stop signal (terminated) during the drain", true},
		{"prefill tp0 pp0: --drain-timeout 30s after the stop signal passed", true},
		{"decode tp0 pp0: engine: room 7: peer lost: prefill gone", false},
		{"decode tp0 pp0: workload: KV verification failed for room 7", false},
	} {
		if got := stoppedByDrain(c.err); got != c.stop {
			t.Errorf("stoppedByDrain(%q) = %v, want %v", c.err, got, c.stop)
		}
	}
	results := []demoResult{
		{OK: true, Tokens: 16, Pages: 1, Bytes: 100, TransferMS: 1}, // warm-up
		{Error: demoInterrupted, Interrupted: true},                 // warm-up, not run
		{OK: true, Tokens: 16, Pages: 1, Bytes: 100, TransferMS: 1},
		{Error: "decode tp0 pp0: peer lost"},
		{Error: "decode tp0 pp0: " + fmt.Sprintf(drainRefusal, "interrupt signal"), Interrupted: true},
		{Error: demoInterrupted, Interrupted: true},
	}
	s := demoSummary{Requests: len(results), Warmup: 2}
	s.tally(results, 2, time.Second, false)
	if s.Requests != 4 || s.Verified != 1 || s.Failures != 1 || s.Interrupted != 2 || s.WarmupFailures != 0 || s.WarmupInterrupted != 1 {
		t.Fatalf("tally: requests %d, verified %d, failed %d, interrupted %d; warm-up failed %d, interrupted %d; want 4, 1, 1, 2; 0, 1",
			s.Requests, s.Verified, s.Failures, s.Interrupted, s.WarmupFailures, s.WarmupInterrupted)
	}
	var out strings.Builder
	printSummary(&out, s, results)
	if !strings.Contains(out.String(), "4 (1 verified, 1 failed, 2 interrupted") || !strings.Contains(out.String(), "(0 failed, 1 interrupted") ||
		!regexp.MustCompile(`(?m)^interrupted +3 \(`).MatchString(out.String()) || strings.Count(out.String(), "FAILED") != 1 {
		t.Errorf("summary does not count the interrupted requests apart:\n%s", out.String())
	}
	b, _ := json.Marshal(s)
	if !strings.Contains(string(b), `"interrupted":2`) || !strings.Contains(string(b), `"failures":1`) || !strings.Contains(string(b), `"warmup_interrupted":1`) {
		t.Errorf("JSON summary %s: want interrupted 2, failures 1, warmup_interrupted 1", b)
	}
	if err := demoExitError(s, results); err == nil || !strings.Contains(err.Error(), "3 of 6 requests were not run or were cut short; 1 failed") {
		t.Errorf("exit error %v", err)
	}
}
