package tcp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// rawPeer speaks the wire protocol by hand to test the receiver against
// hostile or broken senders.
type rawPeer struct {
	t *testing.T
	c net.Conn
}

func dialRaw(t *testing.T, tr *Transport, sendHello bool) *rawPeer {
	t.Helper()
	c, err := net.Dial("tcp", tr.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(30 * time.Second))
	p := &rawPeer{t: t, c: c}
	if sendHello {
		var hb [helloSize]byte
		hello{Version: protoVersion}.encode(&hb)
		p.send(hb[:])
	}
	return p
}

func (p *rawPeer) send(b ...[]byte) {
	p.t.Helper()
	for _, x := range b {
		if _, err := p.c.Write(x); err != nil {
			p.t.Fatalf("raw write: %v", err)
		}
	}
}

func (p *rawPeer) frame(h header, payload []byte) {
	var hb [headerSize]byte
	h.encode(&hb)
	p.send(hb[:], payload)
}

func (p *rawPeer) ack() ack {
	p.t.Helper()
	var hb [ackSize]byte
	if _, err := io.ReadFull(p.c, hb[:]); err != nil {
		p.t.Fatalf("read ack: %v", err)
	}
	a, n, err := decodeAckHeader(hb[:])
	if err != nil {
		p.t.Fatalf("decode ack: %v", err)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(p.c, msg); err != nil {
		p.t.Fatalf("read ack message: %v", err)
	}
	a.Msg = string(msg)
	return a
}

func newRecv(t testing.TB, size int) (*Transport, *transport.HostBuffer, transport.RegionDesc) {
	t.Helper()
	tr, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	buf, err := transport.AllocHost("recv", int64(size))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close(); buf.Close() })
	d, err := tr.RegisterMemory(buf.Memory())
	if err != nil {
		t.Fatal(err)
	}
	return tr, buf, d
}

