package engine_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/engine"
)

func TestParseLocation(t *testing.T) {
	tests := []struct {
		in      string
		kind    engine.MemoryKind
		dev     int
		wantErr bool
	}{
		{"", engine.MemoryHost, 0, false},
		{"cpu", engine.MemoryHost, 0, false},
		{"HOST", engine.MemoryHost, 0, false},
		{"cuda:0", engine.MemoryCUDA, 0, false},
		{"cuda:7", engine.MemoryCUDA, 7, false},
		{"cuda:", 0, 0, true},
		{"cuda:-1", 0, 0, true},
		{"cuda:x", 0, 0, true},
		{"gpu:0", 0, 0, true},
		{" Cuda:3 ", engine.MemoryCUDA, 3, false},
		{"host:0", 0, 0, true},
	}
	for _, tc := range tests {
		k, d, err := engine.ParseLocation(tc.in)
		if (err != nil) != tc.wantErr {
			t.Errorf("engine.ParseLocation(%q) err = %v, wantErr %v", tc.in, err, tc.wantErr)
			continue
		}
		if err == nil && (k != tc.kind || d != tc.dev) {
			t.Errorf("engine.ParseLocation(%q) = %v,%d, want %v,%d", tc.in, k, d, tc.kind, tc.dev)
		}
	}
}
