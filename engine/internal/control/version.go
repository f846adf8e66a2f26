package control

import (
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"strconv"
	"strings"
)

// Version skew (issue 22 case 8). A rank drops every frame of another
// protocol version (its fields may mean something else), so two ranks of
// different versions used to wait for each other in silence: the decode
// until its peer timeout ("silent … hung"), the prefill until its bootstrap
// timeout. From version 6 on, a rank that receives a frame of another
// version reads the few fields every version since 2 keeps in place
// (DecodeForeign: the type, the sender's endpoint, the room of TRANSFER,
// ABORT, ABORT_ACK and STATUS) and answers with VERSION, whose layout is
// fixed for every version from now on, so that both sides fail at once
// naming both versions:
//
//	frame 0: "KVXFER"   frame 1: the sender's version (ASCII decimal)
//	frame 2: "VERSION"  frame 3: sender endpoint   frame 4: reason text
//
// followed by the sender's envelope (five frames, as in versions 5 to 7;
// with control authentication its tag covers every frame before it,
// ForeignTagValid). A VERSION frame is never answered.

// MsgVersion is the type of the version refusal (frame 2).
const MsgVersion = "VERSION"

// VersionMsg tells a peer of another protocol version that this rank
// cannot speak with it: Endpoint is the sender's control endpoint, Reason
// names both versions.
type VersionMsg struct {
	Endpoint string
	Reason   string
}

// Encode returns the message's frames (frame 1 is this build's version).
func (m *VersionMsg) Encode() [][]byte {
	return append(header(MsgVersion), []byte(m.Endpoint), []byte(m.Reason))
}

// DecodeVersion decodes a VERSION message of this build's version (a peer
// sends it only to another version, so this one is stray). Errors wrap
// ErrBadFrame.
func DecodeVersion(parts [][]byte) (*VersionMsg, error) {
	r, err := newReader(parts, MsgVersion, 5, true)
	if err != nil {
		return nil, err
	}
	m := &VersionMsg{Endpoint: r.endpoint(3), Reason: r.Str(4, "reason")}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// ForeignFrame is what a rank reads from a control frame of another
// protocol version (DecodeForeign).
type ForeignFrame struct {
	// Version is the sender's protocol version (frame 1), not ControlVersion.
	Version int
	// Type is frame 2 (a type this build may not know).
	Type string
	// Endpoint is the sender's control endpoint ("" when the type's
	// layout is not known).
	Endpoint string
	// Room is the bootstrap_room of TRANSFER, ABORT, ABORT_ACK and STATUS
	// (HasRoom).
	Room    uint64
	HasRoom bool
	// Reason is VERSION's reason text or ABORT's reason ("" otherwise).
	Reason string
}

// foreignLayout gives, per type, the frames of the endpoint, the room (0:
// none) and the reason (0: none), as every version since 2 has them.
var foreignLayout = map[string][3]int{
	MsgVersion:      {3, 0, 4},
	MsgRegister:     {3, 0, 0},
	MsgRegisterAck:  {3, 0, 0},
	MsgPing:         {3, 0, 0},
	MsgHandshake:    {3, 0, 0},
	MsgHandshakeAck: {3, 0, 0},
	MsgTransfer:     {4, 3, 0},
	MsgAbort:        {4, 3, 5},
	MsgAbortAck:     {4, 3, 0},
	MsgStatus:       {6, 3, 0},
}

// ForeignVersion reports whether parts is a kvxfer control frame (magic
// in frame 0) whose version (frame 1, an ASCII decimal) is not own, and
// returns that version.
func ForeignVersion(parts [][]byte, own int) (int, bool) {
	if len(parts) < 3 || string(parts[0]) != ControlMagic || len(parts[1]) == 0 || len(parts[1]) > 9 {
		return 0, false
	}
	for _, c := range parts[1] {
		if c < '0' || c > '9' {
			return 0, false
		}
	}
	v, err := strconv.Atoi(string(parts[1]))
	if err != nil || v == own {
		return 0, false
	}
	return v, true
}

// DecodeForeign reads a frame of another protocol version (version v, as
// ForeignVersion returned it) by the layout every version keeps (see
// above). The endpoint must be a "tcp://" endpoint of at most 4096 bytes;
// errors wrap ErrBadFrame. It never panics.
func DecodeForeign(parts [][]byte, v int) (ForeignFrame, error) {
	f := ForeignFrame{Version: v}
	if len(parts) < 3 {
		return f, fmt.Errorf("%w: %d frames", ErrBadFrame, len(parts))
	}
	f.Type = Trunc(parts[2])
	lay, ok := foreignLayout[string(parts[2])]
	if !ok {
		return f, nil // a type this build does not know: nobody to tell
	}
	f.Type = string(parts[2])
	r := &FrameReader{Msg: f.Type + " (protocol " + strconv.Itoa(v) + ")", Parts: parts}
	for _, i := range lay {
		if i >= len(parts) {
			return f, fmt.Errorf("%w: %s of protocol %d has %d frames, want at least %d", ErrBadFrame, f.Type, v, len(parts), i+1)
		}
	}
	ep := r.Str(lay[0], "endpoint")
	if r.Err == nil && !strings.HasPrefix(ep, "tcp://") {
		r.Fail(lay[0], "endpoint %q: want tcp://host:port", Trunc([]byte(ep)))
	}
	if lay[1] > 0 {
		f.Room, f.HasRoom = r.Uint(lay[1], MaxRoom, "room"), true
	}
	if lay[2] > 0 {
		f.Reason = r.Str(lay[2], "reason")
	}
	if r.Err != nil {
		return ForeignFrame{Version: v, Type: f.Type}, r.Err
	}
	f.Endpoint = ep
	return f, nil
}

// ForeignTagValid reports whether a frame of another version carries, in
// the envelope layout of versions 5 and later (five frames, the tag last),
// a tag that verifies with key over every frame before it.
func ForeignTagValid(parts [][]byte, key []byte) bool {
	if len(parts) < 3+EnvelopeFrames {
		return false
	}
	tag := parts[len(parts)-1]
	return len(tag) == sha256.Size && hmac.Equal(tag, controlTag(key, parts[:len(parts)-1]))
}
