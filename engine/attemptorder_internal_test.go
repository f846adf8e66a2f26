package engine

import (
	"testing"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// TestEarlierAttemptOnlyWithinOneDecodeProcess: a TRANSFER naming a
// smaller attempt than the destination's is taken as an earlier attempt
// only when both come from the same decode process (instance id and
// epoch, both known); from a restart (another epoch), another instance or
// an unknown epoch the numbers say nothing, and the TRANSFER is not
// judged by them.
func TestEarlierAttemptOnlyWithinOneDecodeProcess(t *testing.T) {
	cur := &senderDst{msg: &control.TransferMsg{Attempt: 1 << 30}, peer: &decodePeer{id: control.NewPeerID("decode-a", 7)}}
	for _, c := range []struct {
		name    string
		id      control.PeerID
		attempt uint64
		want    bool
	}{
		{"same process, smaller attempt", control.NewPeerID("decode-a", 7), 1<<30 - 1, true},
		{"same process, same attempt", control.NewPeerID("decode-a", 7), 1 << 30, false},
		{"same process, larger attempt", control.NewPeerID("decode-a", 7), 1<<30 + 1, false},
		{"same process, no attempt named", control.NewPeerID("decode-a", 7), 0, false},
		{"restarted process (new epoch)", control.NewPeerID("decode-a", 8), 5, false},
		{"epoch unknown", control.NewPeerID("decode-a", 0), 5, false},
		{"another instance", control.NewPeerID("decode-b", 7), 5, false},
	} {
		v := &control.TransferMsg{Attempt: c.attempt}
		if got := earlierAttemptOfSameDecode(cur, v, &decodePeer{id: c.id}); got != c.want {
			t.Errorf("%s: earlierAttemptOfSameDecode = %v, want %v", c.name, got, c.want)
		}
	}
	if earlierAttemptOfSameDecode(nil, &control.TransferMsg{Attempt: 1}, &decodePeer{id: control.NewPeerID("decode-a", 7)}) {
		t.Error("no destination yet: want false")
	}
}
