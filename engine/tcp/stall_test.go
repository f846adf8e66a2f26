package tcp_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// A receiver that accepts connections but never reads or acknowledges (a
// hung process, a host gone without FIN) must fail the batch with
// ErrPeerLost once the ack timeout passes, not hang.
func TestSilentPeerFailsBatch(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	defer func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	}()

	o := transport.DefaultOptions()
	o.Streams = 2
	o.TCP.AckTimeout = 300 * time.Millisecond
	tr, err := tcp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	buf, err := transport.AllocHost("src", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Close()
	if _, err := tr.RegisterMemory(buf.Memory()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	seg, err := tr.OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte(ln.Addr().String()), Regions: []transport.RegionDesc{{ID: 1, Length: 1 << 20}}})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: buf.Addr(), Remote: 1, Length: 4096}}})
	if err != nil {
		t.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil {
		t.Fatalf("Wait: %v — the sender hung on a silent peer", err)
	}
	if st.State != transport.BatchFailed || !errors.Is(st.Err, transport.ErrPeerLost) || !strings.Contains(st.Err.Error(), "no acknowledgement") {
		t.Fatalf("batch to a silent peer: %v %v, want failed with ErrPeerLost (no acknowledgement)", st.State, st.Err)
	}
	// Later submits fail at once with the same cause.
	if _, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: buf.Addr(), Remote: 1, Length: 16}}}); err != nil && !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("Submit after loss: %v, want ErrPeerLost", err)
	}
}

func TestOpenSegmentErrors(t *testing.T) {
	tr, err := tcp.New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := tr.OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte("no-port")}); err == nil || !strings.Contains(err.Error(), "host:port") {
		t.Errorf("malformed endpoint: %v", err)
	}
	// A port nobody listens on (bound, never listening: no other process
	// can take it meanwhile, as it could a listener's port once closed).
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.DeadPort(t))
	if _, err := tr.OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte(addr)}); !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("dial refused: %v, want ErrPeerLost", err)
	}
	for _, o := range []transport.Options{{Streams: 65}, {Streams: -1}, {ListenPort: 70000}, {TCP: transport.TCPOptions{AckTimeout: -time.Second}}} {
		if tr, err := tcp.New(o); err == nil {
			tr.Close()
			t.Errorf("New(%+v) succeeded; want an option error", o)
		}
	}
	tr.Close()
	if _, err := tr.OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte(addr)}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("OpenSegment after Close: %v, want ErrClosed", err)
	}
	if _, err := tr.Endpoint(ctx, "x"); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("Endpoint after Close: %v, want ErrClosed", err)
	}
}

func TestRegistry(t *testing.T) {
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatalf("OpenTransport(tcp): %v", err)
	}
	defer tr.Close()
	if tr.Name() != "tcp" || !tr.Capabilities().Has(transport.CapHostMemory|transport.CapCrossHost|transport.CapStrided) {
		t.Errorf("name %q caps %b", tr.Name(), tr.Capabilities())
	}
	ep, err := tr.Endpoint(context.Background(), "peer")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := net.SplitHostPort(string(ep)); err != nil {
		t.Errorf("Endpoint %q is not host:port", ep)
	}
}
