package engine

import (
	"fmt"
	"slices"
)

// checkProducersCovered refuses a prefill attention-TP size P that the
// decode size D does not divide (D < P): SGLang's integer-division mapping
// (bootstrap.TargetRanks) then never contacts prefill tp ranks D·(P/D) … P−1,
// whose sends for every room would end at their bootstrap timeout, so the
// room could never have one outcome on both sides.
func checkProducersCovered(prefillTP, decodeTP int) error {
	if decodeTP >= prefillTP || prefillTP%decodeTP == 0 {
		return nil
	}
	first := decodeTP * (prefillTP / decodeTP)
	return fmt.Errorf("engine: prefill attn_tp_size %d and decode attn_tp_size %d cannot be paired: SGLang's mapping never sends prefill tp ranks %d…%d a decode destination, so their side of every room would time out; use TP sizes where one divides the other",
		prefillTP, decodeTP, first, prefillTP-1)
}

// globalHead returns the model-wide KV head that local head h of a rank
// with geometry g holds (GQA replicas, TP size > heads, share one).
func globalHead(g *Geometry, h int) int {
	if g.TPSize <= g.TotalKVHeadNum {
		return g.TPRank*g.KVHeadNum + h
	}
	return (g.TPRank / (g.TPSize / g.TotalKVHeadNum)) % g.TotalKVHeadNum
}

// checkHeadCoverage verifies, before any TRANSFER, that the producers a
// decode rank (geometry dst) was mapped to write every KV head of each of its
// KV buffers' token rows exactly once, with the right head. SGLang maps TP
// sizes where neither divides the other with integer division
// (bootstrap.TargetRanks) and slices heads by send_kvcache_slice's rules
// (PairBuffers); for some such pairs the slices leave heads unwritten or
// misplaced, which SGLang does not notice. Those are refused here, naming
// both TP sizes and the heads involved. MLA rows are replicated whole, so
// any one producer covers them. Producers of different CP ranks write
// different tokens and are checked separately.
func checkHeadCoverage(dst *Geometry, ts []*recvTarget) error {
	if dst.MLA {
		return nil
	}
	type key struct{ cp, buf int }
	written := map[key][]int{} // (cp, decode KV buffer) → producers per head slot
	var srcTP int
	got := map[key][]int{}
	for _, t := range ts {
		if t.rank.Dummy || t.geo == nil {
			continue
		}
		srcTP = t.geo.TPSize
		for _, p := range t.pairs {
			k := key{t.rank.CP, p.Dst}
			if written[k] == nil {
				written[k] = make([]int, dst.KVHeadNum)
			}
			for i := 0; i < p.Slice.Heads; i++ {
				slot := p.Slice.DstHeadStart + i
				if slot < 0 || slot >= dst.KVHeadNum {
					return fmt.Errorf("engine: prefill attn_tp_size %d and decode attn_tp_size %d cannot be sliced: prefill tp rank %d would write head slot %d of a decode row of %d heads",
						t.geo.TPSize, dst.TPSize, t.geo.TPRank, slot, dst.KVHeadNum)
				}
				if h, want := globalHead(t.geo, p.Slice.SrcHeadStart+i), globalHead(dst, slot); h != want {
					return fmt.Errorf("engine: prefill attn_tp_size %d and decode attn_tp_size %d cannot be sliced: prefill tp rank %d would write KV head %d where decode tp rank %d keeps head %d",
						t.geo.TPSize, dst.TPSize, t.geo.TPRank, h, dst.TPRank, want)
				}
				written[k][slot]++
				got[k] = append(got[k], globalHead(dst, slot))
			}
		}
	}
	for k, w := range written {
		for slot, n := range w {
			if n == 1 {
				continue
			}
			var need []int
			for s := range w {
				need = append(need, globalHead(dst, s))
			}
			g := slices.Sorted(slices.Values(got[k]))
			return fmt.Errorf("engine: prefill attn_tp_size %d and decode attn_tp_size %d cannot be sliced: decode tp rank %d needs KV heads %v in each token row, the prefill ranks SGLang's mapping assigns it write %v (head slot %d written %d times); use TP sizes where one divides the other",
				srcTP, dst.TPSize, dst.TPRank, need, g, slot, n)
		}
	}
	return nil
}
