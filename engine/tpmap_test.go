package engine_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

var (
	sixHeads    = workload.ModelConfig{Name: "six-heads", NumLayers: 2, NumKVHeads: 6, HeadDim: 8, DtypeBytes: 2}
	twelveHeads = workload.ModelConfig{Name: "twelve-heads", NumLayers: 2, NumKVHeads: 12, HeadDim: 8, DtypeBytes: 2}
)

// failsNaming runs one receiver on d for room and wants it Failed, with an
// error naming every string in want, well before the peer timeout (the
// refusal comes at resolution, before any TRANSFER).
func failsNaming(t *testing.T, addr string, d *rank, room uint64, want ...string) {
	t.Helper()
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pg, err := d.pool.Alloc(2)
	if err != nil {
		t.Fatal(err)
	}
	defer d.pool.Free(pg)
	// The refusal may come before Init (resolution runs from NewReceiver),
	// and Init of a failed receiver returns its failure: either way the
	// receiver must be Failed with the refusal.
	if err := r.Init(pg); err != nil && r.Poll() != engine.KVFailed {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("decode tp rank %d: %s (%v), want Failed", d.m.Geometry().TPRank, st, r.Failure())
	}
	for _, w := range want {
		if !strings.Contains(r.Failure().Error(), w) {
			t.Fatalf("decode tp rank %d: failure %q does not name %q", d.m.Geometry().TPRank, r.Failure(), w)
		}
	}
}

// TestNonDividingTP: TP sizes where neither divides the other are mapped as
// SGLang maps them; where that mapping cannot serve a decode rank whole the
// room fails at resolution naming both sizes, and where it can (MLA, decode
// ranks inside the prefill's range) the KV is transferred and verified.
func TestNonDividingTP(t *testing.T) {
	t.Run("prefill 3 decode 2 GQA", func(t *testing.T) {
		addr, _, dec := topology(t, sixHeads, 3, 1, 2, false)
		for _, d := range dec {
			failsNaming(t, addr, d, 31, "prefill attn_tp_size 3", "decode attn_tp_size 2")
		}
	})
	t.Run("prefill 2 decode 3 GQA", func(t *testing.T) {
		addr, pre, dec := topology(t, sixHeads, 2, 1, 3, false)
		// Decode rank 0 holds heads 0-1, all on prefill rank 0: served.
		for _, r := range transferOne(t, addr, pre[:1], dec[:1], 32, 3) {
			if r.Poll() != engine.KVSuccess {
				t.Fatalf("decode rank 0: %s %v", r.Poll(), r.Failure())
			}
		}
		// Decode rank 1 holds heads 2-3, split over prefill ranks 0 and 1,
		// but SGLang's mapping gives it prefill rank 1 only; rank 2 maps
		// past the prefill's ranks.
		failsNaming(t, addr, dec[1], 33, "prefill", "tp 2", "decode tp 3")
		failsNaming(t, addr, dec[2], 34, "decode attn_tp_size 3", "prefill attn_tp_size 2")
	})
	t.Run("prefill 4 decode 6 GQA", func(t *testing.T) {
		addr, pre, dec := topology(t, twelveHeads, 4, 1, 6, false)
		// Decode rank 0 keeps heads 0-1 and gets prefill rank 0's 0-2: served.
		for _, r := range transferOne(t, addr, pre[:1], dec[:1], 38, 3) {
			if r.Poll() != engine.KVSuccess {
				t.Fatalf("decode rank 0: %s %v", r.Poll(), r.Failure())
			}
		}
		// Decode rank 2 keeps heads 4-5; SGLang's slice takes heads 7-8
		// from prefill rank 2: they fit the rows, but are the wrong heads.
		failsNaming(t, addr, dec[2], 39, "prefill attn_tp_size 4", "decode attn_tp_size 6", "KV head 7", "keeps head 4")
		failsNaming(t, addr, dec[5], 40, "decode attn_tp_size 6", "prefill attn_tp_size 4")
	})
	t.Run("prefill 2 decode 3 MLA", func(t *testing.T) {
		addr, pre, dec := topology(t, smallMLA, 2, 1, 3, false)
		// MLA rows are replicated: decode ranks 0 and 1 get prefill ranks
		// 0 and 1 whole.
		for _, r := range transferOne(t, addr, pre, dec[:2], 35, 3) {
			if r.Poll() != engine.KVSuccess {
				t.Fatalf("%s %v", r.Poll(), r.Failure())
			}
		}
		failsNaming(t, addr, dec[2], 36, "decode attn_tp_size 3", "prefill attn_tp_size 2")
	})
	t.Run("prefill 3 decode 2 MLA", func(t *testing.T) {
		addr, _, dec := topology(t, smallMLA, 3, 1, 2, false)
		for _, d := range dec {
			failsNaming(t, addr, d, 37, "prefill attn_tp_size 3", "decode attn_tp_size 2", "prefill tp ranks 2…2")
		}
	})
}

