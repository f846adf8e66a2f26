//go:build cgo

package main

import (
	"errors"
	"net"
	"testing"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
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
	if codeOf(err) != stMetadata || !errors.Is(err, engine.ErrMetadataUnavailable) {
		t.Fatalf("unreachable etcd: %v (code %d), want KVX_ERR_METADATA", err, codeOf(err))
	}
	if _, err = newEngine(engineConfig{role: 0, transport: "tcp", metadataServer: "redis://x:1"}); codeOf(err) != stInvalidArgument {
		t.Fatalf("redis URL: %v (code %d)", err, codeOf(err))
	}
}
