package kvargs_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// hostBuf is a fake buffer description at addr (never dereferenced: only
// Geometry is called on these).
func hostBuf(addr uintptr, length, item uint64) kvargs.Buffer {
	return kvargs.Buffer{Memory: transport.Memory{Addr: addr, Length: length, Kind: transport.MemoryHost, FD: -1}, ItemLen: item}
}

func TestKVArgsGeometryRefusals(t *testing.T) {
	good := func() kvargs.KVArgs {
		// 2 layers, K and V, 4 pages of 4 tokens × 2 heads × 8 bytes.
		var kv []kvargs.Buffer
		for i := range 4 {
			kv = append(kv, hostBuf(uintptr(0x10000+i*0x1000), 4*64, 64))
		}
		return kvargs.KVArgs{KVBuffers: kv, AuxBuffers: []kvargs.Buffer{hostBuf(0x20000, 8*32, 32)}, PageSize: 4, KVHeadNum: 2, TotalKVHeadNum: 4, TPSize: 2, EngineRank: 1, GPUID: -1}
	}
	g, err := func() (*kvargs.Geometry, error) { a := good(); return a.Geometry() }()
	if err != nil {
		t.Fatal(err)
	}
	if g.Layers() != 2 || g.NumPages() != 4 || g.AuxRows() != 8 || g.TPRank != 1 || g.TotalKVHeadNum != 4 {
		t.Fatalf("geometry %+v", g)
	}
	cases := []struct {
		name string
		mod  func(*kvargs.KVArgs)
		want string
	}{
		{"no buffers", func(a *kvargs.KVArgs) { a.KVBuffers = nil }, "no KV buffers"},
		{"odd MHA count", func(a *kvargs.KVArgs) { a.KVBuffers = a.KVBuffers[:3] }, "3 KV buffers: an MHA/GQA rank gives K buffers then V buffers"},
		{"zero length", func(a *kvargs.KVArgs) { a.KVBuffers[1].Length = 0 }, "KV buffer 1 (layer 1 K): address 0x11000, length 0"},
		{"zero item", func(a *kvargs.KVArgs) { a.AuxBuffers[0].ItemLen = 0 }, "aux buffer 0: item length is 0"},
		{"smaller than an item", func(a *kvargs.KVArgs) { a.KVBuffers[2].Length = 10 }, "KV buffer 2 (layer 0 V): 10 bytes hold no item of 64 bytes"},
		{"not whole heads", func(a *kvargs.KVArgs) { a.KVBuffers[3].ItemLen = 60; a.KVBuffers[3].Length = 600 }, "item length 60 bytes is not page_size 4 × kv_head_num 2 whole head rows"},
		{"overlap", func(a *kvargs.KVArgs) { a.AuxBuffers[0].Addr = 0x10000 + 0x1000 + 100 }, "overlaps KV buffer 1 (layer 1 K)"},
		{"page size", func(a *kvargs.KVArgs) { a.PageSize = 0 }, "page_size 0"},
		{"rank", func(a *kvargs.KVArgs) { a.EngineRank = 2 }, "engine_rank 2 not in [0, tp size 2)"},
		{"heads", func(a *kvargs.KVArgs) { a.KVHeadNum = 4 }, "kv_head_num 4, but total_kv_head_num 4 over tp size 2 gives 2 heads per rank"},
		{"mla heads", func(a *kvargs.KVArgs) { a.MLA = true }, "kv_head_num 2 on an MLA rank"},
		{"gpu", func(a *kvargs.KVArgs) {
			a.GPUID = 1
			a.KVBuffers[0].Kind, a.KVBuffers[0].Device = transport.MemoryCUDA, 0
		}, "is on cuda:0, but the rank's gpu_id is 1"},
	}
	for _, c := range cases {
		a := good()
		c.mod(&a)
		_, err := a.Geometry()
		if err == nil || !errors.Is(err, kvargs.ErrBadKVArgs) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v, want ErrBadKVArgs containing %q", c.name, err, c.want)
		}
	}
}

