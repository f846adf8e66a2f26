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
	if len(ts) != 4 {
		t.Fatalf("%d targets", len(ts))
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
