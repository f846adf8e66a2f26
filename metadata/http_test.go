package metadata_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/metadata"
	"github.com/kvxfer/kvxfer/metadata/httpmeta"
)

// metaServer is a running httpmeta server on 127.0.0.1.
type metaServer struct {
	*httpmeta.Server
	url  string
	stop func()
}

// startMetaServer starts an HTTP metadata server on port (0: a free one).
func startMetaServer(t *testing.T, port int) *metaServer {
	t.Helper()
	s := httpmeta.New(httpmeta.Options{Host: "127.0.0.1", Port: port})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Start(ctx) }()
	select {
	case <-s.Ready():
	case err := <-done:
		cancel()
		t.Fatal(err)
	}
	m := &metaServer{Server: s, url: "http://" + s.Addr() + "/metadata"}
	stopped := false
	m.stop = func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	t.Cleanup(m.stop)
	return m
}

func openHTTP(t *testing.T, url string) *metadata.HTTPStore {
	t.Helper()
	s, err := metadata.OpenHTTP(context.Background(), url, metadata.HTTPOptions{Timeout: 2 * time.Second, Refresh: 100 * time.Millisecond, Poll: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestParseHTTPURL(t *testing.T) {
	for _, tc := range []struct{ in, err string }{
		{in: "http://127.0.0.1:8080/metadata"},
		{in: " https://meta.example:443/metadata "},
		{in: "http://[::1]:8080/v1/metadata"},
		{in: "http://h/metadata"},
		{in: "etcd://h:2379", err: `scheme "etcd"`},
		{in: "http://:8080/metadata", err: "no host"},
		{in: "http://h:8080", err: "no path"},
		{in: "http://h:8080/", err: "no path"},
		{in: "http://h:0/metadata", err: "want 1–65535"},
		{in: "http://h:99999/metadata", err: "want 1–65535"},
		{in: "http://h:1/metadata?key=x", err: "no query"},
		{in: "http://u:p@h:1/metadata", err: "no query, fragment or user"},
	} {
		_, err := metadata.ParseHTTPURL(tc.in)
		if tc.err == "" && err != nil {
			t.Errorf("%q: %v", tc.in, err)
		}
		if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%q: %v, want an error with %q", tc.in, err, tc.err)
		}
	}
	if !metadata.IsHTTP("HTTP://x/y") || metadata.IsHTTP("etcd://x") {
		t.Error("IsHTTP")
	}
	_, err := metadata.ParseURL("http://h:8080/metadata")
	if err == nil || !strings.Contains(err.Error(), "OpenHTTP") {
		t.Errorf("ParseURL of an http URL: %v", err)
	}
}

func TestOpenHTTPErrors(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String() + "/metadata"
	ln.Close()
	start := time.Now()
	_, err = metadata.OpenHTTP(context.Background(), dead, metadata.HTTPOptions{Timeout: time.Second})
	if !errors.Is(err, transport.ErrMetadataUnavailable) || !strings.Contains(err.Error(), dead) {
		t.Fatalf("nothing listening: %v", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatalf("took %v", time.Since(start))
	}
	// Something that is not a metadata server: named as such, not "unavailable".
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "who?", http.StatusTeapot) }))
	defer other.Close()
	_, err = metadata.OpenHTTP(context.Background(), other.URL+"/metadata", metadata.HTTPOptions{})
	if err == nil || errors.Is(err, transport.ErrMetadataUnavailable) || !strings.Contains(err.Error(), "is it a metadata server") {
		t.Fatalf("teapot: %v", err)
	}
	// A server that accepts and never answers: bounded by Timeout.
	hang, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hang.Close()
	start = time.Now()
	_, err = metadata.OpenHTTP(context.Background(), "http://"+hang.Addr().String()+"/metadata", metadata.HTTPOptions{Timeout: 300 * time.Millisecond})
	if !errors.Is(err, transport.ErrMetadataUnavailable) || time.Since(start) > 10*time.Second {
		t.Fatalf("stalled server: %v after %v", err, time.Since(start))
	}
}

// TestHTTPStoreDirectory: Publish / Resolve / Watch / Unpublish against the
// server, and the stored record is the descriptor's wire form under
// kvxfer's prefix.
func TestHTTPStoreDirectory(t *testing.T) {
	srv := startMetaServer(t, 0)
	a, b := openHTTP(t, srv.url), openHTTP(t, srv.url)
	ctx := context.Background()
	if _, _, err := b.Resolve(ctx, "seg-a"); !errors.Is(err, transport.ErrSegmentNotFound) {
		t.Fatalf("resolve before publish: %v", err)
	}
	d := desc("seg-a", 7)
	if err := a.Publish(ctx, d); err != nil {
		t.Fatal(err)
	}
	if v, ok := srv.Get(metadata.HTTPSegmentPrefix + "seg-a"); !ok || !bytes.Equal(v, d.Encode()) {
		t.Fatalf("stored %q", v)
	}
	got, rev, err := b.Resolve(ctx, "seg-a")
	if err != nil || got.Epoch != 7 || rev <= 0 {
		t.Fatalf("resolve: %+v rev %d %v", got, rev, err)
	}
	var ev events
	stop := b.Watch("seg-a", rev, ev.add)
	defer stop()
	if err := a.Publish(ctx, desc("seg-a", 8)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "watch sees the new epoch", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return !e.Deleted && e.Desc.Epoch == 8 }) == 1
	})
	if err := a.Unpublish(ctx, "seg-a"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "watch sees the deletion", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return e.Deleted }) == 1
	})
	if err := a.Unpublish(ctx, "seg-a"); err != nil {
		t.Fatalf("unpublish of an absent name: %v", err)
	}
	// A malformed record is reported as such, not as a descriptor.
	if r := srv.Serve(http.MethodPut, "key="+metadata.HTTPSegmentPrefix+"junk", strings.NewReader("{not json")); r.Status != 200 {
		t.Fatal(r.Status)
	}
	if _, _, err := b.Resolve(ctx, "junk"); !errors.Is(err, metadata.ErrBadRecord) {
		t.Fatalf("junk record: %v", err)
	}
	if err := a.Publish(ctx, transport.SegmentDescriptor{}); err == nil {
		t.Fatal("empty name published")
	}
	a.Close()
	if err := a.Publish(ctx, d); !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("publish after close: %v", err)
	}
}

