package transport_test

import (
	"encoding/binary"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// w is a one-block request on region 1 (local addresses from 0x1000).
func w(local, remote, length uint64) transport.WriteRequest {
	return transport.WriteRequest{Local: uintptr(0x1000 + local), Remote: 1, RemoteOffset: remote, Length: length}
}

// strided is the expected strided request.
func strided(local, remote, length uint64, count uint32, ls, rs uint64) transport.WriteRequest {
	return transport.WriteRequest{Local: uintptr(0x1000 + local), Remote: 1, RemoteOffset: remote, Length: length, Count: count, LocalStride: ls, RemoteStride: rs}
}

func one(r transport.WriteRequest) transport.WriteRequest { r.Count = 1; return r }

func TestCoalescer(t *testing.T) {
	const end = 0x1000 + 1<<40 // one registration for every request unless a case says otherwise
	other := func(r transport.WriteRequest) transport.WriteRequest { r.Remote = 2; return r }
	for _, tc := range []struct {
		name    string
		strided bool
		in      []transport.WriteRequest
		ends    []uint64 // per request; nil = end
		want    []transport.WriteRequest
	}{
		{"adjacent both sides", true, []transport.WriteRequest{w(0, 0, 64), w(64, 64, 64), w(128, 128, 32)}, nil,
			[]transport.WriteRequest{one(w(0, 0, 160))}},
		{"adjacent locally only, strided off", false, []transport.WriteRequest{w(0, 0, 64), w(64, 128, 64)}, nil,
			[]transport.WriteRequest{one(w(0, 0, 64)), one(w(64, 128, 64))}},
		{"equal strides become one strided request", true,
			[]transport.WriteRequest{w(0, 0, 100), w(256, 100, 100), w(512, 200, 100), w(768, 300, 100)}, nil,
			[]transport.WriteRequest{strided(0, 0, 100, 4, 256, 100)}},
		{"sglang per-token slices: src stride 2x, dst contiguous", true,
			[]transport.WriteRequest{w(0, 0, 1024), w(2048, 1024, 1024), w(4096, 2048, 1024)}, nil,
			[]transport.WriteRequest{strided(0, 0, 1024, 3, 2048, 1024)}},
		{"a stride change ends the run", true,
			[]transport.WriteRequest{w(0, 0, 8), w(16, 8, 8), w(32, 16, 8), w(100, 24, 8), w(116, 32, 8)}, nil,
			[]transport.WriteRequest{strided(0, 0, 8, 3, 16, 8), strided(100, 24, 8, 2, 16, 8)}},
		{"a length change ends the run", true,
			[]transport.WriteRequest{w(0, 0, 8), w(16, 8, 8), w(32, 16, 4)}, nil,
			[]transport.WriteRequest{strided(0, 0, 8, 2, 16, 8), one(w(32, 16, 4))}},
		{"overlapping stride is not strided", true,
			[]transport.WriteRequest{w(0, 0, 64), w(32, 64, 64)}, nil,
			[]transport.WriteRequest{one(w(0, 0, 64)), one(w(32, 64, 64))}},
		{"backwards is not merged", true,
			[]transport.WriteRequest{w(64, 64, 64), w(0, 0, 64)}, nil,
			[]transport.WriteRequest{one(w(64, 64, 64)), one(w(0, 0, 64))}},
		{"another remote region is not merged", true,
			[]transport.WriteRequest{w(0, 0, 64), other(w(64, 64, 64))}, nil,
			[]transport.WriteRequest{one(w(0, 0, 64)), one(other(w(64, 64, 64)))}},
		{"adjacent registrations are not merged", true,
			[]transport.WriteRequest{w(0, 0, 64), w(64, 64, 64)}, []uint64{0x1000 + 64, end},
			[]transport.WriteRequest{one(w(0, 0, 64)), one(w(64, 64, 64))}},
		{"zero length passes through", true,
			[]transport.WriteRequest{w(0, 0, 64), w(64, 64, 0), w(64, 64, 64)}, nil,
			[]transport.WriteRequest{one(w(0, 0, 64)), one(w(64, 64, 0)), one(w(64, 64, 64))}},
		{"a caller's strided request is kept as it is", true,
			[]transport.WriteRequest{strided(0, 0, 8, 2, 16, 8), w(32, 16, 8), w(48, 24, 8)}, nil,
			[]transport.WriteRequest{strided(0, 0, 8, 2, 16, 8), strided(32, 16, 8, 2, 16, 8)}},
		{"strided payload cap", true,
			[]transport.WriteRequest{w(0, 0, 2<<20), w(4<<20, 2<<20, 2<<20), w(8<<20, 4<<20, 2<<20)}, nil,
			[]transport.WriteRequest{strided(0, 0, 2<<20, 2, 4<<20, 2<<20), one(w(8<<20, 4<<20, 2<<20))}},
		{"contiguous cap", true,
			[]transport.WriteRequest{w(0, 0, 1<<29), w(1<<29, 1<<29, 1<<29), w(1<<30, 1<<30, 1)}, nil,
			[]transport.WriteRequest{one(w(0, 0, 1<<30)), one(w(1<<30, 1<<30, 1))}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := transport.NewCoalescer(tc.strided, len(tc.in))
			for i, r := range tc.in {
				e := uint64(end)
				if tc.ends != nil {
					e = tc.ends[i]
				}
				c.Add(r, e)
			}
			if got := c.Requests(); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got  %+v\nwant %+v", got, tc.want)
			}
			if c.In() != len(tc.in) || c.Out() != len(tc.want) {
				t.Fatalf("In %d Out %d, want %d and %d", c.In(), c.Out(), len(tc.in), len(tc.want))
			}
		})
	}
}

