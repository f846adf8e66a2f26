package bench

import (
	"bytes"
	"context"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestSummarizeAndPercentile(t *testing.T) {
	cases := []struct {
		in   []float64
		want Stat
	}{
		{nil, Stat{}},
		{[]float64{2}, Stat{Median: 2, Min: 2, Max: 2, N: 1}},
		{[]float64{3, 1, 2}, Stat{Median: 2, Min: 1, Max: 3, Spread: 1, N: 3}},
		{[]float64{4, 1, 3, 2}, Stat{Median: 2.5, Min: 1, Max: 4, Spread: 1.2, N: 4}},
		{[]float64{0, 0}, Stat{N: 2}},
	}
	for _, c := range cases {
		got := Summarize(c.in)
		if math.Abs(got.Median-c.want.Median) > 1e-12 || got.Min != c.want.Min || got.Max != c.want.Max ||
			math.Abs(got.Spread-c.want.Spread) > 1e-12 || got.N != c.want.N {
			t.Errorf("Summarize(%v) = %+v, want %+v", c.in, got, c.want)
		}
	}
	s := []float64{10, 20, 30, 40, 50, 60, 70, 80, 90, 100}
	for _, c := range []struct{ p, want float64 }{{0, 10}, {50, 55}, {99, 99.1}, {100, 100}, {-5, 10}, {150, 100}} {
		if got := Percentile(s, c.p); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("Percentile(%v) = %v, want %v", c.p, got, c.want)
		}
	}
	if !math.IsNaN(Percentile(nil, 50)) {
		t.Error("Percentile of empty slice is not NaN")
	}
}

func TestRepRates(t *testing.T) {
	r := Rep{Bytes: 3e9, Messages: 600, Seconds: 1.5}
	if r.GBps() != 2 || r.MsgsPerSec() != 400 {
		t.Fatalf("GBps %v msgs/s %v", r.GBps(), r.MsgsPerSec())
	}
	if (Rep{Bytes: 1}).GBps() != 0 {
		t.Fatal("zero-duration rep has a bandwidth")
	}
}