func TestReceiverHostileFrames(t *testing.T) {
	tr, buf, d := newRecv(t, 1<<16)
	p := dialRaw(t, tr, true)
	region := uint32(d.ID)
	steps := []struct {
		name    string
		h       header
		payload []byte
		status  uint8
		msg     string
	}{
		{"zero-length strided", header{Seq: 1, Region: region, Count: 5, Stride: 0, Length: 0}, nil, ackOK, ""},
		{"out of bounds", header{Seq: 2, Region: region, Count: 1, Offset: 1<<16 - 2, Length: 4}, []byte("ABCD"), ackOutOfBounds, "past the region's 65536 bytes"},
		{"offset overflow", header{Seq: 3, Region: region, Count: 2, Offset: 1<<64 - 8, Length: 4, Stride: 8}, []byte("ABCDEFGH"), ackOutOfBounds, "region"},
		{"unknown region", header{Seq: 4, Region: region + 9, Count: 1, Length: 3}, []byte("xyz"), ackUnknownRegion, "not registered"},
		{"overlapping stride", header{Seq: 5, Region: region, Count: 2, Length: 4, Stride: 2}, []byte("12345678"), ackBadRequest, "overlap"},
		{"good after refusals", header{Seq: 6, Region: region, Count: 1, Offset: 100, Length: 5}, []byte("hello"), ackOK, ""},
		{"good strided", header{Seq: 7, Region: region, Count: 3, Offset: 200, Length: 2, Stride: 10}, []byte("aabbcc"), ackOK, ""},
	}
	for _, s := range steps {
		p.frame(s.h, s.payload)
		a := p.ack()
		if a.Status != s.status || a.Seq != s.h.Seq || !strings.Contains(a.Msg, s.msg) {
			t.Fatalf("%s: ack %+v, want status %d seq %d msg containing %q", s.name, a, s.status, s.h.Seq, s.msg)
		}
		if a.Status == ackOK && a.Bytes != s.h.payload() {
			t.Fatalf("%s: ack bytes %d, want %d", s.name, a.Bytes, s.h.payload())
		}
	}
	b := buf.Bytes()
	if string(b[100:105]) != "hello" || string(b[200:202]) != "aa" || string(b[210:212]) != "bb" || string(b[220:222]) != "cc" {
		t.Fatalf("good frames did not land: %q %q", b[100:105], b[200:222])
	}
	if !bytes.Equal(b[1<<16-2:], []byte{0, 0}) || b[0] != 0 {
		t.Fatalf("refused frames wrote into the region")
	}
	// A garbage header: protocol error reply, then the connection closes.
	p.send(bytes.Repeat([]byte{0xEE}, headerSize))
	if a := p.ack(); a.Status != ackProtocol || !strings.Contains(a.Msg, "bad frame magic") {
		t.Fatalf("garbage header: ack %+v, want protocol error", a)
	}
	if _, err := p.c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("connection still open after a protocol error")
	}
	// A huge frame is refused without reading 64 GiB.
	p2 := dialRaw(t, tr, true)
	p2.frame(header{Seq: 1, Region: region, Count: 1 << 20, Length: 1 << 20}, nil)
	if a := p2.ack(); a.Status != ackProtocol || !strings.Contains(a.Msg, "exceeds") {
		t.Fatalf("huge frame: ack %+v, want protocol error", a)
	}
	// A client that is not a kvxfer sender.
	p3 := dialRaw(t, tr, false)
	p3.send([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	if a := p3.ack(); a.Status != ackProtocol || !strings.Contains(a.Msg, "hello") {
		t.Fatalf("HTTP client: ack %+v, want protocol error naming the hello", a)
	}
	// The transport still serves new senders after all of that.
	p4 := dialRaw(t, tr, true)
	p4.frame(header{Seq: 1, Region: region, Count: 1, Offset: 0, Length: 2}, []byte("ok"))
	if a := p4.ack(); a.Status != ackOK || string(b[:2]) != "ok" {
		t.Fatalf("fresh sender after hostile ones: %+v", a)
	}
}

// FuzzReceiverStream sends arbitrary bytes after a valid hello to a live
// receiver: it must never crash or hang, must close or answer, and must keep
// serving new senders.
func FuzzReceiverStream(f *testing.F) {
	tr, _, d := newRecv(f, 1<<16)
	region := uint32(d.ID)
	var seed []byte
	for _, h := range []header{
		{Seq: 1, Region: region, Count: 1, Offset: 0, Length: 4},
		{Seq: 2, Region: region, Count: 3, Offset: 100, Length: 2, Stride: 4},
		{Seq: 3, Region: region, Count: 1, Offset: 1 << 16, Length: 4},
		{Seq: 4, Region: region + 1, Count: 2, Length: 1, Stride: 1},
	} {
		var hb [headerSize]byte
		h.encode(&hb)
		seed = append(seed, hb[:]...)
		seed = append(seed, make([]byte, h.payload())...)
	}
	// A scatter frame to the region and an unknown one, then a good one.
	for _, ents := range [][]entry{{{region, 4, 8}, {region + 1, 2, 0}}, {{region, 3, 1<<16 - 3}, {region, 5, 40}}} {
		h := header{Kind: kindScatter, Seq: 5, Count: uint32(len(ents))}
		tb := make([]byte, len(ents)*entrySize)
		for i, e := range ents {
			putEntry(tb[i*entrySize:], e)
			h.Length += uint64(e.Length)
		}
		var hb [headerSize]byte
		h.encode(&hb)
		seed = append(append(append(seed, hb[:]...), tb...), make([]byte, h.Length)...)
	}
	f.Add(seed)
	f.Add(seed[:headerSize+2])
	f.Add([]byte("garbage"))
	f.Fuzz(func(t *testing.T, in []byte) {
		c, err := net.Dial("tcp", tr.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		var hb [helloSize]byte
		hello{Version: protoVersion}.encode(&hb)
		if _, err := c.Write(append(hb[:], in...)); err != nil {
			return // the receiver may close early on a protocol error
		}
		c.(*net.TCPConn).CloseWrite()
		// Read acks until the receiver closes; a timeout means it hung.
		if _, err := io.Copy(io.Discard, c); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("receiver neither answered nor closed within 20s")
			}
		}
	})
}

// scatter sends one scatter frame: header, table, payloads.
func (p *rawPeer) scatter(seq uint64, ents []entry, payload []byte) {
	p.t.Helper()
	h := header{Kind: kindScatter, Seq: seq, Count: uint32(len(ents))}
	table := make([]byte, len(ents)*entrySize)
	for i, e := range ents {
		putEntry(table[i*entrySize:], e)
		h.Length += uint64(e.Length)
	}
	var hb [headerSize]byte
	h.encode(&hb)
	p.send(hb[:], table, payload)
}

