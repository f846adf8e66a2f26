package workload

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func patternBuffers(tb testing.TB, m ModelConfig, tp, tpRank int, pages int, o BufferOptions) *KVBuffers {
	tb.Helper()
	l, err := NewLayout(m, LayoutOptions{PageSize: 16, TPSize: tp, TPRank: tpRank, PPSize: 1, NumPages: pages})
	if err != nil {
		tb.Fatal(err)
	}
	if o.Name == "" {
		o.Name = "pattern"
	}
	if o.Device == 0 {
		o.Device = -1
	}
	b, err := NewKVBuffers(l, o)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return b
}

func TestPatternFillVerify(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 2, NumKVHeads: 2, HeadDim: 6, DtypeBytes: 2} // 12-byte rows: exercises the tail
	for _, contiguous := range []bool{false, true} {
		p := patternBuffers(t, m, 1, 0, 8, BufferOptions{Contiguous: contiguous})
		pages := []int32{5, 1, 2}
		if err := FillPattern(p, 77, pages, 0); err != nil {
			t.Fatal(err)
		}
		if err := VerifyPattern(p, 77, pages, 0); err != nil {
			t.Fatal(err)
		}
		if err := VerifyPattern(p, 78, pages, 0); err == nil || !strings.Contains(err.Error(), "room 78") {
			t.Fatalf("wrong room verified: %v", err)
		}
		// The same bytes seen as logical pages 4.. of the request (a prefix of
		// 4 pages) are another request's bytes.
		if err := VerifyPattern(p, 77, pages, 4); err == nil {
			t.Fatal("pages verified at the wrong token offset")
		}
		il := p.Layout().ItemLen()
		p.Bytes(1)[2*il+13] ^= 1 // buffer 1 (layer 1 K), page 2 = logical page 2
		err := VerifyPattern(p, 77, pages, 0)
		if err == nil || !strings.Contains(err.Error(), "layer 1 K, token 32 (page 2), head 1, byte 1 ") {
			t.Fatalf("flipped bit: %v", err)
		}
	}
}

func TestPatternPrefixOffset(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 1, NumKVHeads: 1, HeadDim: 8, DtypeBytes: 2}
	p := patternBuffers(t, m, 1, 0, 8, BufferOptions{})
	// Logical pages 0-1 from room 5 (a held prefix), pages 2-3 from room 6.
	if err := FillPattern(p, 5, []int32{3, 4}, 0); err != nil {
		t.Fatal(err)
	}
	if err := FillPattern(p, 6, []int32{0, 7}, 2); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 5, []int32{3, 4}, 0); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 6, []int32{0, 7}, 2); err != nil {
		t.Fatal(err)
	}
	err := VerifyPattern(p, 6, []int32{3}, 0)
	if err == nil || !strings.Contains(err.Error(), "room 6") {
		t.Fatalf("prefix page verified against the later room: %v", err)
	}
}

func TestAuxPattern(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 1, NumKVHeads: 1, HeadDim: 8, DtypeBytes: 2}
	p := patternBuffers(t, m, 1, 0, 4, BufferOptions{Aux: DefaultAux, AuxRows: 3})
	if err := FillAux(p, 9, 1); err != nil {
		t.Fatal(err)
	}
	if err := VerifyAux(p, 9, 1); err != nil {
		t.Fatal(err)
	}
	if err := VerifyAux(p, 9, 0); err == nil || !strings.Contains(err.Error(), "output_ids row 0") {
		t.Fatalf("empty row verified: %v", err)
	}
	p.AuxRow(6, 1)[3] ^= 1
	if err := VerifyAux(p, 9, 1); err == nil || !strings.Contains(err.Error(), "bootstrap_room row 1, byte 3") {
		t.Fatalf("flipped aux byte: %v", err)
	}
	if err := FillAux(p, 9, 3); err == nil {
		t.Fatal("aux row beyond the buffers filled")
	}
	if _, err := NewKVBuffers(p.Layout(), BufferOptions{Device: -1, Aux: DefaultAux}); err == nil {
		t.Fatal("aux buffers without rows accepted")
	}
}

