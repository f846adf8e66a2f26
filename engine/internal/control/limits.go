package control

import (
	"fmt"
	"strconv"
)

// Frame size limits. A rank reads control frames from anyone who can reach
// its control port, so what it receives is bounded twice: every socket
// that receives control frames sets ZMQ_MAXMSGSIZE to MaxFrameBytes (libzmq
// then reads a larger frame's length and drops the connection without
// allocating it), and the receive loop keeps a message only while each of
// its frames fits what its type can need (LimitOf): a STATUS frame of 2 MiB
// is dropped with a log line naming the type, the frame and both sizes.

// MaxRegionTableBytes bounds a region table frame (REGISTER, PROBE): 16 MiB,
// room for every region of kvargs.MaxBuffers KV, aux and state buffers with
// keys of a few dozen bytes each.
const MaxRegionTableBytes = 16 << 20

// MaxFrameBytes is the largest frame any control message can need: a
// TRANSFER's page list (4 bytes a page, up to 2^24 pages). It is the
// ZMQ_MAXMSGSIZE of every socket that receives control frames.
const MaxFrameBytes = 4 * maxPages

// ErrFrameTooLarge is wrapped by the error of a control message that has a
// frame larger than its type can need, or more frames (LimitOf). It wraps
// ErrBadFrame.
var ErrFrameTooLarge = fmt.Errorf("%w: frame too large for its type", ErrBadFrame)

// FrameLimit is what one control message type can need on the wire,
// envelope included.
type FrameLimit struct {
	// Frames is the most frames a message of the type has.
	Frames int
	// FrameBytes is the largest frame it can carry, in bytes.
	FrameBytes int
}

// geometryListBytes is a Geometry frame's packed u64 list at its limit.
const geometryListBytes = 8 * maxBuffers

// LimitOf returns the limit of messages whose frame 2 is typ. An unknown
// type gets the limit of a PING (its decoder refuses it anyway).
func LimitOf(typ string) FrameLimit {
	l := func(frames, bytes int) FrameLimit {
		return FrameLimit{Frames: frames + EnvelopeFrames, FrameBytes: max(bytes, maxStringBytes)}
	}
	switch typ {
	case MsgRegister:
		return l(4+geometryFrames+3+3*maxTransports, max(MaxBlobBytes, MaxRegionTableBytes, geometryListBytes))
	case MsgRegisterAck:
		return l(6+geometryFrames, geometryListBytes)
	case MsgTransfer:
		return l(transferFrames, 4*maxPages)
	case MsgAbort:
		return l(abortFrames, 0)
	case MsgAbortAck:
		return l(abortAckFrames, 0)
	case MsgStatus:
		return l(9, 0)
	case MsgHandshake:
		return l(7, MaxBlobBytes)
	case MsgHandshakeAck:
		return l(7, 0)
	case MsgProbe:
		return l(7+3*maxTransports, MaxBlobBytes+25)
	case MsgProbeResult:
		return l(9+6*maxTransports, 0)
	case MsgSubscribe:
		return l(6, 0)
	case MsgVersion:
		return l(5, 0)
	case MsgVerdictAck:
		return l(verdictAckFrames, 0)
	}
	return l(4, 0)
}

// FrameCheck bounds one message's frames as they arrive: Check(i, n) for
// frame i, in order. The zero value is ready; it learns the type
// from frame 2.
type FrameCheck struct {
	typ     string
	lim     FrameLimit
	foreign bool // frame 1 names another protocol version
}

// foreignLimit bounds a message of another protocol version, whose types
// may carry other fields: only the largest frame any type can need here,
// and a generous frame count (the version-skew answer reads a few fields,
// DecodeForeign).
var foreignLimit = FrameLimit{Frames: 128, FrameBytes: MaxFrameBytes}

// Check returns nil while frame i fits, else an error wrapping
// ErrFrameTooLarge that names the type, the frame and both sizes.
func (c *FrameCheck) Check(i int, frame []byte) error {
	switch {
	case i < 2:
		if len(frame) > 64 {
			return fmt.Errorf("%w: frame %d (magic or version) is %d bytes", ErrFrameTooLarge, i, len(frame))
		}
		if i == 1 {
			c.foreign = string(frame) != strconv.Itoa(ControlVersion)
		}
		return nil
	case i == 2:
		if len(frame) > 64 {
			return fmt.Errorf("%w: frame 2 (message type) is %d bytes", ErrFrameTooLarge, len(frame))
		}
		c.typ, c.lim = string(frame), LimitOf(string(frame))
		if c.foreign {
			c.lim = foreignLimit
		}
		return nil
	case i >= c.lim.Frames:
		return fmt.Errorf("%w: a %s message has at most %d frames, this one more", ErrFrameTooLarge, Trunc([]byte(c.typ)), c.lim.Frames)
	case len(frame) > c.lim.FrameBytes:
		return fmt.Errorf("%w: %s frame %d is %d bytes, over the %d bytes its type can need", ErrFrameTooLarge, Trunc([]byte(c.typ)), i, len(frame), c.lim.FrameBytes)
	}
	return nil
}
