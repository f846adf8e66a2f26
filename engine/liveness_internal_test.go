package engine

import (
	"strings"
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

// TestPauseNote: a gap between monitorLoop's rounds longer than half the
// peer timeout is a pause of this process, and a peer declared silent
// within 3 peer timeouts after it is worded as this process's doing, not the
// peer's; shorter gaps, and losses long after, keep the plain wording.
func TestPauseNote(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const hb, tmo = 500 * time.Millisecond, 10 * time.Second
	for _, tc := range []struct {
		name     string
		gap      time.Duration // round end to the next tick
		lostAt   time.Duration // after the tick
		wantNote bool
	}{
		{"a tick late", hb + 100*time.Millisecond, time.Second, false},
		{"under half the peer timeout", hb + 4*time.Second, time.Second, false},
		{"SIGSTOP 15 s, loss 10 s after", hb + 15*time.Second, 10 * time.Second, true},
		{"SIGSTOP 6 s, loss at once", hb + 6*time.Second, 0, true},
		{"loss long after the pause", hb + 15*time.Second, 31 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Manager{cfg: ManagerConfig{Role: RoleDecode, PeerTimeout: tmo, HeartbeatInterval: hb}, rankName: "tp0/pp0"}
			m.notePause(time.Time{}, t0) // the first round: nothing to compare
			m.notePause(t0, t0.Add(tc.gap))
			note := m.pauseNote(t0.Add(tc.gap + tc.lostAt))
			if (note != "") != tc.wantNote {
				t.Fatalf("pauseNote = %q, want a note: %v", note, tc.wantNote)
			}
			if tc.wantNote {
				paused := (tc.gap - hb).Round(100 * time.Millisecond).String()
				for _, want := range []string{"this decode rank tp0/pp0 itself ran nothing for " + paused, "SIGSTOP", "not at the peer"} {
					if !strings.Contains(note, want) {
						t.Fatalf("pauseNote = %q, want %q in it", note, want)
					}
				}
			}
		})
	}
}