// TestReceiverScatterFrames drives the scatter path by hand: writes to two
// regions land; one bad entry (wherever it is) refuses the whole frame
// before any byte lands, with an ack naming the entry; a malformed table is
// a protocol error; the stream stays usable after refusals.
func TestReceiverScatterFrames(t *testing.T) {
	tr, bufA, dA := newRecv(t, 1<<16)
	bufB, err := transport.AllocHost("recv-b", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bufB.Close() })
	dB, err := tr.RegisterMemory(bufB.Memory())
	if err != nil {
		t.Fatal(err)
	}
	a, b := uint32(dA.ID), uint32(dB.ID)
	A, B := bufA.Bytes(), bufB.Bytes()
	p := dialRaw(t, tr, true)

	p.scatter(1, []entry{{a, 3, 100}, {b, 4, 0}, {a, 2, 1<<16 - 2}}, []byte("abcWXYZqr"))
	if ack := p.ack(); ack.Status != ackOK || ack.Seq != 1 || ack.Bytes != 9 {
		t.Fatalf("good scatter frame: ack %+v", ack)
	}
	if string(A[100:103]) != "abc" || string(B[:4]) != "WXYZ" || string(A[1<<16-2:]) != "qr" {
		t.Fatalf("good scatter frame did not land: %q %q %q", A[100:103], B[:4], A[1<<16-2:])
	}

	refusals := []struct {
		name   string
		ents   []entry
		status uint8
		msg    string
	}{
		{"out of bounds last", []entry{{a, 4, 200}, {b, 4, 200}, {a, 4, 1<<16 - 3}}, ackOutOfBounds, "entry 2 of 3: region"},
		{"out of bounds first", []entry{{b, 4, 1 << 16}, {a, 4, 200}}, ackOutOfBounds, "entry 0 of 2"},
		{"offset overflow", []entry{{a, 4, 200}, {a, 8, 1<<64 - 4}}, ackOutOfBounds, "entry 1 of 2"},
		{"unknown region", []entry{{a, 4, 200}, {b + 7, 4, 0}, {b, 4, 200}}, ackUnknownRegion, "entry 1 of 3: region"},
	}
	for i, r := range refusals {
		var n uint32
		for _, e := range r.ents {
			n += e.Length
		}
		p.scatter(uint64(10+i), r.ents, bytes.Repeat([]byte{'!'}, int(n)))
		ack := p.ack()
		if ack.Status != r.status || ack.Seq != uint64(10+i) || ack.Bytes != 0 || !strings.Contains(ack.Msg, r.msg) {
			t.Fatalf("%s: ack %+v, want status %d naming %q", r.name, ack, r.status, r.msg)
		}
		if bytes.Contains(A, []byte("!")) || bytes.Contains(B, []byte("!")) {
			t.Fatalf("%s: a byte of a refused scatter frame landed", r.name)
		}
	}
	// A scatter frame and a write frame back to back, then acks in order.
	var hb [headerSize]byte
	header{Seq: 20, Region: b, Count: 1, Offset: 300, Length: 2}.encode(&hb)
	p.scatter(19, []entry{{b, 1, 400}}, []byte("s"))
	p.send(hb[:], []byte("wf"))
	if x, y := p.ack(), p.ack(); x.Seq != 19 || y.Seq != 20 || x.Status != ackOK || y.Status != ackOK || B[400] != 's' || string(B[300:302]) != "wf" {
		t.Fatalf("scatter then write frame: acks %+v %+v, bytes %q %q", x, y, B[400], B[300:302])
	}

	// Malformed tables: a protocol error, then the connection closes.
	for _, bad := range []struct {
		name string
		send func(p *rawPeer)
		msg  string
	}{
		{"sum mismatch", func(p *rawPeer) {
			h := header{Kind: kindScatter, Seq: 1, Count: 2, Length: 5}
			h.encode(&hb)
			tb := make([]byte, 2*entrySize)
			putEntry(tb, entry{a, 4, 0})
			putEntry(tb[entrySize:], entry{a, 4, 8})
			p.send(hb[:], tb, make([]byte, 5))
		}, "add up to 8 bytes, header says 5"},
		{"zero-length entry", func(p *rawPeer) {
			h := header{Kind: kindScatter, Seq: 1, Count: 2, Length: 4}
			h.encode(&hb)
			tb := make([]byte, 2*entrySize)
			putEntry(tb, entry{a, 4, 0})
			putEntry(tb[entrySize:], entry{a, 0, 8})
			p.send(hb[:], tb, make([]byte, 4))
		}, "entry 1 has length 0"},
		{"too many entries", func(p *rawPeer) {
			header{Kind: kindScatter, Seq: 1, Count: maxScatterEntries + 1, Length: 1 << 20}.encode(&hb)
			p.send(hb[:])
		}, "the limit is 1024"},
		{"reserved field", func(p *rawPeer) {
			header{Kind: kindScatter, Seq: 1, Region: a, Count: 1, Length: 4}.encode(&hb)
			p.send(hb[:])
		}, "reserved header fields"},
	} {
		q := dialRaw(t, tr, true)
		bad.send(q)
		if ack := q.ack(); ack.Status != ackProtocol || !strings.Contains(ack.Msg, bad.msg) {
			t.Fatalf("%s: ack %+v, want a protocol error containing %q", bad.name, ack, bad.msg)
		}
		if _, err := q.c.Read(make([]byte, 1)); err == nil {
			t.Fatalf("%s: connection still open after a protocol error", bad.name)
		}
	}
	// The first connection still works.
	p.scatter(30, []entry{{a, 2, 500}, {b, 2, 500}}, []byte("okOK"))
	if ack := p.ack(); ack.Status != ackOK || string(A[500:502]) != "ok" || string(B[500:502]) != "OK" {
		t.Fatalf("scatter after refusals: %+v", ack)
	}
}

