//go:build cgo

package main

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

func TestSplitHostPort(t *testing.T) {
	tests := []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"127.0.0.1:8998", "127.0.0.1", 8998, true},
		{"[::1]:1", "::1", 1, true},
		{"h:65535", "h", 65535, true},
		{"h:0", "", 0, false},
		{"h:65536", "", 0, false},
		{"h", "", 0, false},
		{":80", "", 0, false},
	}
	for _, tc := range tests {
		h, p, err := splitHostPort(tc.in)
		if (err == nil) != tc.ok || (tc.ok && (h != tc.host || p != tc.port)) {
			t.Errorf("splitHostPort(%q) = %q,%d,%v; want %q,%d ok=%v", tc.in, h, p, err, tc.host, tc.port, tc.ok)
		}
	}
}

func TestHandleTable(t *testing.T) {
	a, b := newTable[string](), newTable[int]()
	ha := a.add("x")
	hb := b.add(1)
	if ha == 0 || hb == 0 || ha == hb {
		t.Fatalf("handles %d, %d: want distinct and non-zero", ha, hb)
	}
	if _, ok := b.get(ha); ok {
		t.Error("a handle of one table is valid in another")
	}
	if _, ok := a.take(ha); !ok {
		t.Fatal("take of a live handle failed")
	}
	if _, ok := a.take(ha); ok {
		t.Error("second take of the same handle succeeded (double destroy must fail)")
	}
	if h := a.add("y"); h == ha {
		t.Error("a destroyed handle was reissued")
	}
}

func TestCodeOf(t *testing.T) {
	tests := []struct {
		err  error
		want status
	}{
		{nil, stOK},
		{transport.ErrOutOfBounds, stOutOfBounds},
		{errors.Join(errors.New("tcp: write"), transport.ErrPeerLost), stPeerLost},
		{fail(stBusy, "x"), stBusy},
		{failWrap(stOK, transport.ErrUnknownRegion, "x"), stUnknownRegion},
		{failWrap(stBootstrap, transport.ErrClosed, "x"), stBootstrap},
		{errors.New("something else"), stTransferFailed},
		{fmt.Errorf("open: %w", transport.ErrSegmentNotFound), stNotFound},
		{fmt.Errorf("open: %w", transport.ErrMetadataUnavailable), stMetadata},
		{fmt.Errorf("read: %w", transport.ErrReadUnsupported), stNotSupported},
		{fmt.Errorf("x: %w: refused", segengine.ErrSegmentUnreachable), stPeerLost},
		{fmt.Errorf("x: %w: %w", segengine.ErrSegmentUnreachable, context.DeadlineExceeded), stTimeout},
		{fmt.Errorf("x: %w: %w", segengine.ErrSegmentStale, transport.ErrPeerLost), stPeerLost},
	}
	for _, tc := range tests {
		if got := codeOf(tc.err); got != tc.want {
			t.Errorf("codeOf(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// TestOpenCode: a failed segment open is the caller's argument error exactly
// when the segment engine says so by its sentinels (no error text is read).
func TestOpenCode(t *testing.T) {
	tests := []struct {
		err  error
		want status
	}{
		{fmt.Errorf("open: %w: the peer runs [shm]", segengine.ErrTransportMismatch), stInvalidArgument},
		{fmt.Errorf("open: %w: %w: runs shm, not tcp", segengine.ErrTransportMismatch, segengine.ErrSegmentRefused), stInvalidArgument},
		{fmt.Errorf("open: %w: empty", segengine.ErrBadSegmentName), stInvalidArgument},
		{fmt.Errorf("open: %w: closed engine", segengine.ErrSegmentRefused), stOK},
		{errors.New("open: the segment name is empty (an error without the sentinel)"), stOK},
		{fmt.Errorf("open: %w", segengine.ErrSegmentUnreachable), stOK},
	}
	for _, tc := range tests {
		if got := openCode(tc.err); got != tc.want {
			t.Errorf("openCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// The segment blob is transport.SegmentDescriptor's wire form; its decoder is
// tested and fuzzed in package engine/transport (FuzzDecodeSegmentDescriptor).

func TestSplitDevices(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{"", nil},
		{" , ", nil},
		{"mlx5_0", []string{"mlx5_0"}},
		{"mlx5_0, mlx5_1,", []string{"mlx5_0", "mlx5_1"}},
	}
	for _, tc := range tests {
		if got := splitDevices(tc.in); fmt.Sprint(got) != fmt.Sprint(tc.want) || len(got) != len(tc.want) {
			t.Errorf("splitDevices(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
