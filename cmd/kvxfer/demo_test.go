package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
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
				Summary demoSummary `json:"summary"`
			}
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			s := got.Summary
			if s.Requests != 3 || s.Verified != 3 || s.Failures != 0 || s.Bytes == 0 || len(s.Used) == 0 {
				t.Fatalf("summary %+v", s)
			}
		})
	}
}

func TestDemoRejectsBadFlags(t *testing.T) {
	for _, f := range []*demoFlags{
		{requests: 1, model: "llama-3.1-8b", prefillTP: 0, prefillPP: 1, decodeTP: 1, concurrency: 1, poolMB: 16},
		{requests: 1, model: "no-such-model", prefillTP: 1, prefillPP: 1, decodeTP: 1, concurrency: 1, poolMB: 16},
		{requests: 1, model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, concurrency: 0, poolMB: 16},
		{requests: 1, model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, concurrency: 1, poolMB: 16, trace: "/nonexistent.jsonl"},
	} {
		if err := runDemo(context.Background(), f); err == nil {
			t.Errorf("flags %+v accepted", f)
		}
	}
}
