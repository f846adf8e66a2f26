package engine

import (
	"strings"
	"testing"
)

func patternPool(tb testing.TB, m ModelConfig, tp, tpRank int, pages int) *KVPool {
	tb.Helper()
	l, err := NewLayout(m, LayoutOptions{PageSize: 16, TPSize: tp, TPRank: tpRank, PPSize: 1, NumPages: pages})
	if err != nil {
		tb.Fatal(err)
	}
	p, err := NewKVPool(l, "pattern")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}

func TestPatternFillVerify(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 2, NumKVHeads: 2, HeadDim: 6, DtypeBytes: 2} // 12-byte rows: exercises the tail
	p := patternPool(t, m, 1, 0, 8)
	pages := []int32{5, 1, 2}
	FillPattern(p, 77, pages)
	if err := VerifyPattern(p, 77, pages); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 78, pages); err == nil || !strings.Contains(err.Error(), "room 78") {
		t.Fatalf("wrong room verified: %v", err)
	}
	p.Item(1, 2)[13] ^= 1 // buffer 1 (layer 1 K), page 2 = logical page 2
	err := VerifyPattern(p, 77, pages)
	if err == nil || !strings.Contains(err.Error(), "layer 1 K, token 32 (page 2), head 1, byte 1 ") {
		t.Fatalf("flipped bit: %v", err)
	}
}

func BenchmarkFillPattern(b *testing.B) {
	m, _ := LookupModel("llama-3.1-8b")
	p := patternPool(b, m, 1, 0, 64)
	pages := make([]int32, 64)
	for i := range pages {
		pages[i] = int32(i)
	}
	b.SetBytes(int64(p.Layout().PoolBytes()))
	for b.Loop() {
		FillPattern(p, 1, pages)
	}
}

func BenchmarkVerifyPattern(b *testing.B) {
	m, _ := LookupModel("llama-3.1-8b")
	p := patternPool(b, m, 1, 0, 64)
	pages := make([]int32, 64)
	for i := range pages {
		pages[i] = int32(i)
	}
	FillPattern(p, 1, pages)
	b.SetBytes(int64(p.Layout().PoolBytes()))
	for b.Loop() {
		if err := VerifyPattern(p, 1, pages); err != nil {
			b.Fatal(err)
		}
	}
}

func TestPoolPrefault(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 1, NumKVHeads: 1, HeadDim: 8, DtypeBytes: 2}
	p := patternPool(t, m, 1, 0, 64)
	if err := p.Prefault(); err != nil {
		t.Skipf("kernel cannot prefault: %v", err)
	}
	if p.Item(0, 63)[0] != 0 {
		t.Fatal("prefaulted memory is not zero")
	}
}
