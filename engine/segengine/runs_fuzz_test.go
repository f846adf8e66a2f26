package segengine_test

import (
	"context"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// piece is a block of bytes moved: local address, remote region and
// offset, length.
type piece struct {
	local  uint64
	region transport.RegionID
	off    uint64
	n      uint64
}

// pieces appends p to ps, merged into the last piece when adjacent to it
// on both sides (so that the same bytes in different shapes compare equal).
func pieces(ps []piece, p piece) []piece {
	if k := len(ps) - 1; k >= 0 && ps[k].region == p.region && ps[k].local+ps[k].n == p.local && ps[k].off+ps[k].n == p.off {
		ps[k].n += p.n
		return ps
	}
	return append(ps, p)
}

// FuzzResolveRuns: entries built as a run (n entries of length L, strides
// ls and rs, from fuzzed offsets around a registered local buffer and the
// peer's region, by peer address or by region) with one entry's local or
// remote value moved by a fuzzed delta (breaking the run, or not) are
// accepted by SubmitEntries' resolve exactly when every entry lies inside
// what was registered, checked here entry by entry with plain arithmetic;
// when accepted, the descriptors handed to add move exactly the entries'
// bytes, in order, with and without strided descriptors.
func FuzzResolveRuns(f *testing.F) {
	f.Add(uint16(64), int32(0), int32(0), uint32(1024), uint32(2048), uint32(1024), uint16(999), int32(0), uint8(0))
	f.Add(uint16(100), int32(8), int32(16), uint32(100), uint32(300), uint32(200), uint16(50), int32(1), uint8(1))
	f.Add(uint16(8), int32(48<<10), int32(0), uint32(1024), uint32(2300), uint32(1024), uint16(3), int32(-4096), uint8(2))
	f.Add(uint16(3), int32(0), int32(0), uint32(1024), uint32(1<<31), uint32(1024), uint16(9), int32(0), uint8(3))
	f.Add(uint16(200), int32(-64), int32(0), uint32(64), uint32(64), uint32(64), uint16(199), int32(64), uint8(4))
	const size = 1 << 16
	recv := newTE(f, "tcp")
	send := newTE(f, "tcp")
	dst, dd := regBuf(f, recv, "dst", size)
	src, _ := regBuf(f, send, "src", size)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { seg.Close() })
	s, d := uint64(src.Addr()), uint64(dst.Addr())
	inside := func(a, n, lo uint64) bool { return a >= lo && a-lo <= size && n <= size-(a-lo) }
	f.Fuzz(func(t *testing.T, n16 uint16, lo, ro int32, L, ls, rs uint32, poke uint16, delta int32, mode uint8) {
		n := 1 + int(n16)%300
		byRegion := mode&1 != 0
		base := d
		region := segengine.PeerAddressRegion
		if byRegion {
			base, region = 0, dd.ID
		}
		e := segengine.Entries{Region: region}
		// Strides as fuzzed, times 2^32 for mode bit 2 (runs that wrap).
		mul := uint64(1)
		if mode&4 != 0 {
			mul = 1 << 32
		}
		for k := uint64(0); k < uint64(n); k++ {
			e.Local = append(e.Local, s+uint64(int64(lo))+k*uint64(ls)*mul)
			e.Remote = append(e.Remote, base+uint64(int64(ro))+k*uint64(rs)*mul)
			e.Length = append(e.Length, uint64(L%(1<<17)))
		}
		if i := int(poke); i < n {
			if mode&2 != 0 {
				e.Remote[i] += uint64(int64(delta))
			} else {
				e.Local[i] += uint64(int64(delta))
			}
		}
		valid := true
		var want []piece
		for k := 0; k < n; k++ {
			ln := e.Length[k]
			rlo := d
			if byRegion {
				rlo = 0
			}
			if ln == 0 || !inside(e.Local[k], ln, s) || !inside(e.Remote[k], ln, rlo) {
				valid = false
				break
			}
			want = pieces(want, piece{e.Local[k], dd.ID, e.Remote[k] - rlo, ln})
		}
		for _, strided := range []bool{true, false} {
			var got []piece
			err := seg.ResolveRuns(context.Background(), transport.OpWrite, e, strided, func(r transport.WriteRequest, localEnd uint64) {
				if r.Count > 1 && !strided {
					t.Fatalf("strided request %+v without strided descriptors", r)
				}
				for b := uint64(0); b < uint64(max(r.Count, 1)); b++ {
					got = pieces(got, piece{uint64(r.Local) + b*r.LocalStride, r.Remote, r.RemoteOffset + b*r.RemoteStride, r.Length})
				}
			})
			if valid != (err == nil) {
				t.Fatalf("strided %v: %d entries (first local %#x remote %#x length %d, strides %d/%d): err %v, want valid %v", strided, n, e.Local[0], e.Remote[0], e.Length[0], uint64(ls)*mul, uint64(rs)*mul, err, valid)
			}
			if valid && !slices.Equal(got, want) {
				t.Fatalf("strided %v: descriptors move %v, entries %v", strided, got, want)
			}
		}
	})
}
