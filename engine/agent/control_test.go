package agent

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

func TestControlRoundTrip(t *testing.T) {
	for _, r := range []*request{
		{Type: msgHello, ID: 1, From: "d", Instance: 9, To: "p"},
		{Type: msgOpened, ID: 2, From: "d", Instance: 9, To: "p", Peer: "agent:d#9.1", Epoch: 77},
		{Type: msgNotif, ID: 3, From: "d", Instance: 9, To: "p", Msg: []byte("req-1:2")},
	} {
		got, err := decodeRequest(r.encode())
		if err != nil {
			t.Fatalf("%s: %v", r.Type, err)
		}
		if got.Type != r.Type || got.ID != r.ID || got.From != r.From || got.Instance != r.Instance || got.To != r.To || got.Peer != r.Peer || got.Epoch != r.Epoch || !bytes.Equal(got.Msg, r.Msg) {
			t.Fatalf("%s: got %+v, want %+v", r.Type, got, r)
		}
	}
	bad := (&request{Type: msgNotif, ID: 3, From: "d", To: "p", Msg: make([]byte, MaxNotifBytes+1)}).encode()
	if _, err := decodeRequest(bad); !errors.Is(err, control.ErrBadFrame) {
		t.Fatalf("oversized notification: %v", err)
	}
	v2 := (&request{Type: msgHello, ID: 1, From: "d", To: "p"}).encode()
	v2[1] = []byte("2")
	if _, err := decodeRequest(v2); !errors.Is(err, control.ErrBadFrame) {
		t.Fatalf("unknown version: %v", err)
	}
}

func splitFrames(b []byte) [][]byte { return bytes.Split(b, []byte{0}) }

// FuzzDecodeRequest: control requests come from any process that reaches
// the agent's port; none may panic the decoder.
func FuzzDecodeRequest(f *testing.F) {
	f.Add(bytes.Join((&request{Type: msgNotif, ID: 3, From: "d", Instance: 1, To: "p", Msg: []byte("m")}).encode(), []byte{0}))
	f.Add(bytes.Join((&request{Type: msgOpened, ID: 3, From: "d", Instance: 1, To: "p", Peer: "x", Epoch: 5}).encode(), []byte{0}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if _, err := decodeRequest(splitFrames(b)); err != nil && !errors.Is(err, control.ErrBadFrame) {
			t.Fatalf("error does not wrap ErrBadFrame: %v", err)
		}
	})
}

// FuzzDecodeReply: replies come from the address in a peer's metadata.
func FuzzDecodeReply(f *testing.F) {
	f.Add(bytes.Join((&reply{ID: 4, OK: true, Payload: [][]byte{[]byte("peer"), []byte("12")}}).encode(), []byte{0}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if _, err := decodeReply(splitFrames(b)); err != nil && !errors.Is(err, control.ErrBadFrame) {
			t.Fatalf("error does not wrap ErrBadFrame: %v", err)
		}
	})
}
