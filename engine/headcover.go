package engine

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvxfer/kvxfer/engine/kvargs"
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

// checkLayerCoverage verifies, before any TRANSFER, that the producers a
// decode rank (geometry dst, endpoint dstName) was mapped to send every layer
// it holds, per CP rank. PairBuffers refuses a producer layer the decode does
// not hold; this refuses the converse, a decode layer no producer holds (for
// example a decode model with more layers than the prefill's, or PP stages
// that leave a gap): its KV buffers would never be written, nor the aux row
// (written by the producer of the last layer), yet the room would succeed.
// The error names the decode, the producers and the layers left out.
func checkLayerCoverage(dst *kvargs.Geometry, ts []*recvTarget, dstName string) error {
	type span struct{ start, end int }
	perCP := map[int][]span{}
	eps := map[int][]string{}
	for _, t := range ts {
		if t.rank.Dummy || t.geo == nil {
			continue
		}
		perCP[t.rank.CP] = append(perCP[t.rank.CP], span{t.geo.StartLayer, t.geo.EndLayer})
		eps[t.rank.CP] = append(eps[t.rank.CP], t.endpoint)
	}
	for cp, spans := range perCP {
		held := make([]bool, dst.Layers())
		for _, s := range spans {
			for l := max(s.start, dst.StartLayer); l < min(s.end, dst.EndLayer); l++ {
				held[l-dst.StartLayer] = true
			}
		}
		sent, missing := layerRuns(held, dst.StartLayer, true), layerRuns(held, dst.StartLayer, false)
		if len(missing) > 0 {
			return fmt.Errorf("engine: prefill %s and decode %s cannot be paired: decode %s holds layers [%d, %d), but the prefill ranks it is paired with send layers %s; layers %s would never be written (cp rank %d); run prefill and decode with the same model (the prefill's PP stages together must hold every layer the decode holds)",
				strings.Join(eps[cp], ", "), dstName, dstName, dst.StartLayer, dst.EndLayer, strings.Join(sent, " "), strings.Join(missing, " "), cp)
		}
	}
	return nil
}

// layerRuns returns the runs of layers whose held flag equals want, as
// "[a, b)" strings; layer i of held is layer first+i.
func layerRuns(held []bool, first int, want bool) []string {
	var out []string
	for i := 0; i < len(held); {
		if held[i] != want {
			i++
			continue
		}
		j := i
		for j < len(held) && held[j] == want {
			j++
		}
		out = append(out, fmt.Sprintf("[%d, %d)", first+i, first+j))
		i = j
	}
	return out
}

// replicaDummy is a producer made a dummy because another producer of the
// same room writes the KV head it holds a replica of.
type replicaDummy struct {
	t      *recvTarget
	head   int // the model-wide KV head
	writer int // the prefill tp rank that writes it
}

// replicaDummies makes one writer per replica group (issue 22 item 11):
// with more prefill attention-TP ranks than the model has KV heads (GQA
// replication: prefill tp rank r holds head r / (P / heads)), several of the
// producers SGLang's mapping assigns a decode rank hold the same head, and
// their head slices land on the same decode head slot (SGLang's
// send_kvcache_slice maps a replica to its unique head, so each replica
// writes the same bytes there). Only the lowest prefill tp rank holding a
// head, per CP rank and PP stage, stays a writer; the others become dummies
// (TRANSFER without pages: they write nothing, as MLA's extra ranks) and
// are returned. ts are the room's producers after registration (geo set
// for every non-dummy); MLA producers are left alone (TargetRanks already
// made every MLA rank but one a dummy).
func replicaDummies(ts []*recvTarget) []replicaDummy {
	type key struct{ cp, pp, head int }
	first := map[key]*recvTarget{}
	for _, t := range ts {
		g := t.geo
		if t.rank.Dummy || g == nil || g.MLA || g.TotalKVHeadNum == 0 || g.TPSize <= g.TotalKVHeadNum {
			continue
		}
		k := key{t.rank.CP, t.rank.PP, globalHead(g, 0)}
		if w := first[k]; w == nil || g.TPRank < w.geo.TPRank {
			first[k] = t
		}
	}
	var out []replicaDummy
	for _, t := range ts {
		g := t.geo
		if t.rank.Dummy || g == nil || g.MLA || g.TotalKVHeadNum == 0 || g.TPSize <= g.TotalKVHeadNum {
			continue
		}
		k := key{t.rank.CP, t.rank.PP, globalHead(g, 0)}
		if w := first[k]; w != t {
			t.rank.Dummy, t.pairs = true, nil
			out = append(out, replicaDummy{t: t, head: k.head, writer: w.geo.TPRank})
		}
	}
	return out
}

// globalHead returns the model-wide KV head that local head h of a rank
// with geometry g holds (GQA replicas, TP size > heads, share one).
func globalHead(g *kvargs.Geometry, h int) int {
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
// different tokens and are checked separately. dst has its heads known
// (kvargs.ResolveHeads): a decode that stated none has them from its
// producers' geometry.
func checkHeadCoverage(dst *kvargs.Geometry, ts []*recvTarget) error {
	if dst.MLA || dst.HeadsUnknown() {
		return nil // replicated whole, or neither side states heads (equal TP sizes: whole pages)
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
