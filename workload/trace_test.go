package workload

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// sharedTraceDir is the project's shared folder beside the checkout
// (../shared/data/traces from the repository root), where the real traces
// are when the checkout has one; the tests that compare with them skip
// without it.
const sharedTraceDir = "../../shared/data/traces"

func traceStats(rs []Request) (meanIn, meanOut, hit float64) {
	for _, r := range rs {
		meanIn += float64(r.InputLength)
		meanOut += float64(r.OutputLength)
	}
	n := float64(len(rs))
	return meanIn / n, meanOut / n, PrefixHitFraction(rs)
}

// TestGenerateTraceShape: a generated trace of each shape has the
// published trace's mean input and output length (±10 %) and prefix
// sharing (±0.05), arrivals in order, every prompt's hash_ids one per
// 512-token block, and the same requests for the same seed.
func TestGenerateTraceShape(t *testing.T) {
	for _, s := range TraceShapes {
		rs := GenerateTrace(s, s.Requests, 7)
		in, out, hit := traceStats(rs)
		if math.Abs(in/s.MeanInput-1) > 0.1 || math.Abs(out/s.MeanOutput-1) > 0.1 || math.Abs(hit-s.PrefixHit) > 0.05 {
			t.Errorf("%s: mean input %.0f (want %.0f), output %.0f (want %.0f), prefix hit %.3f (want %.3f)", s.Name, in, s.MeanInput, out, s.MeanOutput, hit, s.PrefixHit)
		}
		for i, r := range rs {
			if i > 0 && r.Timestamp < rs[i-1].Timestamp {
				t.Fatalf("%s: request %d arrives before request %d", s.Name, i, i-1)
			}
			if len(r.HashIDs) != (r.InputLength+DefaultBlockTokens-1)/DefaultBlockTokens || r.InputLength < s.InputMin || r.InputLength > s.InputMax {
				t.Fatalf("%s: request %d: %d tokens, %d hash ids", s.Name, i, r.InputLength, len(r.HashIDs))
			}
			if s.SystemBlock && r.HashIDs[0] != 0 {
				t.Fatalf("%s: request %d does not start with the system block", s.Name, i)
			}
		}
		again := GenerateTrace(s, 50, 7)
		for i := range again {
			if again[i].InputLength != rs[i].InputLength || again[i].Timestamp != rs[i].Timestamp {
				t.Fatalf("%s: seed 7 gave different requests", s.Name)
			}
		}
	}
}

// TestTraceShapesMatchFiles: the shapes' recorded figures are those of the
// real traces (when the shared folder, or KVXFER_TRACE_DIR, has them).
func TestTraceShapesMatchFiles(t *testing.T) {
	dir := sharedTraceDir
	if d := os.Getenv("KVXFER_TRACE_DIR"); d != "" {
		dir = d
	}
	for _, s := range TraceShapes {
		p := filepath.Join(dir, s.File)
		if _, err := os.Stat(p); err != nil {
			t.Skipf("%s not here (%v): the real traces are %s", p, err, TraceSource)
		}
		rs, err := LoadMooncake(p, 0)
		if err != nil {
			t.Fatal(err)
		}
		in, out, hit := traceStats(rs)
		if len(rs) != s.Requests || math.Abs(in-s.MeanInput) > 1 || math.Abs(out-s.MeanOutput) > 1 || math.Abs(hit-s.PrefixHit) > 0.001 {
			t.Errorf("%s: %d requests, mean input %.1f, output %.1f, prefix hit %.4f; the shape records %d, %.0f, %.0f, %.3f",
				s.File, len(rs), in, out, hit, s.Requests, s.MeanInput, s.MeanOutput, s.PrefixHit)
		}
	}
}

// TestResolveTrace: a shape name finds its file in the first directory
// that has it and otherwise resolves to the shape alone (with where it
// looked); a missing path is an error naming where the real traces come
// from and the names that work without a file.
func TestResolveTrace(t *testing.T) {
	dir := t.TempDir()
	tf, err := ResolveTrace("conversation", []string{"", filepath.Join(dir, "none"), dir})
	if err != nil || tf.Path != "" || tf.Shape.Name != "conversation" || len(tf.Looked) != 2 {
		t.Fatalf("no file anywhere: %+v, %v", tf, err)
	}
	f := filepath.Join(dir, "conversation_trace.jsonl")
	if err := os.WriteFile(f, []byte(`{"timestamp":0,"input_length":5,"output_length":1,"hash_ids":[0]}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if tf, err = ResolveTrace("conversation", []string{filepath.Join(dir, "none"), dir}); err != nil || tf.Path != f {
		t.Fatalf("file in the second dir: %+v, %v", tf, err)
	}
	if tf, err = ResolveTrace(f, nil); err != nil || tf.Path != f || tf.Shape.Name != "" {
		t.Fatalf("path: %+v, %v", tf, err)
	}
	_, err = ResolveTrace("../shared/data/traces/nope.jsonl", nil)
	if err == nil || !strings.Contains(err.Error(), "kvcache-ai/Mooncake") || !strings.Contains(err.Error(), "--trace conversation") {
		t.Fatalf("missing path: %v", err)
	}
}
