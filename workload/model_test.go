package workload

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKVCacheDtypeBytes(t *testing.T) {
	want := map[string]int{"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
	for _, s := range KVCacheDtypes {
		got, err := KVCacheDtypeBytes(s)
		if err != nil || got != want[s] {
			t.Errorf("%q: %d %v, want %d", s, got, err, want[s])
		}
		delete(want, s)
	}
	if len(want) != 0 {
		t.Errorf("KVCacheDtypes lacks %v", want)
	}
	for _, s := range []string{"", "bogus", "AUTO", "fp8", "int8"} {
		if _, err := KVCacheDtypeBytes(s); err == nil || !strings.Contains(err.Error(), "fp8_e4m3") {
			t.Errorf("%q: err %v, want one listing the accepted strings", s, err)
		}
	}
}

func TestLookupModelMessages(t *testing.T) {
	dir := t.TempDir()
	cfg := `{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "torch_dtype": "bfloat16"}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	cases := []struct {
		in     string
		errHas string // "" = loads
	}{
		{"llama-3.1-8b", ""},
		{filepath.Join(dir, "config.json"), ""},
		{dir, ""}, // a model directory: its config.json
		{"/nonexistent/config.json", "no such file"},
		{"missing.json", "no such file"},
		{"some/dir", "no such file"},
		{empty, "without a config.json"},
		{"no-such-model", "unknown model"},
	}
	for _, c := range cases {
		_, err := LookupModel(c.in)
		if (c.errHas == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.errHas)) {
			t.Errorf("%q: err %v, want %q", c.in, err, c.errHas)
		}
	}
}
