package tcp

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestHeaderRoundTrip(t *testing.T) {
	for _, h := range []header{
		{Kind: kindWrite, Seq: 1, Region: 3, Count: 1, Offset: 0, Length: 1 << 20},
		{Kind: kindWrite, Seq: 1<<64 - 1, Region: 1<<32 - 1, Count: 2048, Offset: 12345, Length: 128, Stride: 384},
		{Kind: kindWrite, Seq: 7, Region: 0, Count: 1, Offset: 1<<64 - 1, Length: 0},
		{Kind: kindScatter, Seq: 8, Count: 3, Length: 3},
		{Kind: kindScatter, Seq: 9, Count: maxScatterEntries, Length: maxFramePayload},
		{Kind: kindRead, Seq: 10, Region: 2, Count: 16, Offset: 4096, Length: 256, Stride: 1024},
		{Kind: kindReadScatter, Seq: 11, Count: 2, Length: 8192},
	} {
		var b [headerSize]byte
		h.encode(&b)
		got, err := decodeHeader(b[:])
		if err != nil || got != h {
			t.Errorf("decode(encode(%+v)) = %+v, %v", h, got, err)
		}
	}
}

func TestDecodeHeaderErrors(t *testing.T) {
	good := func() []byte {
		var b [headerSize]byte
		header{Seq: 9, Region: 1, Count: 1, Length: 64}.encode(&b)
		return b[:]
	}
	tests := []struct {
		name string
		mod  func(b []byte) []byte
		want string
	}{
		{"short", func(b []byte) []byte { return b[:10] }, "frame header is 10 bytes"},
		{"magic", func(b []byte) []byte { b[0] ^= 1; return b }, "bad frame magic"},
		{"kind", func(b []byte) []byte { b[4] = 9; return b }, "unknown frame kind 9"},
		{"flags", func(b []byte) []byte { b[5] = 1; return b }, "reserved frame bits"},
		{"count0", func(b []byte) []byte { b[20] = 0; return b }, "block count 0"},
		{"huge", func(b []byte) []byte { b[39] = 0x10; return b }, "exceeds"},
		{"overflow", func(b []byte) []byte { b[23] = 0xff; b[39] = 0xff; return b }, "exceeds"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeHeader(tc.mod(good()))
			if !errors.Is(err, errProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want errProtocol containing %q", err, tc.want)
			}
		})
	}
}

func TestHeaderSpan(t *testing.T) {
	tests := []struct {
		h   header
		end uint64
		ok  bool
	}{
		{header{Count: 1, Offset: 10, Length: 5}, 15, true},
		{header{Count: 4, Offset: 0, Length: 8, Stride: 16}, 56, true},
		{header{Count: 3, Offset: 1<<64 - 10, Length: 8, Stride: 16}, 0, false},
		{header{Count: 2, Offset: 0, Length: 1, Stride: 1 << 63}, 1<<63 + 1, true},
		{header{Count: 3, Offset: 0, Length: 1, Stride: 1 << 63}, 0, false},
		{header{Count: 1, Offset: 1<<64 - 1, Length: 1}, 0, false},
	}
	for _, tc := range tests {
		end, ok := tc.h.span()
		if ok != tc.ok || (ok && end != tc.end) {
			t.Errorf("%+v.span() = %d, %v; want %d, %v", tc.h, end, ok, tc.end, tc.ok)
		}
	}
}

func TestAckRoundTrip(t *testing.T) {
	for _, a := range []ack{
		{Status: ackOK, Seq: 1, Bytes: 1 << 20},
		{Status: ackOutOfBounds, Seq: 99, Msg: "region 3: write at offset 10"},
		{Status: ackInternal, Seq: 5, Bytes: 7, Msg: strings.Repeat("x", maxAckMsg)},
	} {
		b := encodeAck(nil, a)
		got, n, err := decodeAckHeader(b)
		if err != nil {
			t.Fatalf("decode %+v: %v", a, err)
		}
		got.Msg = string(b[ackSize : ackSize+n])
		if got != a || len(b) != ackSize+n {
			t.Errorf("round trip %+v = %+v (len %d)", a, got, len(b))
		}
	}
	// Messages over the limit are truncated by the encoder.
	b := encodeAck(nil, ack{Msg: strings.Repeat("y", 3000)})
	if _, n, err := decodeAckHeader(b); err != nil || n != maxAckMsg {
		t.Errorf("long message: n=%d err=%v, want %d", n, err, maxAckMsg)
	}
}

func TestDecodeAckErrors(t *testing.T) {
	good := encodeAck(nil, ack{Status: ackOK, Seq: 1})
	for name, mod := range map[string]func([]byte) []byte{
		"short":  func(b []byte) []byte { return b[:3] },
		"magic":  func(b []byte) []byte { b[1] = 0; return b },
		"status": func(b []byte) []byte { b[4] = 200; return b },
		"rsv":    func(b []byte) []byte { b[5] = 1; return b },
		"msglen": func(b []byte) []byte { b[6], b[7] = 0xff, 0xff; return b },
	} {
		if _, _, err := decodeAckHeader(mod(bytes.Clone(good))); !errors.Is(err, errProtocol) {
			t.Errorf("%s: err = %v, want errProtocol", name, err)
		}
	}
}

