package bench

import (
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