// pairs lists every (region, remote byte, local byte) a batch moves, sorted:
// two batches that list the same pairs move exactly the same bytes.
func pairs(reqs []transport.WriteRequest) [][3]uint64 {
	var out [][3]uint64
	for _, r := range reqs {
		for k := uint64(0); k < r.Blocks(); k++ {
			for b := uint64(0); b < r.Length; b++ {
				out = append(out, [3]uint64{uint64(r.Remote), r.RemoteOffset + k*r.RemoteStride + b, uint64(r.Local) + k*r.LocalStride + b})
			}
		}
	}
	slices.SortFunc(out, func(a, b [3]uint64) int {
		for i := range a {
			if a[i] != b[i] {
				if a[i] < b[i] {
					return -1
				}
				return 1
			}
		}
		return 0
	})
	return out
}

// FuzzCoalescer: for any batch, the coalesced batch moves exactly the same
// bytes (the same local byte to the same remote byte, as often), never
// more descriptors than requests, every descriptor's local range inside
// the registration its parts came from, and formed strided requests with
// strides at least their block length. Each 5 input bytes are one request:
// local offset, remote offset, length (0..31), remote region (1 or 2) and
// a one-block flag; the local memory is two adjacent registrations of 128
// bytes each.
func FuzzCoalescer(f *testing.F) {
	f.Add([]byte{0, 0, 8, 0, 0, 8, 8, 8, 0, 0, 16, 16, 8, 0, 0})
	f.Add([]byte{0, 0, 4, 0, 0, 16, 4, 4, 0, 0, 32, 8, 4, 0, 0, 48, 12, 4, 0, 0})
	f.Add([]byte{120, 0, 8, 0, 0, 128, 8, 8, 0, 0})
	f.Add(binary.LittleEndian.AppendUint64(nil, 0x0102030405060708))
	f.Fuzz(func(t *testing.T, data []byte) {
		const base = 0x10000
		var in []transport.WriteRequest
		var ends []uint64
		for i := 0; i+5 <= len(data) && len(in) < 64; i += 5 {
			lo := uint64(data[i] % 250)
			n := uint64(data[i+2] % 32)
			if lo/128 != (lo+n-min(n, 1))/128 || lo+n > 256 {
				n = 0 // keep every request inside one registration
			}
			r := transport.WriteRequest{Local: uintptr(base + lo), Remote: transport.RegionID(1 + data[i+3]%2), RemoteOffset: uint64(data[i+1]), Length: n}
			if data[i+4]%7 == 1 && n > 0 && lo+2*n <= 256 && lo/128 == (lo+2*n-1)/128 { // a caller's strided request
				r.Count, r.LocalStride, r.RemoteStride = 2, n, n
			}
			in = append(in, r)
			ends = append(ends, base+128*(lo/128+1))
		}
		for _, strided := range []bool{false, true} {
			c := transport.NewCoalescer(strided, len(in))
			for i, r := range in {
				c.Add(r, ends[i])
			}
			out := c.Requests()
			if len(out) > len(in) || c.In() != len(in) {
				t.Fatalf("strided=%v: %d requests became %d descriptors (In %d)", strided, len(in), len(out), c.In())
			}
			if a, b := pairs(in), pairs(out); !reflect.DeepEqual(a, b) {
				t.Fatalf("strided=%v: the coalesced batch moves other bytes\nin  %+v\nout %+v", strided, in, out)
			}
			for _, r := range out {
				if r.Blocks() > 1 && !strided && !slices.Contains(in, r) {
					t.Fatalf("a strided descriptor %+v formed with strided off", r)
				}
				if r.Blocks() > 1 && !slices.Contains(in, r) && (r.LocalStride < r.Length || r.RemoteStride < r.Length) {
					t.Fatalf("formed strided descriptor %+v has overlapping blocks", r)
				}
				first := uint64(r.Local) - base
				last := first + (r.Blocks()-1)*r.LocalStride + r.Length
				if r.Length > 0 && first/128 != (last-1)/128 {
					t.Fatalf("descriptor %+v spans two registrations", r)
				}
			}
		}
	})
}

func ExampleCoalescer() {
	// SGLang's per-token-slot writes with prefill TP 1 and decode TP 2: one
	// 1 KiB head slice of each 2 KiB token, into a 1 KiB decode token.
	c := transport.NewCoalescer(true, 64)
	for tok := uint64(0); tok < 64; tok++ {
		c.Add(transport.WriteRequest{Local: uintptr(0x100000 + tok*2048), Remote: 7, RemoteOffset: tok * 1024, Length: 1024}, 0x200000)
	}
	r := c.Requests()[0]
	fmt.Println(c.In(), "requests ->", c.Out(), "descriptor:", r.Count, "blocks of", r.Length, "bytes, strides", r.LocalStride, r.RemoteStride)
	// Output: 64 requests -> 1 descriptor: 64 blocks of 1024 bytes, strides 2048 1024
}
