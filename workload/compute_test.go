package workload

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestComputeShapes(t *testing.T) {
	for _, name := range BuiltinModels() {
		c, err := LookupCompute(name)
		if err != nil {
			t.Fatal(err)
		}
		m, _ := LookupModel(name)
		if c.Layers != m.NumLayers || c.LayerParams <= 0 || c.AttnDim <= 0 {
			t.Fatalf("%s: %+v does not match the KV shape's %d layers", name, c, m.NumLayers)
		}
	}
	// Llama-3.1-8B: 218.1 M weights per layer (q,o 16.8 M each, k,v 4.2 M
	// each, MLP 176.2 M); at 4096 tokens 1.79 TFLOP of weight products plus
	// 0.14 TFLOP of attention.
	c, _ := LookupCompute("Llama_3.1-8B")
	if math.Abs(c.LayerParams-218.1e6) > 0.1e6 {
		t.Fatalf("llama-3.1-8b layer params %.4g", c.LayerParams)
	}
	if f := c.LayerFLOPs(4096); math.Abs(f-1.924e12) > 0.005e12 {
		t.Fatalf("layer FLOPs at 4096 tokens = %.4g, want 1.924e12", f)
	}
	// 400 TFLOPS over TP 2: 1.924e12 / 2 / 4e14 s = 2.4 ms.
	if d := c.LayerTime(4096, 400, 2); d < 2400*time.Microsecond || d > 2410*time.Microsecond {
		t.Fatalf("LayerTime = %s", d)
	}
	if d := c.LayerTime(4096, 0, 1); d != 0 {
		t.Fatalf("LayerTime at 0 TFLOPS = %s, want 0 (no model)", d)
	}
}

func TestComputeShapeHFConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// The built-in Llama-3.1-8B numbers as a config.json give the same shape.
	p := write("llama.json", `{"num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336}`)
	c, err := LookupCompute(p)
	b, _ := LookupCompute("llama-3.1-8b")
	if err != nil || c.LayerParams != b.LayerParams || c.AttnDim != b.AttnDim || c.Layers != 32 {
		t.Fatalf("config.json shape %+v, %v; built-in %+v", c, err, b)
	}
	// DeepSeek-V3's config: MLA latents and 8 + 1 active experts give about
	// the published 37 B activated parameters over 61 layers (within 15 %:
	// embeddings, the dense first layers and the router are left out).
	p = write("dsv3.json", `{"num_hidden_layers":61,"hidden_size":7168,"num_attention_heads":128,"intermediate_size":18432,"moe_intermediate_size":2048,
		"num_experts_per_tok":8,"n_shared_experts":1,"kv_lora_rank":512,"q_lora_rank":1536,"qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128}`)
	c, err = LookupCompute(p)
	if err != nil || math.Abs(c.LayerParams*61-37e9)/37e9 > 0.15 || c.AttnDim != 128*192 {
		t.Fatalf("deepseek config shape %+v (%.3g B over 61 layers), %v", c, c.LayerParams*61/1e9, err)
	}
	p = write("bad.json", `{"num_hidden_layers":4,"num_attention_heads":8}`)
	if _, err := LookupCompute(p); err == nil || !strings.Contains(err.Error(), "hidden_size") || !strings.Contains(err.Error(), "--prefill-layer-time") {
		t.Fatalf("config without hidden_size: %v", err)
	}
	if _, err := LookupCompute("no-such-model"); err == nil || !strings.Contains(err.Error(), "llama-3.1-8b") {
		t.Fatalf("unknown model: %v", err)
	}
}