func TestKVBuffersArgs(t *testing.T) {
	m, _ := LookupModel("llama-3.1-8b")
	l, err := NewLayout(m, LayoutOptions{PageSize: 16, TPSize: 2, TPRank: 1, PPSize: 2, PPRank: 1, NumPages: 4})
	if err != nil {
		t.Fatal(err)
	}
	for _, contiguous := range []bool{false, true} {
		b, err := NewKVBuffers(l, BufferOptions{Device: -1, Contiguous: contiguous, Aux: DefaultAux, AuxRows: 8})
		if err != nil {
			t.Fatal(err)
		}
		a := b.Args()
		g, err := a.Geometry()
		if err != nil {
			t.Fatal(err)
		}
		if len(a.KVBuffers) != 32 || g.StartLayer != 16 || g.EndLayer != 32 || g.NumPages() != 4 || g.KVHeadNum != 4 || g.TotalKVHeadNum != 8 ||
			a.EngineRank != 1 || a.TPSize != 2 || a.PPRank != 1 || a.PPSize != 2 || g.AuxRows() != 8 || len(a.AuxBuffers) != len(DefaultAux) {
			t.Fatalf("contiguous %v: args %+v geometry %+v", contiguous, a, g)
		}
		for i, kb := range a.KVBuffers {
			if kb.ItemLen != l.ItemLen() || kb.Length != l.BufferLen() || kb.FD < 0 {
				t.Fatalf("buffer %d: %+v", i, kb)
			}
			if contiguous && kb.Addr != a.KVBuffers[0].Addr+uintptr(l.BufferOffset(i)) {
				t.Fatalf("contiguous buffer %d not at its offset", i)
			}
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if err := b.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	}
}

func BenchmarkFillPattern(b *testing.B) {
	m, _ := LookupModel("llama-3.1-8b")
	p := patternBuffers(b, m, 1, 0, 64, BufferOptions{})
	pages := make([]int32, 64)
	for i := range pages {
		pages[i] = int32(i)
	}
	b.SetBytes(int64(p.Layout().PoolBytes()))
	for b.Loop() {
		_ = FillPattern(p, 1, pages, 0)
	}
}

func BenchmarkVerifyPattern(b *testing.B) {
	m, _ := LookupModel("llama-3.1-8b")
	p := patternBuffers(b, m, 1, 0, 64, BufferOptions{})
	pages := make([]int32, 64)
	for i := range pages {
		pages[i] = int32(i)
	}
	_ = FillPattern(p, 1, pages, 0)
	b.SetBytes(int64(p.Layout().PoolBytes()))
	for b.Loop() {
		if err := VerifyPattern(p, 1, pages, 0); err != nil {
			b.Fatal(err)
		}
	}
}

func TestBuffersPrefault(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 1, NumKVHeads: 1, HeadDim: 8, DtypeBytes: 2}
	p := patternBuffers(t, m, 1, 0, 64, BufferOptions{Aux: DefaultAux, AuxRows: 2})
	if err := p.Prefault(); err != nil {
		t.Skipf("kernel cannot prefault: %v", err)
	}
	if p.Bytes(0)[63*p.Layout().ItemLen()] != 0 {
		t.Fatal("prefaulted memory is not zero")
	}
}

// TestPatternLayers: filling one layer writes only its K and V buffers; the
// layer checks see exactly that.
func TestPatternLayers(t *testing.T) {
	m := ModelConfig{Name: "t", NumLayers: 3, NumKVHeads: 2, HeadDim: 6, DtypeBytes: 2}
	p := patternBuffers(t, m, 1, 0, 8, BufferOptions{})
	pages := []int32{4, 0}
	if err := FillPatternLayers(p, 9, pages, 3, 1, 1); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPatternLayers(p, 9, pages, 3, 1, 1); err != nil {
		t.Fatal(err)
	}
	for _, l := range []int{0, 2} {
		if err := VerifyPatternLayers(p, 9, pages, 3, l, l); err == nil || !strings.Contains(err.Error(), "layer "+string(rune('0'+l))+" K") {
			t.Fatalf("layer %d never filled, verify = %v", l, err)
		}
	}
	if err := FillPatternLayers(p, 9, pages, 3, 0, 2); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 9, pages, 3); err != nil {
		t.Fatal(err)
	}
}

// TestKVBuffersStop: a closed BufferOptions.Stop stops the allocation before
// the next buffer with an error wrapping ErrAllocStopped that names the
// buffers; an open one allocates them all.
func TestKVBuffersStop(t *testing.T) {
	m, _ := LookupModel("llama-3.1-8b")
	l, err := NewLayout(m, LayoutOptions{PageSize: 16, TPSize: 1, PPSize: 1, NumPages: 4})
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	b, err := NewKVBuffers(l, BufferOptions{Name: "open", Device: -1, Stop: stop})
	if err != nil {
		t.Fatalf("open Stop: %v", err)
	}
	b.Close()
	close(stop)
	_, err = NewKVBuffers(l, BufferOptions{Name: "stopped", Device: -1, Stop: stop})
	if !errors.Is(err, ErrAllocStopped) || !strings.Contains(err.Error(), `"stopped"`) || !strings.Contains(err.Error(), fmt.Sprintf("after 0 of %d buffers", l.NumBuffers())) {
		t.Fatalf("closed Stop: %v; want ErrAllocStopped naming the buffers", err)
	}
}
