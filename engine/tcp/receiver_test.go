package tcp

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
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

func newRecv(t testing.TB, size int) (*Transport, *engine.HostBuffer, engine.RegionDesc) {
	t.Helper()
	tr, err := New(engine.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	buf, err := engine.AllocHost("recv", int64(size))
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
