package cluster

import (
	"bytes"
	"testing"
)

// TestLinePrefixer: complete lines get the prefix, a line split over writes
// is joined, and a last line without a newline comes out at flush.
func TestLinePrefixer(t *testing.T) {
	var out bytes.Buffer
	l := &linePrefixer{prefix: "[p] ", w: &out}
	for _, w := range []string{"one\ntw", "o\n", "thr", "ee"} {
		if n, err := l.Write([]byte(w)); n != len(w) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", w, n, err)
		}
	}
	if got, want := out.String(), "[p] one\n[p] two\n"; got != want {
		t.Fatalf("before flush: %q, want %q", got, want)
	}
	l.flush()
	if got, want := out.String(), "[p] one\n[p] two\n[p] three\n"; got != want {
		t.Fatalf("after flush: %q, want %q", got, want)
	}
}
