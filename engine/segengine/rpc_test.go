package segengine

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

func TestSegmentRPCRoundTrip(t *testing.T) {
	for _, r := range []*segmentRequest{
		{Type: rpcDescribe, ID: 3, Peer: "p", Transport: "tcp"},
		{Type: rpcDescribe, ID: 4},
		{Type: rpcAccept, ID: 5, Peer: "p", Transport: "rdma", Reply: []byte{9, 0, 1}},
	} {
		got, err := decodeSegmentRequest(r.Encode())
		if err != nil {
			t.Fatal(err)
		}
		if got.Reply == nil && r.Reply == nil {
			got.Reply = nil
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("got %+v want %+v", got, r)
		}
	}
	rep := &segmentReply{ID: 9, OK: true, Payload: []byte("x")}
	got, err := decodeSegmentReply(rep.Encode())
	if err != nil || !reflect.DeepEqual(got, rep) {
		t.Fatalf("reply round trip: %+v %v", got, err)
	}
}

// FuzzDecodeSegmentRPC: segment RPC requests and replies (frames joined by
// NUL bytes).
func FuzzDecodeSegmentRPC(f *testing.F) {
	for _, m := range []interface{ Encode() [][]byte }{
		&segmentRequest{Type: rpcDescribe, ID: 1, Peer: "p", Transport: "tcp"},
		&segmentRequest{Type: rpcAccept, ID: 2, Peer: "p", Transport: "rdma", Reply: []byte{1, 2}},
		&segmentReply{ID: 3, OK: true, Payload: []byte("{}")},
		&segmentReply{ID: 4, Payload: []byte("refused")},
	} {
		f.Add(bytes.Join(m.Encode(), []byte{0}))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		parts := bytes.Split(data, []byte{0})
		if req, err := decodeSegmentRequest(parts); err != nil {
			if !errors.Is(err, control.ErrBadFrame) {
				t.Fatalf("request error does not wrap ErrBadFrame: %v", err)
			}
		} else if again, err := decodeSegmentRequest(req.Encode()); err != nil || again.ID != req.ID || again.Type != req.Type || again.Peer != req.Peer {
			t.Fatalf("request re-decode: %+v %v, first %+v", again, err, req)
		}
		if rep, err := decodeSegmentReply(parts); err != nil {
			if !errors.Is(err, control.ErrBadFrame) {
				t.Fatalf("reply error does not wrap ErrBadFrame: %v", err)
			}
		} else if again, err := decodeSegmentReply(rep.Encode()); err != nil || !reflect.DeepEqual(again, rep) {
			t.Fatalf("reply re-decode: %+v %v, first %+v", again, err, rep)
		}
	})
}