func TestParseSize(t *testing.T) {
	good := map[string]uint64{"4096": 4096, "4K": 4096, "4k": 4096, "4KiB": 4096, "1M": 1 << 20, "64MB": 64 << 20, "2G": 2 << 30, " 8K ": 8192}
	for in, want := range good {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	good2 := map[string]uint64{"1T": 1 << 40, "1TiB": 1 << 40, "1024G": 1 << 40}
	for in, want := range good2 {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for in, wantErr := range map[string]string{"": "positive whole byte count", "0": "positive", "-1": "positive", "K": "positive", "1.5M": "K, M, G or T suffix",
		"4X": "K, M, G or T suffix", "99999999999G": "the largest size is 1T (1024G", "2T": "the largest size is 1T", "1025G": "the largest size is 1T", "1099511627777": "1099511627776 bytes"} {
		if _, err := ParseSize(in); err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("ParseSize(%q): error %v, want one containing %q", in, err, wantErr)
		}
	}
	if got, err := ParseSizes("4K,,1M"); err != nil || len(got) != 2 {
		t.Errorf("ParseSizes: %v %v", got, err)
	}
	if _, err := ParseInts("1,x", "--depths", 1, 10); err == nil || !strings.Contains(err.Error(), "--depths") {
		t.Errorf("ParseInts error %v does not name the flag", err)
	}
	for n, want := range map[uint64]string{4096: "4K", 1 << 20: "1M", 3 << 30: "3G", 1000: "1000", 1536: "1536"} {
		if got := FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestRegionBytes(t *testing.T) {
	cases := []struct {
		c    Case
		max  uint64
		want uint64
	}{
		{Case{BlockBytes: 4096, Depth: 8}, 1 << 20, 32768},
		{Case{BlockBytes: 64 << 20, Depth: 8}, 128 << 20, 128 << 20},
		{Case{BlockBytes: 48 << 20, Depth: 8}, 128 << 20, 96 << 20},
		{Case{BlockBytes: 64 << 20, Depth: 1}, 32 << 20, 64 << 20},
	}
	for _, c := range cases {
		if got := RegionBytes(c.c, c.max); got != c.want {
			t.Errorf("RegionBytes(%+v, %d) = %d, want %d", c.c, c.max, got, c.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.Transports = nil },
		func(c *Config) { c.Inflight = 0 },
		func(c *Config) { c.Reps = 0 },
		func(c *Config) { c.RepTime = 0 },
		func(c *Config) { c.BlockSizes = []uint64{1 << 30} },
		func(c *Config) { c.Depths = nil },
		func(c *Config) { c.BlockSizes = []uint64{4096, 8192, 4096} },
		func(c *Config) { c.Ops = []string{"write", "scan"} },
	}
	for i, f := range bad {
		c := DefaultConfig()
		f(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("bad config %d accepted", i)
		}
	}
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	cs := c.Cases()
	if n := len(cs); n != len(c.Transports)*len(c.BlockSizes)*len(c.Depths)*len(c.Streams)*len(c.Ops) {
		t.Fatalf("Cases() has %d entries", n)
	}
	// Each READ case follows the WRITE case of its point.
	for i, k := range cs {
		if k.Read() && (i == 0 || cs[i-1] != k.WriteTwin()) {
			t.Fatalf("case %d (%s) does not follow its WRITE twin", i, k.Label())
		}
	}
	c.Ops = nil
	if cs := c.Cases(); len(cs) != len(c.Transports)*len(c.BlockSizes)*len(c.Depths)*len(c.Streams) || cs[0].Read() {
		t.Fatalf("no Ops: %d cases, want WRITE only", len(cs))
	}
}

func TestFirstDiffAndFill(t *testing.T) {
	a := make([]byte, 200003)
	fill(a, 7)
	b := append([]byte(nil), a...)
	if firstDiff(a, b) != -1 {
		t.Fatal("equal buffers differ")
	}
	b[150001] ^= 1
	if got := firstDiff(a, b); got != 150001 {
		t.Fatalf("firstDiff = %d, want 150001", got)
	}
	c := make([]byte, len(a))
	fill(c, 8)
	if bytes.Equal(a, c) {
		t.Fatal("different seeds give the same pattern")
	}
}

func TestPeerParsers(t *testing.T) {
	ucx := "+----+\nFinal:                   500      1.353  3634.031  7031.724      275.18     142.21         275         142\n"
	if got, err := parseUCXPerftest([]byte(ucx)); err != nil || math.Abs(got-142.21*(1<<20)/1e9) > 1e-9 {
		t.Errorf("parseUCXPerftest = %v, %v", got, err)
	}
	if _, err := parseUCXPerftest([]byte("ERROR something")); err == nil {
		t.Error("parseUCXPerftest accepted output without Final")
	}
	ip := `{"end":{"sum_received":{"bits_per_second":8e9}}}`
	if got, err := parseIperf3([]byte(ip)); err != nil || got != 1 {
		t.Errorf("parseIperf3 = %v, %v", got, err)
	}
	if _, err := parseIperf3([]byte(`{"error":"unable to connect"}`)); err == nil || !strings.Contains(err.Error(), "unable") {
		t.Errorf("parseIperf3 error %v", err)
	}
	ib := " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n 1048576    1000             90.12              89.60                0.010682\n"
	if got, err := parseIBWriteBW([]byte(ib), 1048576); err != nil || math.Abs(got-11.2) > 1e-9 {
		t.Errorf("parseIBWriteBW = %v, %v", got, err)
	}
	if _, err := parseIBWriteBW([]byte(ib), 4096); err == nil {
		t.Error("parseIBWriteBW accepted a missing row")
	}
}

// TestRunSmoke drives the whole benchmark with tiny sizes over shm and tcp:
// every case completes, verifies, and the table, JSON and plot are written.
func TestRunSmoke(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSizes = []uint64{4096, 64 << 10}
	cfg.Depths = []int{1, 4}
	cfg.Reps = 2
	cfg.Warmup = 1
	cfg.RepTime = 5 * time.Millisecond
	cfg.MaxRegionBytes = 1 << 20
	cfg.Transports = []string{"shm", "tcp", "nonesuch"}
	model := filepath.Join(t.TempDir(), "tiny.json")
	if err := os.WriteFile(model, []byte(`{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.KVModel, cfg.KVTokens = model, 100
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	steps := 0
	rep, err := Run(ctx, cfg, func(string, int, int) { steps++ })
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Skipped) != 1 || !strings.Contains(rep.Skipped[0], "nonesuch") {
		t.Errorf("skipped = %v, want the unknown transport", rep.Skipped)
	}
	// 2 transports × 2 sizes × 2 depths × (write, read); KV push and pull per transport.
	if len(rep.Results) != 16 || len(rep.KV) != 4 || steps != 21 {
		t.Fatalf("%d results, %d KV cases, %d progress calls; want 16, 4 and 21", len(rep.Results), len(rep.KV), steps)
	}
	pulls := 0
	for _, k := range rep.KV {
		// 100 tokens = 7 pages of 16 tokens × 4 buffers × 16 tokens × 2 heads × 16 × 2 bytes.
		if k.Err != "" || !k.Verified || k.Buffers != 4 || k.Bytes != 7*4*16*2*16*2 || k.GBps.N != 2 || k.GBps.Median <= 0 {
			t.Errorf("KV case %+v", k)
		}
		if k.Mode == "pull" {
			pulls++
			if k.PushRatio <= 0 {
				t.Errorf("pull KV case without its ratio to push: %+v", k)
			}
		}
	}
	if pulls != 2 {
		t.Errorf("%d pull KV cases, want one per transport", pulls)
	}
	reads := 0
	for _, r := range rep.Results {
		if r.Err != "" || !r.Verified || len(r.Reps) != 2 || r.GBps.Median <= 0 || r.MemcpyGBps.N != 2 || r.MemcpyRatio.N != 2 || r.LatencyP99us < r.LatencyP50us {
			t.Errorf("%s: %+v", r.Label(), r)
		}
		if r.Read() {
			reads++
			if r.WriteRatio <= 0 {
				t.Errorf("%s: READ result without its ratio to WRITE", r.Label())
			}
		}
	}
	if reads != 8 {
		t.Errorf("%d READ results, want 8", reads)
	}
	if rep.Method.CPUModel == "" && len(rep.Method.CPUFeatures) == 0 {
		t.Error("method has no CPU description")
	}
	if rep.Method.Kernel == "" || rep.Method.GoVersion == "" || rep.Hardware.Note == "" && len(rep.Hardware.Pairs) == 0 {
		t.Errorf("method/hardware incomplete: %+v %+v", rep.Method, rep.Hardware)
	}
	var tbl bytes.Buffer
	if err := WriteTable(&tbl, rep); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tbl.String(), "shm") || !strings.Contains(tbl.String(), "64K") || !strings.Contains(tbl.String(), "×write") || !strings.Contains(tbl.String(), " read ") {
		t.Errorf("table:\n%s", tbl.String())
	}
	tbl.Reset()
	if err := WriteKVTable(&tbl, rep); err != nil || !strings.Contains(tbl.String(), "KV rooms") || strings.Count(tbl.String(), "tiny.json") != 4 || !strings.Contains(tbl.String(), "pull") {
		t.Errorf("KV table (%v):\n%s", err, tbl.String())
	}
	dir := t.TempDir()
	if err := rep.WriteJSON(filepath.Join(dir, "r.json")); err != nil {
		t.Fatal(err)
	}
	back, err := ReadJSON(filepath.Join(dir, "r.json"))
	if err != nil || len(back.Results) != len(rep.Results) || back.Method.Config.Reps != 2 {
		t.Fatalf("JSON round trip: %v", err)
	}
	for _, name := range []string{"p.png", "p.svg"} {
		if err := WritePlot(rep, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(filepath.Join(dir, name)); err != nil || st.Size() < 1000 {
			t.Fatalf("plot %s: %v", name, err)
		}
	}
	if err := WritePlot(rep, filepath.Join(dir, "p.txt")); err == nil {
		t.Error("plot to .txt accepted")
	}
}

// TestRunPeerMissingTool checks a peer that is not installed is reported, not fatal.
func TestRunPeerMissingTool(t *testing.T) {
	r := RunPeer(context.Background(), PeerSpec{Tool: "kvxfer-no-such-tool", Test: "x", Transport: "tcp"}, 4096)
	if r.Err == "" || r.GBps != 0 {
		t.Fatalf("missing tool: %+v", r)
	}
}

// TestRunPeerInstalled runs each installed loopback peer once with a small
// size and checks a bandwidth is parsed.
func TestRunPeerInstalled(t *testing.T) {
	if testing.Short() {
		t.Skip("peer tools skipped under -short")
	}
	for _, p := range DefaultPeers([]string{"tcp", "shm"}, nil) {
		t.Run(p.Label(), func(t *testing.T) {
			if _, err := exec.LookPath(p.Tool); err != nil {
				t.Skipf("%s not installed (scripts/install-deps.sh bench)", p.Tool)
			}
			ctx, cancel := context.WithTimeout(context.Background(), PeerTimeout)
			defer cancel()
			r := RunPeer(ctx, p, 64<<10)
			if r.Err != "" || r.GBps <= 0 || r.Command == "" {
				t.Fatalf("%+v", r)
			}
		})
	}
}

// TestRunCaseOddBlock: a block size that is no multiple of the page size
// (the demo benchmarks its effective write size, any byte count) is
// verified over the case's working set only, not the page-rounded tail.
func TestRunCaseOddBlock(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Reps, cfg.Warmup, cfg.RepTime, cfg.Memcpy = 1, 1, 10*time.Millisecond, false
	c := Case{Transport: "tcp", BlockBytes: 8607061, Depth: 3, Inflight: 1}
	res := RunCase(context.Background(), cfg, c)
	if res.Err != "" || res.VerifyErr != "" || !res.Verified {
		t.Fatalf("odd block: err %q verify %q", res.Err, res.VerifyErr)
	}
}

// TestCaseBudget: without --case-timeout a case's time budget grows with
// the bytes it must move (a 1 GiB batch at the 0.6 GiB/s needs
// about 19 GiB moved, ~34 s before fill and verify, past the old fixed
// 60 s on a loaded machine), and an explicit CaseTimeout wins.
func TestCaseBudget(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxRegionBytes = 1 << 30
	small := cfg.CaseBudget(Case{Transport: "tcp", BlockBytes: 4 << 10, Depth: 8})
	if small < time.Minute || small > 2*time.Minute {
		t.Errorf("4K×8 budget %s: want about the 60 s base", small)
	}
	big := Case{Transport: "tcp", BlockBytes: 64 << 10, Depth: 16384}
	b := cfg.CaseBudget(big)
	// Warm-up 4 + 5 reps × 3 batches of 1 GiB, plus 4 region passes per rep.
	moved := float64((4+5*3)<<30 + 5*4<<30)
	if need := time.Duration(moved / 0.6e9 * float64(time.Second)); b < 3*need {
		t.Errorf("1 GiB-batch budget %s: want well above the %s it takes at 0.6 GB/s", b, need)
	}
	if b < small {
		t.Errorf("budget does not grow with bytes: %s < %s", b, small)
	}
	cfg.CaseTimeout = 5 * time.Second
	if got := cfg.CaseBudget(big); got != 5*time.Second {
		t.Errorf("explicit CaseTimeout: budget %s, want 5s", got)
	}
}

// TestHostBytes: the largest case's two regions, or the two KV pools of
// --kv-model when larger.
func TestHostBytes(t *testing.T) {
	c := DefaultConfig()
	c.KVModel = ""
	c.Transports, c.BlockSizes, c.Depths, c.Streams = []string{"tcp", "shm"}, []uint64{4 << 10, 64 << 30}, []int{1, 16}, []int{0}
	c.MaxRegionBytes = 100 << 30
	if got, want := c.HostBytes(), uint64(2*(100<<30/(64<<30))*(64<<30)); got != want {
		t.Fatalf("HostBytes = %d, want %d (two regions of one 64G block)", got, want)
	}
	c.BlockSizes, c.MaxRegionBytes = []uint64{4 << 10}, 1<<20
	if got := c.HostBytes(); got != 2*(64<<10) {
		t.Fatalf("HostBytes = %d, want %d (two regions of 16 4K blocks)", got, 2*(64<<10))
	}
	c.KVModel, c.KVTokens = DefaultKVModel, 4096
	l, err := kvLayout(c)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.HostBytes(); got != 2*l.PoolBytes() {
		t.Fatalf("HostBytes with --kv-model = %d, want the two pools %d", got, 2*l.PoolBytes())
	}
}
