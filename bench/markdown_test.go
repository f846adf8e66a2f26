package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestUpdateMarkdown(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "RESULTS.md")
	other := "# Results\n\nintro\n\n" + MarkBegin + "\nold figures\n" + MarkEnd + "\n\n## Bootstrap directory\n\ntheir table | 1 |\n"
	if err := os.WriteFile(p, []byte(other), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := UpdateMarkdown(p, "new figures\n"); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(p)
	want := strings.Replace(other, "old figures", "new figures", 1)
	if string(got) != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	// No markers: appended, original kept.
	q := filepath.Join(dir, "plain.md")
	os.WriteFile(q, []byte("## Someone else\ntext"), 0o644)
	if err := UpdateMarkdown(q, "s"); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(q)
	if !strings.HasPrefix(string(got), "## Someone else\ntext\n") || !strings.Contains(string(got), MarkBegin+"\ns\n"+MarkEnd) {
		t.Fatalf("append: %q", got)
	}
	// Damaged: refused, file untouched.
	d := filepath.Join(dir, "damaged.md")
	os.WriteFile(d, []byte(MarkEnd+"\n"+MarkBegin), 0o644)
	if err := UpdateMarkdown(d, "s"); err == nil {
		t.Fatal("damaged markers accepted")
	}
}

func TestTargetsAndRender(t *testing.T) {
	r := &Report{
		Method: Method{Config: Config{Transports: []string{"tcp", "shm"}, BlockSizes: []uint64{TargetBlock}}},
		Results: []Result{
			{Case: Case{Transport: "tcp", BlockBytes: TargetBlock, Depth: 1}, GBps: Stat{Median: 1.5}},
			{Case: Case{Transport: "tcp", BlockBytes: TargetBlock, Depth: 8}, GBps: Stat{Median: 2.0}},
			{Case: Case{Transport: "shm", BlockBytes: TargetBlock, Depth: 1}, GBps: Stat{Median: 6}, MemcpyGBps: Stat{Median: 10}, MemcpyRatio: Stat{Median: 0.6}},
		},
		Peers: []PeerResult{
			{Tool: "ucx_perftest", Test: "tag_bw", Transport: "tcp", Env: "UCX_TLS=tcp", BlockBytes: TargetBlock, ToolBlockBytes: TargetBlock, GBps: 1},
			{Tool: "ucx_perftest", Test: "tag_bw", Transport: "shm", Env: "UCX_TLS=sm", BlockBytes: TargetBlock, ToolBlockBytes: TargetBlock, GBps: 3},
		},
	}
	ts := r.Targets()
	if len(ts) != 6 {
		t.Fatalf("%d targets", len(ts))
	}
	if ts[4].Missing == "" || ts[5].Missing == "" {
		t.Errorf("small-write targets evaluated without 4K/32K results: %+v %+v", ts[4], ts[5])
	}
	if !ts[0].Met() || ts[0].Ratio() != 2 {
		t.Errorf("tcp target %+v", ts[0])
	}
	if ts[1].Met() || ts[1].Ratio() != 0.6 {
		t.Errorf("memcpy target %+v (0.6 < 0.8 must be missed)", ts[1])
	}
	if !ts[2].Met() || ts[3].Missing == "" {
		t.Errorf("ucx sm targets %+v %+v", ts[2], ts[3])
	}
	md, err := RenderMarkdown(r, "results/bench.png", "results/bench.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"**missed**", "not evaluated", "2.00 (d8", "(2.00×)", "![bandwidth vs block size](results/bench.png)"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
}

func TestSmallWriteTargets(t *testing.T) {
	res := func(block uint64, depth int, gbps float64) Result {
		return Result{Case: Case{Transport: "tcp", BlockBytes: block, Depth: depth}, GBps: Stat{Median: gbps}}
	}
	r := &Report{Results: []Result{
		res(TargetBlock, 1, 4.0), res(TargetBlock, 256, 2.0),
		res(4<<10, 64, 3.9), res(4<<10, 256, 2.7), res(4<<10, 512, 2.9), // depth 64 does not count
		res(32<<10, 256, 3.5),
	}}
	ts := r.Targets()
	var small []Target
	for _, x := range ts {
		if strings.HasPrefix(x.What, "tcp 4K at depth") || strings.HasPrefix(x.What, "tcp 32K at depth") {
			small = append(small, x)
		}
	}
	if len(small) != 2 {
		t.Fatalf("small-write targets: %+v", ts)
	}
	if small[0].Ours != 2.9 || small[0].Theirs != 4.0 || !small[0].Met() { // 0.725 >= 0.7
		t.Errorf("4K target %+v: want best depth>=256 (2.9) over best 1M (4.0), met", small[0])
	}
	if small[1].Ratio() != 3.5/4.0 || small[1].Met() { // 0.875 < 0.9
		t.Errorf("32K target %+v: want 0.875x, missed", small[1])
	}
	var out strings.Builder
	r.Method.Config.Transports = []string{"tcp"}
	if err := WriteTable(&out, r); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"tcp 4K at depth ≥ 256 vs tcp 1M", "0.72×", "met", "0.88×", "MISSED"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

// TestTargetRatioOfPrintedFigures: a target's ratio is the ratio of the two
// figures printed beside it (it used to print the medians 8.524 vs 8.464
// beside the paired ratio 1.39×); the paired ratio is shown as such.
func TestTargetRatioOfPrintedFigures(t *testing.T) {
	r := &Report{
		Method: Method{Config: Config{Transports: []string{"shm"}, BlockSizes: []uint64{TargetBlock}}},
		Results: []Result{{Case: Case{Transport: "shm", BlockBytes: TargetBlock, Depth: 8}, GBps: Stat{Median: 8.524},
			MemcpyGBps: Stat{Median: 8.464}, MemcpyRatio: Stat{Median: 1.39}}},
	}
	var mt Target
	for _, x := range r.Targets() {
		if strings.HasPrefix(x.What, "shm vs memcpy") {
			mt = x
		}
	}
	if got := mt.Ratio(); math.Abs(got-8.524/8.464) > 1e-12 {
		t.Fatalf("memcpy target ratio %v, want %v (ours/theirs as printed)", got, 8.524/8.464)
	}
	var tb strings.Builder
	if err := WriteTable(&tb, r); err != nil {
		t.Fatal(err)
	}
	md, err := RenderMarkdown(r, "", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{tb.String(), md} {
		if !strings.Contains(out, "1.01×; paired per-repetition ratio 1.39×") || strings.Contains(out, "| 1.39×") {
			t.Errorf("output does not print the ratio of its figures with the paired one beside it:\n%s", out)
		}
	}
}

// TestSuspectPeerRatio: a ratio over 10× a peer (182× was once "met") is
// flagged and does not count as met; the tables mark it.
func TestSuspectPeerRatio(t *testing.T) {
	r := &Report{
		Method:  Method{Config: Config{Transports: []string{"shm"}, BlockSizes: []uint64{TargetBlock}}},
		Results: []Result{{Case: Case{Transport: "shm", BlockBytes: TargetBlock, Depth: 8}, GBps: Stat{Median: 18.2}}},
		Peers: []PeerResult{{Tool: "ucx_perftest", Test: "tag_bw", Transport: "shm", Env: "UCX_TLS=sm", BlockBytes: TargetBlock,
			ToolBlockBytes: TargetBlock, GBps: 0.1}},
	}
	var pt Target
	for _, x := range r.Targets() {
		if strings.Contains(x.What, "tag_bw UCX_TLS=sm") {
			pt = x
		}
	}
	if pt.Met() || !strings.HasPrefix(pt.Verdict(), "SUSPECT") {
		t.Fatalf("182× target: met %v, verdict %q; want flagged, not met", pt.Met(), pt.Verdict())
	}
	if x := (Target{Ours: 9.9, Theirs: 1, Want: 1}); !x.Met() || x.Verdict() != "met" {
		t.Errorf("9.9×: %q, want met", x.Verdict())
	}
	var tb strings.Builder
	if err := WriteTable(&tb, r); err != nil {
		t.Fatal(err)
	}
	md, _ := RenderMarkdown(r, "", "")
	for _, out := range []string{tb.String(), md} {
		if !strings.Contains(out, "182.00× (suspect)") || !strings.Contains(out, "SUSPECT") {
			t.Errorf("output does not flag the 182× ratio:\n%s", out)
		}
	}
}

// TestLoadWarning: a load average above the CPUs at the start or the end of
// the run is warned about in the plot title, the table and the markdown;
// below it nothing is said.
func TestLoadWarning(t *testing.T) {
	quiet := Method{CPUs: 2, LoadAvg: "1.50 1.00 0.50", LoadAvgEnd: "1.90 1.20 0.60", Config: Config{Reps: 5}}
	if w := quiet.LoadWarning(); w != "" {
		t.Errorf("load below the CPUs warned: %q", w)
	}
	busy := quiet
	busy.LoadAvgEnd = "3.75 2.00 1.00"
	w := busy.LoadWarning()
	if !strings.Contains(w, "3.75") || !strings.Contains(w, "end") || !strings.Contains(w, "2 CPUs") {
		t.Fatalf("warning %q: want the load, when, and the CPUs", w)
	}
	r := &Report{Method: busy}
	title := plotTitle(r)
	for _, want := range []string{"load average (1, 5, 15 min) 1.50 1.00 0.50 at start, 3.75 2.00 1.00 at end", "WARNING: load 3.75 > 2 CPUs (end of run)", "median of 5 reps, bars min–max"} {
		if !strings.Contains(title, want) {
			t.Errorf("plot title %q lacks %q", title, want)
		}
	}
	if strings.Contains(plotTitle(&Report{Method: quiet}), "WARNING") {
		t.Error("quiet run's title warns")
	}
	var tb strings.Builder
	_ = WriteTable(&tb, r)
	md, _ := RenderMarkdown(r, "", "")
	if !strings.Contains(tb.String(), "WARNING: load average 3.75") || !strings.Contains(md, "**Warning: load average 3.75") {
		t.Errorf("table/markdown without the load warning:\n%s\n%s", tb.String(), md)
	}
}

// TestPlotLines: one line per transport and depth, named so, each point the
// median with min–max bars; peers without bars; memcpy from the shallowest
// shm case of each size.
func TestPlotLines(t *testing.T) {
	res := func(tr string, block uint64, depth int, med, lo, hi float64) Result {
		return Result{Case: Case{Transport: tr, BlockBytes: block, Depth: depth}, GBps: Stat{Median: med, Min: lo, Max: hi},
			MemcpyGBps: Stat{Median: 10 * float64(depth), Min: 9, Max: 11 * float64(depth)}}
	}
	r := &Report{
		Method: Method{Config: Config{Transports: []string{"tcp", "shm"}, Reps: 5, Streams: []int{0}}},
		Results: []Result{
			res("tcp", 1<<20, 1, 3, 2, 4), res("tcp", 1<<20, 8, 4, 3.5, 4.5), res("tcp", 4<<10, 8, 0.3, 0.2, 0.4),
			res("shm", 1<<20, 8, 20, 18, 22), res("shm", 1<<20, 1, 15, 14, 16),
		},
		Peers: []PeerResult{{Tool: "iperf3", Test: "tcp", Transport: "tcp", BlockBytes: 1 << 20, ToolBlockBytes: 1 << 20, GBps: 3.1}},
	}
	lines := plotLines(r)
	byName := map[string]plotLine{}
	for _, l := range lines {
		byName[l.name] = l
	}
	tcp8 := byName["kvxfer tcp, depth 8 (median of 5 reps, min–max)"]
	if len(tcp8.pts) != 2 || tcp8.pts[0].X != 4<<10 || tcp8.pts[1].Y != 4 {
		t.Fatalf("tcp depth 8 line %+v (lines %v)", tcp8, lines)
	}
	if lo, hi := tcp8.YError(1); lo != 0.5 || hi != 0.5 {
		t.Errorf("tcp d8 1M bar: -%v +%v, want min–max 3.5–4.5 around 4", lo, hi)
	}
	if _, ok := byName["kvxfer tcp, depth 1 (median of 5 reps, min–max)"]; !ok {
		t.Errorf("no depth-1 line: %v", lines)
	}
	if p := byName["iperf3 tcp (peer, one run per size)"]; len(p.pts) != 1 || p.lo != nil {
		t.Errorf("peer line %+v: want one point, no bars", p)
	}
	mc := byName["memcpy, 1 goroutine (shm working set; median, min–max)"]
	if len(mc.pts) != 1 || mc.pts[0].Y != 10 {
		t.Errorf("memcpy line %+v: want the depth-1 shm case's memcpy (10)", mc)
	}
	if len(lines) != 6 {
		t.Errorf("%d lines, want tcp d1, tcp d8, shm d8, shm d1, iperf3, memcpy", len(lines))
	}
}