func TestHello(t *testing.T) {
	var b [helloSize]byte
	hello{Version: protoVersion, Stream: 3}.encode(&b)
	if h, err := decodeHello(b[:]); err != nil || h.Stream != 3 {
		t.Fatalf("hello round trip: %+v %v", h, err)
	}
	hello{Version: protoVersion + 1}.encode(&b)
	if _, err := decodeHello(b[:]); err == nil || !strings.Contains(err.Error(), "protocol version") {
		t.Errorf("future version accepted: %v", err)
	}
	if _, err := decodeHello([]byte("GET / HTTP/1.1\r\n")); !errors.Is(err, errProtocol) {
		t.Errorf("HTTP request accepted as hello: %v", err)
	}
}

// FuzzDecodeHeader: any 48 bytes either decode to a header that re-encodes
// to the same bytes with a sane payload, or fail with errProtocol.
func FuzzDecodeHeader(f *testing.F) {
	var b [headerSize]byte
	header{Seq: 1, Region: 2, Count: 3, Offset: 4, Length: 5, Stride: 6}.encode(&b)
	f.Add(b[:])
	f.Add(make([]byte, headerSize))
	header{Kind: kindScatter, Seq: 2, Count: 3, Length: 12288}.encode(&b)
	f.Add(b[:])
	header{Kind: kindRead, Seq: 3, Region: 1, Count: 4, Offset: 8, Length: 64, Stride: 128}.encode(&b)
	f.Add(b[:])
	header{Kind: kindReadScatter, Seq: 4, Count: 2, Length: 8192}.encode(&b)
	f.Add(b[:])
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := decodeHeader(in)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("error does not wrap errProtocol: %v", err)
			}
			return
		}
		if h.Count == 0 || h.size() > maxFramePayload || (h.read() && h.payload() != 0) {
			t.Fatalf("accepted invalid header %+v", h)
		}
		var out [headerSize]byte
		h.encode(&out)
		if !bytes.Equal(out[:], in[:headerSize]) {
			t.Fatalf("re-encode differs")
		}
		_, _ = h.span() // must not panic
	})
}

// FuzzDecodeAck: acks from the wire never panic and round-trip.
func FuzzDecodeAck(f *testing.F) {
	f.Add(encodeAck(nil, ack{Status: ackOutOfBounds, Seq: 3, Msg: "no"}))
	f.Add(make([]byte, ackSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		a, n, err := decodeAckHeader(in)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("error does not wrap errProtocol: %v", err)
			}
			return
		}
		if n > maxAckMsg || a.Status > ackFenced {
			t.Fatalf("accepted invalid ack %+v n=%d", a, n)
		}
		if len(in) >= ackSize+n {
			a.Msg = string(in[ackSize : ackSize+n])
			if out := encodeAck(nil, a); !bytes.Equal(out, in[:ackSize+n]) {
				t.Fatalf("re-encode differs")
			}
		}
	})
}

// FuzzDecodeHello: hellos from the wire never panic.
func FuzzDecodeHello(f *testing.F) {
	var b [helloSize]byte
	hello{Version: protoVersion}.encode(&b)
	f.Add(b[:])
	f.Fuzz(func(t *testing.T, in []byte) {
		if _, err := decodeHello(in); err != nil && !errors.Is(err, errProtocol) {
			t.Fatalf("error does not wrap errProtocol: %v", err)
		}
	})
}

func TestDecodeTable(t *testing.T) {
	h := header{Kind: kindScatter, Seq: 4, Count: 3, Length: 4096 + 7 + 1}
	tb := make([]byte, 3*entrySize)
	want := []entry{{Region: 1, Length: 4096, Offset: 1 << 40}, {Region: 2, Length: 7}, {Region: 1<<32 - 1, Length: 1, Offset: 1<<64 - 1}}
	for i, e := range want {
		putEntry(tb[i*entrySize:], e)
	}
	got, err := decodeTable(h, tb, nil)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("decodeTable = %+v, %v; want %+v", got, err, want)
	}
	if _, ok := got[2].end(); ok {
		t.Errorf("entry at offset 2^64-1 length 1: end() reported no overflow")
	}
	for _, tc := range []struct {
		name string
		h    header
		b    []byte
		msg  string
	}{
		{"short", h, tb[:40], "table is 40 bytes, want 48"},
		{"sum", header{Kind: kindScatter, Count: 3, Length: 4105}, tb, "add up to 4104 bytes, header says 4105"},
		{"zero", header{Kind: kindScatter, Count: 1, Length: 0}, make([]byte, entrySize), "length 0"},
	} {
		if _, err := decodeTable(tc.h, tc.b, nil); !errors.Is(err, errProtocol) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: err = %v, want errProtocol containing %q", tc.name, err, tc.msg)
		}
	}
}

