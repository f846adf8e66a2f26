package control

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
)

// check runs FrameCheck over frames and returns the first refusal.
func check(frames [][]byte) error {
	var c FrameCheck
	for i, f := range frames {
		if err := c.Check(i, f); err != nil {
			return err
		}
	}
	return nil
}

// TestFrameLimits: every message type at its largest legal size, sealed
// with the envelope and a tag, passes its type's limit and decodes; one
// byte or one frame more than its type can need is refused naming the
// type, the frame and both sizes.
func TestFrameLimits(t *testing.T) {
	key := ControlKey("tok")
	big := func(n int) []int32 { return make([]int32, n) }
	reg := sampleRegister()
	for len(reg.Transports) < maxTransports {
		reg.Transports = append(reg.Transports, reg.Transports[0])
	}
	reg.Transports[0].Endpoint = make([]byte, MaxBlobBytes)
	long := strings.Repeat("r", maxStringBytes)
	for _, m := range []interface{ Encode() [][]byte }{
		reg,
		&RegisterAckMsg{Endpoint: "tcp://h:2", Err: long, Geometry: sampleGeometry(), Epoch: 77},
		&TransferMsg{Attempt: 3, Room: 1, Endpoint: "tcp://h:1", Pages: big(maxPages), Slot: 1, RequiredDstInfoNum: 1, Epoch: 1, AuxIndex: -1, StateIndices: big(maxPages)},
		&AbortMsg{Room: 42, Endpoint: "tcp://h:1", Reason: long, Epoch: 9},
		&AbortAckMsg{Room: 42, Endpoint: "tcp://h:2", Producer: 3, Epoch: 9, Detail: long},
		&StatusMsg{Room: 43, State: StatusFailed, Endpoint: "tcp://h:2", Reason: long, Epoch: 1},
		&HandshakeMsg{Endpoint: "tcp://h:2", Transport: "rdma", Reply: make([]byte, MaxBlobBytes), Epoch: 3},
		&HandshakeAckMsg{Endpoint: "tcp://h:1", Transport: "rdma", Err: long, Epoch: 3},
		&PingMsg{Endpoint: "tcp://h:1"},
		&SubscribeMsg{Room: 1, Endpoint: "tcp://h:1", Epoch: 12},
		&VerdictAckMsg{Room: 1, Endpoint: "tcp://h:1", Epoch: 12, Attempt: 3, Detail: long},
		&VersionMsg{Endpoint: "tcp://h:1", Reason: long},
	} {
		frames := SealControl(m.Encode(), "inst", 1, 1, time.Now(), key)
		typ := string(frames[2])
		if err := check(frames); err != nil {
			t.Fatalf("%s at its largest: %v", typ, err)
		}
		if _, err := DecodeControl(frames[:len(frames)-EnvelopeFrames]); err != nil && typ != MsgVersion {
			t.Fatalf("%s at its largest does not decode: %v", typ, err)
		}
		lim := LimitOf(typ)
		if len(frames) > lim.Frames {
			t.Fatalf("%s: %d frames, limit %d", typ, len(frames), lim.Frames)
		}
		over := append(append([][]byte(nil), frames...), []byte("x"))
		for len(over) <= lim.Frames {
			over = append(over, []byte("x"))
		}
		if err := check(over); !errors.Is(err, ErrFrameTooLarge) || !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), typ) {
			t.Errorf("%s with %d frames: %v, want ErrFrameTooLarge naming the type", typ, len(over), err)
		}
		fat := append([][]byte(nil), frames...)
		fat[3] = make([]byte, lim.FrameBytes+1)
		if err := check(fat); !errors.Is(err, ErrFrameTooLarge) || !strings.Contains(err.Error(), "frame 3 is") {
			t.Errorf("%s with a %d-byte frame 3: %v, want ErrFrameTooLarge naming the frame", typ, lim.FrameBytes+1, err)
		}
		if lim.FrameBytes > MaxFrameBytes {
			t.Errorf("%s: frame limit %d over the socket's MaxFrameBytes %d", typ, lim.FrameBytes, MaxFrameBytes)
		}
	}
	if err := check([][]byte{bytes.Repeat([]byte("K"), 65)}); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("a 65-byte magic frame: %v", err)
	}
	if err := check([][]byte{[]byte(ControlMagic), []byte(strconv.Itoa(ControlVersion)), []byte("NOPE"), make([]byte, maxStringBytes+1)}); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("an unknown type with a large frame: %v", err)
	}
	// Another version's message is bounded by the socket's frame limit only
	// (its types may have other fields): the version-skew answer sees it.
	foreign := [][]byte{[]byte(ControlMagic), []byte("99"), []byte(MsgStatus)}
	for range 40 {
		foreign = append(foreign, make([]byte, 8192))
	}
	if err := check(foreign); err != nil {
		t.Errorf("a message of another version with 43 frames of 8 KiB: %v, want it kept for the version answer", err)
	}
	if _, err := unpackRegions(make([]byte, MaxRegionTableBytes+1)); err == nil {
		t.Error("a region table over MaxRegionTableBytes decoded")
	}
}
