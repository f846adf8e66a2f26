package control

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// Control-frame envelope (protocol version 5). Every control message on the
// wire is the message's own frames (its Encode) followed by five frames
// that say who sent it and, optionally, prove it:
//
//	n-5 sender instance id  the sending rank's instance id (Manager.InstanceID,
//	                        1–64 of [A-Za-z0-9._:-]; published in a prefill's
//	                        directory entry)
//	n-4 sender epoch        the sending rank's epoch (Manager.Epoch, its start
//	                        time in Unix ns; also in the directory entry), so a
//	                        restart under a stable instance id is another peer
//	n-3 sent at             sender's clock, Unix milliseconds (ASCII decimal)
//	n-2 sequence            the sender's frame number, 1, 2, 3, ... per sender
//	                        epoch (ASCII decimal; 0: not numbered), so a
//	                        receiver accepts each tagged frame once (replay.go)
//	n-1 tag                 HMAC-SHA256 (32 bytes) over every frame before it,
//	                        each as a 4-byte little-endian length and its
//	                        bytes, keyed with ControlKey(token); empty when the
//	                        sender has no token
//
// A rank with a token (ManagerConfig.ControlToken) drops every frame whose
// tag does not verify, or whose send time is more than ReplayWindow away
// from its own clock, or whose sequence number it has accepted from that
// sender before (replay.go), before looking at anything the frame claims: nobody
// without the deployment's token can inject a REGISTER, HANDSHAKE, TRANSFER,
// ABORT or STATUS, or make it open a socket. A rank without a token accepts
// frames with or without a tag (it cannot check them).
//
// Why HMAC per frame and not ZeroMQ CURVE: a PULL socket does not tell which
// connection a message came from, so CURVE's per-connection authentication
// would prove only "some holder of the key", which is what the tag proves,
// while the tag also binds the identity fields (instance id, endpoint,
// epoch) of each message to the token; it needs no libzmq built with
// libsodium (the C ABI and Python users bring their own libzmq), no key
// distribution beyond the token the deployment already shares for its
// bootstrap directory, and costs about a microsecond per frame. What it
// does not give is secrecy: the frames stay readable on the wire (they carry
// addresses and memory keys, as RDMA fabrics expose anyway).

// envelopeFrames is the number of frames the envelope appends.
const EnvelopeFrames = 5

// ReplayWindow bounds how far a tagged frame's send time may be from the
// receiver's clock (either way): a captured frame can be replayed at most
// this long, and hosts' clocks must agree within it.
const ReplayWindow = 2 * time.Minute

// ErrUnauthenticated is wrapped by errors about control frames whose tag is
// missing or wrong, or whose send time is outside ReplayWindow.
var ErrUnauthenticated = errors.New("engine: control frame not authenticated")

// Envelope is the sender part of a control message (see the envelope
// frames above).
type Envelope struct {
	// Instance is the sender's instance id.
	Instance string
	// Epoch is the sender's epoch (0: none given).
	Epoch uint64
	// SentAt is the sender's clock when it sent the frame (ms precision).
	SentAt time.Time
	// Seq is the sender's frame number (0: not numbered).
	Seq uint64
	// Authenticated reports whether the tag verified with this rank's key.
	Authenticated bool
}

// ControlKey derives the key that tags control frames from the
// deployment's shared token (the bootstrap directory's auth token): every
// rank of a deployment derives the same key. Empty token, nil key.
func ControlKey(token string) []byte {
	if token == "" {
		return nil
	}
	h := hmac.New(sha256.New, []byte(token))
	h.Write([]byte("kvxfer control frames v1"))
	return h.Sum(nil)
}

// controlTag computes the envelope tag over frames with key.
func controlTag(key []byte, frames [][]byte) []byte {
	h := hmac.New(sha256.New, key)
	var n [4]byte
	for _, f := range frames {
		binary.LittleEndian.PutUint32(n[:], uint32(len(f)))
		h.Write(n[:])
		h.Write(f)
	}
	return h.Sum(nil)
}

