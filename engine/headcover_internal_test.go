package engine

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/kvargs"
)

// TestCheckLayerCoverage: a decode rank's producers must together send every
// layer it holds (per CP rank); dummy producers send nothing and do not count.
func TestCheckLayerCoverage(t *testing.T) {
	prod := func(ep string, cp int, dummy bool, start, end int) *recvTarget {
		return &recvTarget{rank: bootstrap.TargetRank{CP: cp, Dummy: dummy}, endpoint: ep, geo: &kvargs.Geometry{StartLayer: start, EndLayer: end}}
	}
	dec := &kvargs.Geometry{StartLayer: 0, EndLayer: 8}
	for _, c := range []struct {
		name string
		dst  *kvargs.Geometry
		ts   []*recvTarget
		want string // "" = accepted
	}{
		{"one producer, every layer", dec, []*recvTarget{prod("p0", 0, false, 0, 8)}, ""},
		{"two PP stages", dec, []*recvTarget{prod("p0", 0, false, 0, 4), prod("p1", 0, false, 4, 8)}, ""},
		{"TP producers of the same layers", dec, []*recvTarget{prod("p0", 0, false, 0, 8), prod("p1", 0, false, 0, 8)}, ""},
		{"decode PP stage", &kvargs.Geometry{StartLayer: 4, EndLayer: 8}, []*recvTarget{prod("p1", 0, false, 4, 8)}, ""},
		{"fewer layers than the decode", dec, []*recvTarget{prod("p0", 0, false, 0, 6)},
			"prefill p0 and decode d cannot be paired: decode d holds layers [0, 8), but the prefill ranks it is paired with send layers [0, 6); layers [6, 8) would never be written (cp rank 0)"},
		{"a gap between PP stages", dec, []*recvTarget{prod("p0", 0, false, 0, 3), prod("p1", 0, false, 5, 8)},
			"prefill p0, p1 and decode d cannot be paired: decode d holds layers [0, 8), but the prefill ranks it is paired with send layers [0, 3) [5, 8); layers [3, 5) would never be written"},
		{"only the dummy holds the rest", dec, []*recvTarget{prod("p0", 0, false, 0, 4), prod("p1", 0, true, 4, 8)},
			"layers [4, 8) would never be written"},
		{"one CP rank short", dec, []*recvTarget{prod("p0", 0, false, 0, 8), prod("p1", 1, false, 1, 8)},
			"prefill p1 and decode d cannot be paired: decode d holds layers [0, 8), but the prefill ranks it is paired with send layers [1, 8); layers [0, 1) would never be written (cp rank 1)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := checkLayerCoverage(c.dst, c.ts, "d")
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("err %v, want %q", err, c.want)
			}
		})
	}
}