func TestLockOrder(t *testing.T) {
	r := func(id transport.RegionID) *region { return &region{id: id} }
	a, b, c := r(1), r(2), r(9)
	for _, tc := range []struct {
		in   []*region
		want []*region
	}{
		{[]*region{a}, []*region{a}},
		{[]*region{c, b, a}, []*region{a, b, c}},
		{[]*region{b, a, b, a, b}, []*region{a, b}}, // repeats, not adjacent
		{[]*region{c, c, c, a, a, c}, []*region{a, c}},
	} {
		got := lockOrder(tc.in, make([]*region, 1))
		if !slices.Equal(got, tc.want) {
			var ids []transport.RegionID
			for _, g := range got {
				ids = append(ids, g.id)
			}
			t.Errorf("lockOrder(%d regions) = ids %v, want each region once, ascending", len(tc.in), ids)
		}
	}
}

// TestScatterDeregisterNoDeadlock sends scatter frames that touch several
// regions in alternating orders from several streams while the regions are
// deregistered concurrently: every batch must end (completed or refused
// with ErrUnknownRegion) and nothing may hang. (The lock order that rules
// out a cycle is checked deterministically by TestLockOrder; this is the
// end-to-end check under load.)
func TestScatterDeregisterNoDeadlock(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rx, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	o := transport.DefaultOptions()
	o.Streams = 4
	tx, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Close()
	src, err := transport.AllocHost("src", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := tx.RegisterMemory(src.Memory()); err != nil {
		t.Fatal(err)
	}
	const nreg = 4
	var bufs [nreg]*transport.HostBuffer
	for i := range bufs {
		if bufs[i], err = transport.AllocHost("dst", 1<<20); err != nil {
			t.Fatal(err)
		}
		defer bufs[i].Close()
	}
	stop := time.Now().Add(2 * time.Second)
	for round := 0; time.Now().Before(stop); round++ {
		var descs []transport.RegionDesc
		for _, b := range bufs {
			d, err := rx.RegisterMemory(b.Memory())
			if err != nil {
				t.Fatal(err)
			}
			descs = append(descs, d)
		}
		seg, err := tx.OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte(rx.Addr()), Regions: descs})
		if err != nil {
			t.Fatal(err)
		}
		var ids []transport.BatchID
		for k := 0; k < 8; k++ {
			var b transport.TransferBatch
			for j := 0; j < 256; j++ {
				d := descs[(j+k)%nreg]
				if k%2 == 1 {
					d = descs[nreg-1-(j+k)%nreg]
				}
				b.Requests = append(b.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(j*4096), Remote: d.ID, RemoteOffset: uint64(j * 4096), Length: 4096})
			}
			id, err := seg.Submit(ctx, &b)
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		var wg sync.WaitGroup // deregister concurrently: two waiting writers are needed for a cycle
		for _, d := range descs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := rx.DeregisterMemory(d.ID); err != nil {
					t.Error(err)
				}
			}()
		}
		for _, id := range ids {
			st, err := seg.Wait(ctx, id)
			if err != nil {
				t.Fatalf("round %d: batch did not end: %v (deadlock?)", round, err)
			}
			if st.State == transport.BatchFailed && !errors.Is(st.Err, transport.ErrUnknownRegion) {
				t.Fatalf("round %d: batch failed with %v, want completed or ErrUnknownRegion", round, st.Err)
			}
		}
		wg.Wait()
		seg.Close()
	}
}
