package transport_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

func TestParseLocation(t *testing.T) {
	tests := []struct {
		in      string
		kind    transport.MemoryKind
		dev     int
		wantErr bool
	}{
		{"", transport.MemoryHost, 0, false},
		{"cpu", transport.MemoryHost, 0, false},
		{"HOST", transport.MemoryHost, 0, false},
		{"cuda:0", transport.MemoryCUDA, 0, false},
		{"cuda:7", transport.MemoryCUDA, 7, false},
		{"cuda:", 0, 0, true},
		{"cuda:-1", 0, 0, true},
		{"cuda:x", 0, 0, true},
		{"gpu:0", 0, 0, true},
		{" Cuda:3 ", transport.MemoryCUDA, 3, false},
		{"host:0", 0, 0, true},
	}
	for _, tc := range tests {
		k, d, err := transport.ParseLocation(tc.in)
		if (err != nil) != tc.wantErr {
			t.Errorf("transport.ParseLocation(%q) err = %v, wantErr %v", tc.in, err, tc.wantErr)
			continue
		}
		if err == nil && (k != tc.kind || d != tc.dev) {
			t.Errorf("transport.ParseLocation(%q) = %v,%d, want %v,%d", tc.in, k, d, tc.kind, tc.dev)
		}
	}
}