func TestDecodeScatterHeaderErrors(t *testing.T) {
	for _, tc := range []struct {
		h   header
		msg string
	}{
		{header{Kind: kindScatter, Count: maxScatterEntries + 1, Length: 1 << 20}, "the limit is 1024"},
		{header{Kind: kindScatter, Count: 2, Length: 1}, "declares 1 payload bytes for 2 entries"},
		{header{Kind: kindScatter, Count: 1, Length: maxFramePayload + 1}, "declares"},
		{header{Kind: kindScatter, Count: 1, Length: 8, Offset: 1}, "reserved header fields"},
		{header{Kind: kindScatter, Count: 1, Length: 8, Stride: 1}, "reserved header fields"},
		{header{Kind: kindScatter, Count: 0, Length: 8}, "count 0"},
	} {
		var b [headerSize]byte
		tc.h.encode(&b)
		if _, err := decodeHeader(b[:]); !errors.Is(err, errProtocol) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%+v: err = %v, want errProtocol containing %q", tc.h, err, tc.msg)
		}
	}
}

func TestScatterLimit(t *testing.T) {
	for _, tc := range []struct {
		total   uint64
		streams int
		want    uint64
	}{
		{1 << 20, 4, 256 << 10},     // 4 KiB x 256: one frame per stream
		{8 << 20, 4, 1 << 20},       // 32 KiB x 256: capped at 1 MiB
		{64 << 10, 4, 256 << 10},    // small batch: one frame
		{64 << 20, 4, 1 << 20},      // capped
		{1 << 20, 1, 1 << 20},       // one stream
		{1<<20 + 1, 4, 256<<10 + 1}, // rounds up: still 4 frames
		{0, 4, 256 << 10},           // no small writes
		{32 << 20, 64, 512 << 10},
		{400 << 20, 64, scatterMaxBytes},
	} {
		if got := scatterLimit(tc.total, tc.streams); got != tc.want {
			t.Errorf("scatterLimit(%d, %d) = %d, want %d", tc.total, tc.streams, got, tc.want)
		}
	}
	// The packer starts a new frame at the entry and byte limits.
	p := packer{limit: 10}
	var starts []bool
	for _, n := range []uint64{4, 4, 2, 1, 10, 11} {
		starts = append(starts, p.add(n))
	}
	if want := []bool{true, false, false, true, true, true}; !slices.Equal(starts, want) {
		t.Errorf("packer starts = %v, want %v", starts, want)
	}
	p = packer{limit: 1 << 40}
	n := 0
	for i := 0; i < 3*maxScatterEntries; i++ {
		if p.add(1) {
			n++
		}
	}
	if n != 3 {
		t.Errorf("%d one-byte writes made %d frames, want 3 (at most %d entries each)", 3*maxScatterEntries, n, maxScatterEntries)
	}
}

// FuzzDecodeScatter: any header + table bytes either decode to entries
// whose lengths are >= 1 and add up to the header's payload and that
// re-encode to the same bytes, or fail with errProtocol; nothing panics.
func FuzzDecodeScatter(f *testing.F) {
	var hb [headerSize]byte
	header{Kind: kindScatter, Seq: 1, Count: 2, Length: 4096 + 8}.encode(&hb)
	tb := make([]byte, 2*entrySize)
	putEntry(tb, entry{Region: 1, Length: 4096, Offset: 8192})
	putEntry(tb[entrySize:], entry{Region: 2, Length: 8, Offset: 1<<64 - 4})
	f.Add(append(hb[:], tb...))
	f.Add(hb[:])
	header{Kind: kindScatter, Seq: 1, Count: maxScatterEntries, Length: maxScatterEntries}.encode(&hb)
	f.Add(append(hb[:], make([]byte, 100)...))
	header{Kind: kindReadScatter, Seq: 1, Count: 2, Length: 4096 + 8}.encode(&hb)
	f.Add(append(hb[:], tb...))
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := decodeHeader(in)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("header error does not wrap errProtocol: %v", err)
			}
			return
		}
		if !h.scattered() {
			return
		}
		if h.Count == 0 || h.Count > maxScatterEntries || h.Length < uint64(h.Count) || h.size() > maxFramePayload || h.tableBytes() != int(h.Count)*entrySize {
			t.Fatalf("accepted invalid scatter header %+v", h)
		}
		ents, err := decodeTable(h, in[headerSize:], nil)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("table error does not wrap errProtocol: %v", err)
			}
			return
		}
		var sum uint64
		out := make([]byte, len(ents)*entrySize)
		for i, e := range ents {
			if e.Length == 0 {
				t.Fatalf("accepted entry %d of length 0", i)
			}
			sum += uint64(e.Length)
			putEntry(out[i*entrySize:], e)
			_, _ = e.end() // must not panic
		}
		if len(ents) != int(h.Count) || sum != h.Length {
			t.Fatalf("%d entries of %d bytes accepted for header %+v", len(ents), sum, h)
		}
		if !bytes.Equal(out, in[headerSize:headerSize+len(out)]) {
			t.Fatalf("table re-encodes differently")
		}
	})
}
