package engine

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/kvargs"
)

// checkGeometry is a decode's geometry for TestCheckTransfer: 99 pages
// (smallest KV buffer 3), 32 aux rows, no state.
func checkGeometry() kvargs.Geometry {
	return kvargs.Geometry{TPRank: 1, TPSize: 2, PPRank: 0, PPSize: 1, StartLayer: 0, EndLayer: 2, PageSize: 16, KVHeadNum: 4, TotalKVHeadNum: 8,
		KVItemLens: []uint64{4096, 4096, 4096, 4096}, KVItems: []uint64{100, 100, 100, 99},
		AuxItemLens: []uint64{64, 512}, AuxItems: []uint64{32, 32}}
}

// TestCheckTransfer: a TRANSFER naming a page, aux row or state slot beyond
// the decode's registered buffers, a destination page twice, a ring slot
// beyond its ring, or a prefix
// that is not whole pages is refused (the prefill answers STATUS Failed with
// this text), never turned into a write.
func TestCheckTransfer(t *testing.T) {
	g := checkGeometry() // 99 pages (smallest KV buffer 3), 32 aux rows, no state
	ok := control.TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{0, 98}, Slot: 63, RequiredDstInfoNum: 1, Epoch: 1, AuxIndex: 31, PrefixTokens: 32}
	if err := checkTransfer(&ok, &g, 64); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		mod  func(*control.TransferMsg)
		want string
	}{
		{func(m *control.TransferMsg) { m.Pages = []int32{99} }, "destination page 99 (index 0 of 1) is beyond KV buffer 3 (layer 1 V), which holds 99 pages"},
		{func(m *control.TransferMsg) { m.Pages = []int32{7, 8, 7} }, "destination page 7 is given twice, at indices 0 and 2 of 3"},
		{func(m *control.TransferMsg) { m.Slot = 64 }, "metadata slot 64 outside the decode's ring of 64"},
		{func(m *control.TransferMsg) { m.AuxIndex = 32 }, "aux index 32 is beyond aux buffer 0, which holds 32 rows"},
		{func(m *control.TransferMsg) { m.StateIndices = []int32{0} }, "1 state indices given, but there are no state buffers"},
		{func(m *control.TransferMsg) { m.PrefixTokens = 20 }, "decode_prefix_len 20 is not whole pages of 16 tokens"},
	}
	for _, c := range cases {
		m := ok
		c.mod(&m)
		if err := checkTransfer(&m, &g, 64); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("err %v, want %q", err, c.want)
		}
	}
}