// TestTransferEngineOverHTTP: engines find each other by name through the
// HTTP metadata server (any name), late registrations are found, a peer
// restart behind the name invalidates the open segment through the watch,
// and an orderly close removes the record.
func TestTransferEngineOverHTTP(t *testing.T) {
	srv := startMetaServer(t, 0)
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			name := "127.0.0.1:12345-" + tn // Mooncake CI's style of name: not the RPC address
			recv := newEngine(t, tn, name, openHTTP(t, srv.url))
			send := newEngine(t, tn, "127.0.0.1:12347-"+tn, openHTTP(t, srv.url))
			dst := reg(t, recv, 1<<20)
			src := reg(t, send, 1<<20)
			for i := range src.Bytes() {
				src.Bytes()[i] = byte(i * 7)
			}
			seg, err := send.OpenSegment(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if err := write(seg, src.Addr(), uint64(dst.Addr())+64, 8192); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.Bytes()[64:64+8192], src.Bytes()[:8192]) {
				t.Fatal("bytes differ")
			}
			late := reg(t, recv, 1<<16)
			if err := write(seg, src.Addr(), uint64(late.Addr()), 4096); err != nil {
				t.Fatalf("write to memory registered after the open: %v", err)
			}
			recv.Close()
			if _, ok := srv.Get(metadata.HTTPSegmentPrefix + name); ok {
				t.Fatal("the closed engine's record is still in the server")
			}
			again := newEngine(t, tn, name, openHTTP(t, srv.url))
			waitFor(t, 10*time.Second, "segment invalidated after the peer restarted", func() bool { return seg.Err() != nil })
			if !errors.Is(seg.Err(), segengine.ErrSegmentStale) {
				t.Fatalf("Err() = %v", seg.Err())
			}
			seg2, err := send.OpenSegment(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			defer seg2.Close()
			if seg2.Epoch() != again.Epoch() {
				t.Fatalf("reopened epoch %#x, want %#x", seg2.Epoch(), again.Epoch())
			}
			nd := reg(t, again, 4096)
			if err := write(seg2, src.Addr(), uint64(nd.Addr()), 4096); err != nil {
				t.Fatal(err)
			}
			if _, err := send.OpenSegment(context.Background(), "unreachable_peer:9"); !errors.Is(err, transport.ErrSegmentNotFound) {
				t.Fatalf("open of an unknown name: %v", err)
			}
		})
	}
}

// TestHTTPServerDownAndRestarted: with the metadata server gone, an
// established segment keeps transferring and a new open fails with
// ErrMetadataUnavailable naming the server; a restarted (empty) server gets
// every live engine's descriptor back within the refresh interval.
func TestHTTPServerDownAndRestarted(t *testing.T) {
	srv := startMetaServer(t, 0)
	port, _ := strconv.Atoi(srv.Addr()[strings.LastIndexByte(srv.Addr(), ':')+1:])
	recv := newEngine(t, "tcp", "recv", openHTTP(t, srv.url))
	send := newEngine(t, "tcp", "send", openHTTP(t, srv.url))
	dst, src := reg(t, recv, 1<<16), reg(t, send, 1<<16)
	seg, err := send.OpenSegment(context.Background(), "recv")
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	srv.stop()
	if err := write(seg, src.Addr(), uint64(dst.Addr()), 4096); err != nil {
		t.Fatalf("established segment with the metadata server down: %v", err)
	}
	_, err = send.OpenSegment(context.Background(), "recv-other")
	if !errors.Is(err, transport.ErrMetadataUnavailable) || !strings.Contains(err.Error(), srv.url) {
		t.Fatalf("open with the server down: %v", err)
	}
	back := startMetaServer(t, port)
	waitFor(t, 10*time.Second, "descriptors published again in the restarted server", func() bool {
		_, a := back.Get(metadata.HTTPSegmentPrefix + "recv")
		_, b := back.Get(metadata.HTTPSegmentPrefix + "send")
		return a && b
	})
	seg2, err := send.OpenSegment(context.Background(), "recv")
	if err != nil {
		t.Fatal(err)
	}
	defer seg2.Close()
	if err := write(seg2, src.Addr(), uint64(dst.Addr()), 4096); err != nil {
		t.Fatal(err)
	}
	if seg.Err() != nil {
		t.Fatalf("the first segment went stale though its peer never restarted: %v", seg.Err())
	}
}
