package engine

import (
	"testing"
	"time"
)

// TestLivenessRules: silence is judged against the moment the inbox was last
// found empty, not against the wall clock, and a rank vouches for itself
// only while its receive loop moves.
func TestLivenessRules(t *testing.T) {
	m := &Manager{cfg: ManagerConfig{PeerTimeout: 10 * time.Second}}
	t0 := time.Unix(1000, 0)
	for _, tc := range []struct {
		name          string
		seen, drained time.Duration // after t0
		want          bool
	}{
		{"heard recently", 0, 5 * time.Second, false},
		{"silent past the timeout", 0, 11 * time.Second, true},
		{"exactly the timeout", 0, 10 * time.Second, false},
		// This process was starved (its receive loop last emptied the
		// inbox 1 s after the peer's last message): however late the wall
		// clock, nothing is judged until the queued messages are read.
		{"own stall", 0, time.Second, false},
		{"heard after the last drain", 3 * time.Second, time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := m.silent(t0.Add(tc.seen), t0.Add(tc.drained)); got != tc.want {
				t.Fatalf("silent = %v, want %v", got, tc.want)
			}
		})
	}
	m.progressAt.Store(t0.UnixNano())
	if !m.responsive(t0.Add(5 * time.Second)) {
		t.Fatal("a loop that moved PeerTimeout/2 ago must still ping")
	}
	if m.responsive(t0.Add(5*time.Second + time.Millisecond)) {
		t.Fatal("a loop stuck for more than PeerTimeout/2 must stop vouching for itself")
	}
}