// SealControl appends the envelope to a message's frames (its Encode): the
// sender's instance id and epoch, now in Unix milliseconds, the sender's
// frame number seq (1, 2, ... per epoch, increasing in the order frames
// leave for one receiver) and, with a non-nil key, the tag. frames is not
// modified.
func SealControl(frames [][]byte, instance string, epoch, seq uint64, now time.Time, key []byte) [][]byte {
	out := make([][]byte, len(frames), len(frames)+EnvelopeFrames)
	copy(out, frames)
	out = append(out, []byte(instance), strconv.AppendUint(nil, epoch, 10), strconv.AppendInt(nil, now.UnixMilli(), 10),
		strconv.AppendUint(nil, seq, 10))
	if key == nil {
		return append(out, []byte{})
	}
	return append(out, controlTag(key, out))
}

// OpenControl checks a received message's header and envelope and returns
// the message's own frames (for DecodeControl) and the envelope. With a key,
// a missing or wrong tag or a send time outside ReplayWindow of now is an
// error wrapping ErrUnauthenticated; without one, any tag is accepted
// unchecked. Other errors wrap ErrBadFrame. It never panics.
func OpenControl(parts [][]byte, key []byte, now time.Time) ([][]byte, Envelope, error) {
	if _, err := controlType(parts); err != nil {
		return nil, Envelope{}, err
	}
	if len(parts) < 3+EnvelopeFrames {
		return nil, Envelope{}, fmt.Errorf("%w: %d frames: no room for the envelope (sender instance id, epoch, send time, sequence, tag)", ErrBadFrame, len(parts))
	}
	n := len(parts) - EnvelopeFrames
	inst, ep, at, sq, tag := parts[n], parts[n+1], parts[n+2], parts[n+3], parts[n+4]
	var env Envelope
	if !bootstrap.ValidInstanceID(string(inst)) {
		return nil, env, fmt.Errorf("%w: envelope frame %d: sender instance id %q: want 1–64 of [A-Za-z0-9._:-]", ErrBadFrame, n, Trunc(inst))
	}
	env.Instance = string(inst)
	epoch, err := strconv.ParseUint(string(ep), 10, 64)
	if err != nil || len(ep) > 20 || (len(ep) > 1 && ep[0] == '0') {
		return nil, env, fmt.Errorf("%w: envelope frame %d: sender epoch %q: want an ASCII decimal", ErrBadFrame, n+1, Trunc(ep))
	}
	env.Epoch = epoch
	ms, err := strconv.ParseInt(string(at), 10, 64)
	if err != nil || len(at) > 19 || ms < 0 || at[0] == '+' || (len(at) > 1 && at[0] == '0') {
		return nil, env, fmt.Errorf("%w: envelope frame %d: send time %q: want Unix milliseconds", ErrBadFrame, n+2, Trunc(at))
	}
	env.SentAt = time.UnixMilli(ms)
	seq, err := strconv.ParseUint(string(sq), 10, 64)
	if err != nil || len(sq) > 20 || (len(sq) > 1 && sq[0] == '0') {
		return nil, env, fmt.Errorf("%w: envelope frame %d: sequence %q: want an ASCII decimal", ErrBadFrame, n+3, Trunc(sq))
	}
	env.Seq = seq
	if len(tag) != 0 && len(tag) != sha256.Size {
		return nil, env, fmt.Errorf("%w: envelope frame %d: tag of %d bytes, want %d or none", ErrBadFrame, n+4, len(tag), sha256.Size)
	}
	if key != nil {
		if len(tag) == 0 {
			return nil, env, fmt.Errorf("%w: %s from instance %s carries no tag: the sender has no control token, this rank requires one (give every rank of the deployment the same token)", ErrUnauthenticated, parts[2], env.Instance)
		}
		if !hmac.Equal(tag, controlTag(key, parts[:n+4])) {
			return nil, env, fmt.Errorf("%w: %s claiming instance %s: tag does not verify (another token, or a forged or altered frame)", ErrUnauthenticated, parts[2], env.Instance)
		}
		if d := now.Sub(env.SentAt); d > ReplayWindow || d < -ReplayWindow {
			return nil, env, fmt.Errorf("%w: %s from instance %s sent %s from this rank's clock (allowed ±%s: a replay, or clocks apart)", ErrUnauthenticated, parts[2], env.Instance, d.Round(time.Second), ReplayWindow)
		}
		env.Authenticated = true
	}
	return parts[:n], env, nil
}