// geometryOf is the Geometry a workload layout's buffers would give (no
// memory is allocated: the addresses are fake).
func geometryOf(t *testing.T, m workload.ModelConfig, tp, rank, pp, ppRank int, aux []uint64) *kvargs.Geometry {
	t.Helper()
	l, err := workload.NewLayout(m, workload.LayoutOptions{PageSize: 4, TPSize: tp, TPRank: rank, PPSize: pp, PPRank: ppRank, NumPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	total := m.NumKVHeads
	a := kvargs.KVArgs{PageSize: 4, KVHeadNum: l.HeadsPerRank, TotalKVHeadNum: total, TPSize: tp, EngineRank: rank, PPSize: pp, PPRank: ppRank,
		PrefillStartLayer: l.StartLayer, MLA: m.MLA, GPUID: -1}
	for i := 0; i < l.NumBuffers(); i++ {
		a.KVBuffers = append(a.KVBuffers, hostBuf(uintptr(1<<20+i<<16), l.BufferLen(), l.ItemLen()))
	}
	for i, n := range aux {
		a.AuxBuffers = append(a.AuxBuffers, hostBuf(uintptr(1<<30+i<<16), 4*n, n))
	}
	g, err := a.Geometry()
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func TestPairBuffersSlices(t *testing.T) {
	m := workload.ModelConfig{NumLayers: 2, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2}
	geo := func(tp, r int) *kvargs.Geometry { return geometryOf(t, m, tp, r, 1, 0, nil) }
	hb := uint64(256)
	cases := []struct {
		src, dst       *kvargs.Geometry
		srcOff, dstOff uint64
		length         uint64
	}{
		{geo(1, 0), geo(1, 0), 0, 0, 8 * hb},
		{geo(2, 0), geo(1, 0), 0, 0, 4 * hb},
		{geo(2, 1), geo(1, 0), 0, 4 * hb, 4 * hb},
		{geo(1, 0), geo(2, 1), 4 * hb, 0, 4 * hb},
		{geo(4, 3), geo(2, 1), 0, 2 * hb, 2 * hb},
		{geo(2, 1), geo(16, 15), 3 * hb, 0, hb}, // decode rank 15 holds head 7 = src rank 1's head 3
	}
	for i, c := range cases {
		ps, err := kvargs.PairBuffers(c.src, c.dst, "P", "D")
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if len(ps) != 4 {
			t.Fatalf("case %d: %d pairs", i, len(ps))
		}
		for _, p := range ps {
			s := p.Slice
			if p.Src != p.Dst || s.SrcOffset != c.srcOff || s.DstOffset != c.dstOff || s.Length != c.length {
				t.Errorf("case %d buffer %d: %+v; want src %d dst %d len %d", i, p.Src, p, c.srcOff, c.dstOff, c.length)
			}
		}
	}
	// PP: a stage's buffers map onto the decode's full list (K then V).
	src, dst := geometryOf(t, workload.ModelConfig{NumLayers: 5, NumKVHeads: 2, HeadDim: 8, DtypeBytes: 2}, 1, 0, 2, 1, nil),
		geometryOf(t, workload.ModelConfig{NumLayers: 5, NumKVHeads: 2, HeadDim: 8, DtypeBytes: 2}, 1, 0, 1, 0, nil)
	ps, err := kvargs.PairBuffers(src, dst, "P", "D")
	if err != nil {
		t.Fatal(err)
	}
	// Stage 1 of 2 holds layers [3, 5): its K buffers go to decode 3, 4; V to 8, 9.
	if got := []int{ps[0].Dst, ps[1].Dst, ps[2].Dst, ps[3].Dst}; got[0] != 3 || got[1] != 4 || got[2] != 8 || got[3] != 9 || !ps[0].Full {
		t.Fatalf("pp pairs %+v", ps)
	}
}

func TestPairBuffersRefusals(t *testing.T) {
	gqa := workload.ModelConfig{NumLayers: 2, NumKVHeads: 4, HeadDim: 16, DtypeBytes: 2}
	aux := []uint64{64, 512}
	base := func() (*kvargs.Geometry, *kvargs.Geometry) {
		return geometryOf(t, gqa, 1, 0, 1, 0, aux), geometryOf(t, gqa, 1, 0, 1, 0, aux)
	}
	cases := []struct {
		name string
		mod  func(src, dst *kvargs.Geometry)
		want string
	}{
		{"mla", func(s, d *kvargs.Geometry) { d.MLA = true }, "prefill MLA is false (4 KV buffers), decode MLA is true"},
		{"page size", func(s, d *kvargs.Geometry) { d.PageSize = 8 }, "page size differs: prefill 4 tokens, decode 8 tokens"},
		{"heads", func(s, d *kvargs.Geometry) { d.TotalKVHeadNum = 8 }, "total KV heads differ: prefill 4, decode 8"},
		{"layers", func(s, d *kvargs.Geometry) { s.StartLayer, s.EndLayer = 1, 3 }, "prefill holds layers [1, 3), decode holds [0, 2)"},
		{"item lens", func(s, d *kvargs.Geometry) { d.KVItemLens[2] = 256 }, "prefill KV buffer 2 (layer 0 V) is 512 bytes per page, decode KV buffer 2 (layer 0 V) is 256 bytes per page"},
		{"aux count", func(s, d *kvargs.Geometry) { d.AuxItemLens, d.AuxItems = d.AuxItemLens[:1], d.AuxItems[:1] }, "aux buffer counts differ: prefill has 2, decode has 1"},
		{"aux item", func(s, d *kvargs.Geometry) { d.AuxItemLens[1] = 256 }, "aux buffer 1 item lengths differ: prefill 512 bytes, decode 256 bytes"},
		{"state tp", func(s, d *kvargs.Geometry) {
			s.StateItemLens, d.StateItemLens = []uint64{64}, []uint64{64}
			d.TPSize, d.KVHeadNum = 2, 2
		}, "state buffers do not support different TP sizes"},
		{"head bytes", func(s, d *kvargs.Geometry) {
			d.TPSize, d.KVHeadNum = 2, 2
			for i := range d.KVItemLens {
				d.KVItemLens[i] = 4 * 2 * 8 // 8 bytes per head instead of 32
			}
		}, "bytes per head differ: prefill KV buffer 0 (layer 0 K) holds 128 bytes per token over 4 heads, decode KV buffer 0 (layer 0 K) holds 16 bytes per token over 2 heads"},
	}
	for _, c := range cases {
		s, d := base()
		c.mod(s, d)
		_, err := kvargs.PairBuffers(s, d, "tcp://p:1", "tcp://d:2")
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "prefill tcp://p:1 and decode tcp://d:2") {
			t.Errorf("%s: err %v, want one naming both ranks and %q", c.name, err, c.want)
		}
	}
}

// auxModel is a model whose ranks differ only in their aux lists.

// TestKVArgsUnknownHeads: a non-MLA rank whose KVArgs give neither head
// count (SGLang's decode) gets a geometry with both 0 (unknown), not one
// head per rank; one count given derives the other.
func TestKVArgsUnknownHeads(t *testing.T) {
	kv := func(item uint64) []kvargs.Buffer {
		var b []kvargs.Buffer
		for i := range 4 {
			b = append(b, hostBuf(uintptr(0x10000+i*0x1000), 4*item, item))
		}
		return b
	}
	a := kvargs.KVArgs{KVBuffers: kv(64), PageSize: 4, TPSize: 2, GPUID: -1}
	g, err := a.Geometry()
	if err != nil || !g.HeadsUnknown() || g.KVHeadNum != 0 || g.TotalKVHeadNum != 0 {
		t.Fatalf("geometry %+v, %v: want heads unknown (0, 0)", g, err)
	}
	a.KVBuffers = kv(62) // not whole token rows of 4 tokens
	if _, err := a.Geometry(); err == nil || !strings.Contains(err.Error(), "item length 62 bytes is not page_size 4 whole token rows") {
		t.Fatalf("err %v, want a refusal of a partial token row", err)
	}
	a = kvargs.KVArgs{KVBuffers: kv(64), PageSize: 4, TPSize: 2, TotalKVHeadNum: 8, GPUID: -1}
	if g, err := a.Geometry(); err != nil || g.KVHeadNum != 4 || g.HeadsUnknown() {
		t.Fatalf("total 8 over tp 2: %+v, %v; want 4 heads per rank", g, err)
	}
	a = kvargs.KVArgs{KVBuffers: kv(64)[:2], PageSize: 4, MLA: true, GPUID: -1}
	if g, err := a.Geometry(); err != nil || g.KVHeadNum != 1 || g.HeadsUnknown() {
		t.Fatalf("MLA without counts: %+v, %v; want 1 latent head", g, err)
	}
}

// unknownHeads is g as a decode that stated no head counts sends it.
func unknownHeads(g *kvargs.Geometry) *kvargs.Geometry {
	c := *g
	c.KVHeadNum, c.TotalKVHeadNum = 0, 0
	return &c
}

// TestPairBuffersUnknownDecodeHeads: a decode whose KVArgs give no head
// counts takes the prefill's: the pairs (head slices included) are those of
// a decode that stated the right counts, at equal and at different TP sizes,
// replicated KV heads included, whichever side computes them; a decode row
// that is not the prefill's heads per rank is refused naming both.
func TestPairBuffersUnknownDecodeHeads(t *testing.T) {
	eight := workload.ModelConfig{NumLayers: 2, NumKVHeads: 8, HeadDim: 16, DtypeBytes: 2}
	two := workload.ModelConfig{NumLayers: 2, NumKVHeads: 2, HeadDim: 16, DtypeBytes: 2}
	cases := []struct {
		m               workload.ModelConfig
		ptp, prank      int
		dtp, drank      int
		wantDecodeHeads int
	}{
		{eight, 1, 0, 1, 0, 8}, {eight, 2, 1, 1, 0, 8}, {eight, 1, 0, 2, 1, 4}, {eight, 4, 3, 2, 1, 4}, {eight, 2, 0, 8, 5, 1},
		{two, 4, 2, 1, 0, 2}, {two, 4, 3, 2, 1, 1}, {two, 8, 6, 2, 1, 1}, {two, 1, 0, 4, 3, 1}, {two, 2, 1, 4, 2, 1},
	}
	for _, c := range cases {
		src, dst := geometryOf(t, c.m, c.ptp, c.prank, 1, 0, nil), geometryOf(t, c.m, c.dtp, c.drank, 1, 0, nil)
		want, err := kvargs.PairBuffers(src, dst, "P", "D")
		if err != nil {
			t.Fatalf("%+v: known heads: %v", c, err)
		}
		got, err := kvargs.PairBuffers(src, unknownHeads(dst), "P", "D")
		if err != nil {
			t.Fatalf("%+v: unknown decode heads: %v", c, err)
		}
		if len(got) != len(want) {
			t.Fatalf("%+v: %d pairs, want %d", c, len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%+v pair %d: %+v, want %+v", c, i, got[i], want[i])
			}
		}
		_, rd, err := kvargs.ResolveHeads(src, unknownHeads(dst), "P", "D")
		if err != nil || rd.KVHeadNum != c.wantDecodeHeads || rd.TotalKVHeadNum != c.m.NumKVHeads {
			t.Errorf("%+v: resolved decode %+v, %v; want %d heads of %d", c, rd, err, c.wantDecodeHeads, c.m.NumKVHeads)
		}
	}
	// A decode row that is not the prefill's heads per rank: refused, naming both.
	src, dst := geometryOf(t, eight, 2, 0, 1, 0, nil), geometryOf(t, eight, 1, 0, 1, 0, nil)
	bad := unknownHeads(dst)
	bad.KVItemLens = append([]uint64(nil), bad.KVItemLens...)
	bad.KVItemLens[0] = bad.KVItemLens[0] / 2 // 4 heads instead of 8
	_, err := kvargs.PairBuffers(src, bad, "tcp://p:1", "tcp://d:2")
	for _, w := range []string{"prefill tcp://p:1 and decode tcp://d:2", "8 KV heads over decode tp 1 is 8 heads per token row of 32 bytes", "decode KV buffer 0 (layer 0 K) holds 128 bytes per token (4 heads)"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("err %v, want %q", err, w)
		}
	}
	// A real mismatch stays one: a decode that states 4 total heads.
	wrong := *dst
	wrong.TotalKVHeadNum, wrong.KVHeadNum = 4, 4
	if _, err := kvargs.PairBuffers(src, &wrong, "P", "D"); err == nil || !strings.Contains(err.Error(), "total KV heads differ: prefill 8, decode 4") {
		t.Errorf("err %v, want total KV heads differ", err)
	}
	// Neither side states heads: equal TP sizes need none, different ones are refused.
	if _, err := kvargs.PairBuffers(unknownHeads(dst), unknownHeads(dst), "P", "D"); err != nil {
		t.Errorf("both unknown at equal TP: %v", err)
	}
	if _, err := kvargs.PairBuffers(unknownHeads(src), unknownHeads(dst), "P", "D"); err == nil || !strings.Contains(err.Error(), "neither side states its KV head count") {
		t.Errorf("both unknown at different TP: %v", err)
	}
	// The decode's heads cannot be split: 8 heads over decode tp 3.
	d3 := *unknownHeads(dst)
	d3.TPSize, d3.TPRank = 3, 0
	if _, err := kvargs.PairBuffers(src, &d3, "P", "D"); err == nil || !strings.Contains(err.Error(), "8 KV heads are taken, and they cannot be split over decode tp size 3") {
		t.Errorf("err %v, want a refusal of 8 heads over tp 3", err)
	}
}
