//go:build cgo

package main

import (
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// TestEngineWithEtcd: engines created with metadata_server = etcd://…
// publish their segment; another engine opens it by its configured name.
func TestEngineWithEtcd(t *testing.T) {
	c := etcdtest.Start(t, etcdtest.Options{})
	url := c.URL("capi")
	a, err := newEngine(engineConfig{role: 1, transport: "tcp", metadataServer: url, segmentName: "decode-7"})
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	b, err := newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: url})
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	if a.te.Name() != "decode-7" {
		t.Fatalf("segment name %q", a.te.Name())
	}
	h, err := b.openSegmentName(1, "decode-7")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := segments.take(h)
	defer s.close()
	if s.seg.Epoch() != a.te.Epoch() {
		t.Fatalf("epoch %#x, want %#x", s.seg.Epoch(), a.te.Epoch())
	}
	_, err = b.openSegmentName(1, "nobody")
	if codeOf(err) != stNotFound {
		t.Fatalf("unknown name: %v (code %d), want KVX_ERR_NOT_FOUND", err, codeOf(err))
	}
}

func TestEngineMetadataErrors(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close()
	_, err = newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: "etcd://" + dead, rpcTimeout: 1e9})
	if codeOf(err) != stMetadata || !errors.Is(err, transport.ErrMetadataUnavailable) {
		t.Fatalf("unreachable etcd: %v (code %d), want KVX_ERR_METADATA", err, codeOf(err))
	}
	if _, err = newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: "redis://x:1"}); codeOf(err) != stInvalidArgument {
		t.Fatalf("redis URL: %v (code %d)", err, codeOf(err))
	}
}

// TestEngineWithHTTPMetadata: metadata_server = "http://host:port/metadata"
// (Mooncake's HTTP mode) against the embedded server of
// kvx_metadata_server_start; names resolve there, a stopped server is
// KVX_ERR_METADATA.
func TestEngineWithHTTPMetadata(t *testing.T) {
	m, err := startMetaServer("127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + m.srv.Addr() + "/metadata"
	a, err := newEngine(engineConfig{role: 1, transport: "tcp", metadataServer: url, segmentName: "127.0.0.1:12345"})
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	b, err := newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: url, segmentName: "127.0.0.1:12347"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	h, err := b.openSegmentName(1, "127.0.0.1:12345")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := segments.take(h)
	defer s.close()
	if s.seg.Epoch() != a.te.Epoch() {
		t.Fatalf("epoch %#x, want %#x", s.seg.Epoch(), a.te.Epoch())
	}
	if _, err = b.openSegmentName(1, "unreachable_peer:9"); codeOf(err) != stNotFound {
		t.Fatalf("unknown name: %v (code %d), want KVX_ERR_NOT_FOUND", err, codeOf(err))
	}
	if err := m.stop(); err != nil {
		t.Fatal(err)
	}
	if _, err = newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: url, rpcTimeout: 1e9}); codeOf(err) != stMetadata {
		t.Fatalf("stopped server: %v (code %d), want KVX_ERR_METADATA", err, codeOf(err))
	}
	if _, err = newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: "http://127.0.0.1:1"}); codeOf(err) != stInvalidArgument || !strings.Contains(err.Error(), "/metadata") {
		t.Fatalf("URL without the path: %v (code %d)", err, codeOf(err))
	}
}

// TestEngineHostNames: local_hostname "localhost" (LMCache's default) and
// this machine's name bind their local address and are advertised as
// given, so "name:rpc_port" opens the segment; a name of another machine is
// KVX_ERR_INVALID_ARGUMENT naming it.
func TestEngineHostNames(t *testing.T) {
	names := []string{"localhost"}
	if h, err := os.Hostname(); err == nil {
		if _, err := hostaddr.ResolveLocal(context.Background(), h); err == nil {
			names = append(names, h)
		}
	}
	for _, n := range names {
		a, err := newEngine(engineConfig{role: 1, transport: "tcp", localHostname: n, listenHost: n})
		if err != nil {
			t.Fatalf("local_hostname %q: %v", n, err)
		}
		want := net.JoinHostPort(n, strconv.Itoa(a.te.RPCPort()))
		if a.te.Name() != want {
			t.Errorf("segment name %q, want %q", a.te.Name(), want)
		}
		b, err := newEngine(engineConfig{role: 0, transport: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		h, err := b.openSegmentName(1, want)
		if err != nil {
			t.Fatalf("open %q: %v", want, err)
		}
		s, _ := segments.take(h)
		s.close()
		b.close()
		a.close()
	}
	_, err := newEngine(engineConfig{role: 0, transport: "tcp", localHostname: "no-such-host.invalid:0"})
	if codeOf(err) != stInvalidArgument || !strings.Contains(err.Error(), "no-such-host.invalid") {
		t.Fatalf("unresolvable name: %v (code %d)", err, codeOf(err))
	}
}