// twoHeads is a model with fewer KV heads than some TP sizes (Qwen3.5's 2):
// prefill or decode ranks beyond 2 hold a replica of one head.
var twoHeads = workload.ModelConfig{Name: "two-heads", NumLayers: 2, NumKVHeads: 2, HeadDim: 8, DtypeBytes: 2}

// TestReplicatedKVHeads (issue 22 item 11): a model with 2 KV heads and a
// prefill TP size above it holds each head on several prefill ranks. The
// decode takes each head from one writer per replica group (the lowest
// prefill tp rank holding it among those SGLang's mapping assigns it); the
// other replicas are dummies (TRANSFER without pages, nothing written).
// Every byte is verified (checksum on, and the pattern), and both sides
// report Success. The reverse direction (decode TP above the heads: decode
// ranks replicate) is served by slicing the one head each decode rank
// keeps.
func TestReplicatedKVHeads(t *testing.T) {
	cases := []struct {
		ptp, dtp int
		noHeads  bool // the decode states no head counts (SGLang's KVArgs)
		dummies  int  // prefill ranks that write nothing
	}{
		{4, 1, false, 2}, {4, 2, false, 2}, {8, 2, false, 6}, {8, 4, false, 4}, {4, 1, true, 2}, {8, 2, true, 6},
		{1, 4, false, 0}, {2, 4, false, 0}, {2, 8, true, 0}, {4, 8, false, 0},
	}
	for _, c := range cases {
		name := fmt.Sprintf("prefill tp %d decode tp %d", c.ptp, c.dtp)
		if c.noHeads {
			name += " decode without head counts"
		}
		t.Run(name, func(t *testing.T) {
			addr, pre, dec := topologyWith(t, twoHeads, c.ptp, 1, c.dtp, func(o *rankOpts) {
				if o.role == engine.RoleDecode {
					o.checksum, o.noHeads = true, c.noHeads
				}
			})
			for i, room := range []uint64{21, 1<<62 + 5} {
				recvs, sent := transferRoom(t, addr, pre, dec, room, 3+i)
				for j, r := range recvs {
					if r.Poll() != engine.KVSuccess {
						t.Fatalf("room %d decode rank %d: %s %v", room, j, r.Poll(), r.Failure())
					}
					// Each decode rank's KV bytes: its pages × its row per buffer, written once.
					l := dec[j].pool.Layout()
					if want := uint64(3+i) * l.ItemLen() * uint64(l.NumBuffers()); r.TransferMetric().Bytes != want {
						t.Errorf("room %d decode rank %d: %d KV bytes received, want %d (each head once)", room, j, r.TransferMetric().Bytes, want)
					}
				}
				dummies := 0
				for _, n := range sent {
					if n == 0 {
						dummies++
					}
				}
				if dummies != c.dummies {
					t.Errorf("room %d: %d prefill ranks wrote nothing (bytes sent %v), want %d dummies", room, dummies, sent, c.dummies)
				}
			}
		})
	}
}
