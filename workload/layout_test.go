package workload

import (
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
)

func TestLayouts(t *testing.T) {
	cases := []struct {
		model           string
		tp, tpRank, pp  int
		ppRank          int
		itemLen         uint64
		buffers, layers int
		start           int
	}{
		{"llama-3.1-8b", 1, 0, 1, 0, 16 * 8 * 128 * 2, 64, 32, 0},
		{"llama-3.1-8b", 2, 1, 1, 0, 16 * 4 * 128 * 2, 64, 32, 0},
		{"llama-3.1-8b", 16, 3, 1, 0, 16 * 1 * 128 * 2, 64, 32, 0}, // GQA replicas
		{"llama-3.1-70b", 1, 0, 2, 1, 16 * 8 * 128 * 2, 80, 40, 40},
		{"qwen2.5-7b", 1, 0, 3, 2, 16 * 4 * 128 * 2, 18, 9, 19},
		{"qwen3-32b", 8, 7, 1, 0, 16 * 1 * 128 * 2, 128, 64, 0},
		{"deepseek-v3", 8, 5, 1, 0, 16 * 576 * 2, 61, 61, 0}, // MLA: replicated latent
	}
	for _, c := range cases {
		m, err := LookupModel(c.model)
		if err != nil {
			t.Fatal(err)
		}
		l, err := NewLayout(m, LayoutOptions{TPSize: c.tp, TPRank: c.tpRank, PPSize: c.pp, PPRank: c.ppRank, NumPages: 10})
		if err != nil {
			t.Fatalf("%s: %v", c.model, err)
		}
		if l.ItemLen() != c.itemLen || l.NumBuffers() != c.buffers || l.Layers() != c.layers || l.StartLayer != c.start {
			t.Errorf("%s tp %d/%d pp %d/%d: item %d buffers %d layers %d start %d; want %d %d %d %d", c.model, c.tpRank, c.tp, c.ppRank, c.pp,
				l.ItemLen(), l.NumBuffers(), l.Layers(), l.StartLayer, c.itemLen, c.buffers, c.layers, c.start)
		}
		if l.PoolBytes() != uint64(c.buffers)*10*c.itemLen {
			t.Errorf("%s: pool bytes %d", c.model, l.PoolBytes())
		}
	}
	m, _ := LookupModel("llama-3.1-8b")
	for _, o := range []LayoutOptions{{TPSize: 3, NumPages: 1}, {TPSize: 2, TPRank: 2, NumPages: 1}, {PPSize: 33, NumPages: 1}, {NumPages: 0}} {
		if _, err := NewLayout(m, o); err == nil {
			t.Errorf("layout %+v accepted", o)
		}
	}
	if _, err := LookupModel("gpt-9"); err == nil || !strings.Contains(err.Error(), "llama-3.1-8b") {
		t.Errorf("unknown model error does not list the built-ins: %v", err)
	}
}

func TestLoadHFConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	m, err := LoadHFConfig(write("llama.json", `{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}`))
	if err != nil || m.NumLayers != 32 || m.NumKVHeads != 8 || m.HeadDim != 128 || m.DtypeBytes != 2 || m.MLA {
		t.Fatalf("llama config: %+v %v", m, err)
	}
	m, err = LoadHFConfig(write("ds.json", `{"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}`))
	if err != nil || !m.MLA || m.HeadDim != 576 || m.NumKVHeads != 1 {
		t.Fatalf("deepseek config: %+v %v", m, err)
	}
	m, err = LookupModel(write("vl.json", `{"text_config": {"num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64}}`))
	if err != nil || m.NumLayers != 4 || m.HeadDim != 64 {
		t.Fatalf("nested text_config: %+v %v", m, err)
	}
	for body, want := range map[string]string{
		`{"num_attention_heads": 4}`: "num_hidden_layers",
		`{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}`:                      "not a positive multiple",
		`{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "torch_dtype": "int4"}`: "torch_dtype",
		`[1,2]`: "not valid JSON",
	} {
		if _, err := LoadHFConfig(write("bad.json", body)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err %v, want %q", body, err, want)
		}
	}
}

func TestPageAllocatorFragment(t *testing.T) {
	const n = 4096
	runs := func(p []int32) int { // contiguous runs, as the sender coalesces them
		r := 0
		for i := range p {
			if i == 0 || p[i] != p[i-1]+1 {
				r++
			}
		}
		return r
	}
	a := NewPageAllocator(n)
	p, _ := a.Alloc(256)
	if runs(p) != 1 {
		t.Fatalf("fresh pool: %d runs for 256 pages, want 1", runs(p))
	}
	b := NewPageAllocator(n)
	b.Fragment(7)
	q, err := b.Alloc(256)
	if err != nil {
		t.Fatal(err)
	}
	if r := runs(q); r < 240 {
		t.Fatalf("fragmented pool: %d runs for 256 pages, want nearly one per page", r)
	}
	// Freed pages go back at random places; nothing is lost or duplicated.
	if err := b.Free(q[:100]); err != nil {
		t.Fatal(err)
	}
	rest, err := b.Alloc(n - 156)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	for _, x := range append(rest, q[100:]...) {
		if seen[x] || x < 0 || x >= n {
			t.Fatalf("page %d handed out twice or out of range", x)
		}
		seen[x] = true
	}
	if len(seen) != n || b.FreePages() != 0 {
		t.Fatalf("%d distinct pages, %d free; want all %d out", len(seen), b.FreePages(), n)
	}
	// The same seed gives the same order (the demo's ranks are reproducible).
	c := NewPageAllocator(n)
	c.Fragment(7)
	if r, _ := c.Alloc(256); !reflect.DeepEqual(r, q) {
		t.Fatalf("same seed, different order")
	}
}

func TestPageAllocator(t *testing.T) {
	a := NewPageAllocator(8)
	p1, err := a.Alloc(3)
	if err != nil || !reflect.DeepEqual(p1, []int32{0, 1, 2}) {
		t.Fatalf("alloc 3: %v %v", p1, err)
	}
	p2, _ := a.Alloc(4)
	if _, err := a.Alloc(2); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("over-allocation: %v", err)
	}
	if err := a.Free([]int32{1}); err != nil {
		t.Fatal(err)
	}
	if err := a.Free([]int32{1}); err == nil {
		t.Fatal("double free accepted")
	}
	if err := a.Free([]int32{8}); err == nil {
		t.Fatal("out-of-range free accepted")
	}
	if err := a.Free([]int32{0, 0}); err == nil || a.FreePages() != 2 {
		t.Fatalf("duplicate in one free: %v, free %d", err, a.FreePages())
	}
	p3, _ := a.Alloc(2)
	if !reflect.DeepEqual(p3, []int32{1, 7}) {
		t.Fatalf("lowest-first after free: %v", p3)
	}
	_ = p2
	if _, err := a.Alloc(-1); err == nil {
		t.Fatal("negative count accepted")
	}
}
