// Package control is the KV manager's control codec, internal to engine/:
// the versioned ZeroMQ multipart frames ranks exchange (REGISTER,
// REGISTER_ACK, TRANSFER, ABORT, ABORT_ACK, STATUS, HANDSHAKE,
// HANDSHAKE_ACK, PING, and the doctor's PROBE and PROBE_RESULT), their
// encoders and decoders (every decoder is fuzzed: outside input), the sender
// envelope with its optional HMAC tag (SealControl, OpenControl), replay
// protection of authenticated frames (ReplayGuard), and a rank's identity as
// the envelope claims it (PeerID). It knows no sockets and no manager state:
// package engine sends, receives and decides; engine/segengine reads its
// segment RPC frames with FrameReader. internal/layers keeps it internal.
package control

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"

	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Control frames: kvxfer's own versioned ZeroMQ multipart messages (PUSH →
// PULL, like SGLang's control channel, spec §5.1). Every message starts with
//
//	frame 0: "KVXFER"   (ControlMagic)
//	frame 1: "8"        (ControlVersion, ASCII decimal)
//	frame 2: message type ("REGISTER", "REGISTER_ACK", "TRANSFER", "ABORT",
//	         "ABORT_ACK", "STATUS", "HANDSHAKE", "HANDSHAKE_ACK", "PING",
//	         "PROBE", "PROBE_RESULT" (doctor probes, probe.go), "SUBSCRIBE"
//	         (the prefill_complete allocation policy, subscribe.go),
//	         "VERDICT_ACK" (verdictack.go))
//
// followed by the type's fields, one per frame, and on the wire by the
// sender envelope (four frames: sender instance id and epoch, send time,
// optional HMAC tag; see envelope.go, SealControl and OpenControl). Encode
// and the Decode functions work on the message without its envelope. Scalars are
// ASCII decimals; arrays are little-endian packed integers (SGLang's
// conventions), so a capture stays readable. Decoders reject an unknown
// magic, version or type and any malformed field with an error that names
// the frame, and never panic.
const (
	// ControlMagic is frame 0 of every control message.
	ControlMagic = "KVXFER"
	// ControlVersion is the protocol version in frame 1. Version 2 added the
	// segment epoch (REGISTER, TRANSFER, ABORT, STATUS, HANDSHAKE,
	// HANDSHAKE_ACK), the token count (TRANSFER) and ABORT_ACK. Version 3:
	// caller-owned buffers: REGISTER carries the decode's Geometry
	// (per-buffer item lengths) and one region per buffer, REGISTER_ACK
	// answers with the prefill's, TRANSFER carries the aux index, state
	// indices and decode prefix. Version 4: every message ends with the
	// sender envelope (instance id, epoch, send time, HMAC tag; envelope.go).
	// Version 5: the envelope carries the sender's frame sequence number
	// (replay protection of authenticated frames; replay.go). Version 6: the
	// metadata record's bytes 44–47 carry layer_count (engine/ring.go) and
	// flag bit 1 marks a room sent layer by layer, so a decode of version 5
	// (which refuses non-zero bytes 44–47) and a producer of version 6 never
	// pair. Version 7: TRANSFER, ABORT and ABORT_ACK end with the attempt
	// frame (TransferMsg.Attempt), so a prefill tells a retry of a room from
	// a late frame of an attempt that was concluded, whatever order a ZeroMQ
	// reconnect delivers them in. Version 8: VERDICT_ACK (verdictack.go),
	// the producer's acknowledgement of a decode's Success verdict, which a
	// closing decode waits for (and re-sends the verdict until it comes).
	ControlVersion = 8
)

// Control message types (frame 2).
const (
	MsgRegister     = "REGISTER"
	MsgRegisterAck  = "REGISTER_ACK"
	MsgTransfer     = "TRANSFER"
	MsgAbort        = "ABORT"
	MsgAbortAck     = "ABORT_ACK"
	MsgStatus       = "STATUS"
	MsgHandshake    = "HANDSHAKE"
	MsgHandshakeAck = "HANDSHAKE_ACK"
	MsgPing         = "PING"
)

// Decoder limits: anything larger is rejected as malformed.
const (
	maxPages       = 1 << 24
	maxBuffers     = kvargs.MaxBuffers
	maxTransports  = 8
	maxRegions     = 3*maxBuffers + 1
	maxKeyBytes    = 1 << 16
	maxStringBytes = 4096
)

// MaxBlobBytes bounds a transport endpoint or handshake blob in a frame
// (1 MiB); the segment RPC applies the same bound to its reply blobs.
const MaxBlobBytes = 1 << 20

// STATUS states: the first and the last KVPoll value (SGLang's numbering,
// engine.KVPoll) that StatusMsg.State carries.
const (
	StatusFailed  = 0 // KVPoll Failed
	StatusSuccess = 4 // KVPoll Success
)

// ErrBadFrame is wrapped by every control-frame decoding error.
var ErrBadFrame = errors.New("engine: malformed control frame")

func badFrame(msg string, idx int, format string, a ...any) error {
	return fmt.Errorf("%w: %s frame %d: %s", ErrBadFrame, msg, idx, fmt.Sprintf(format, a...))
}

// Geometry frames (16, in REGISTER and REGISTER_ACK; see Geometry):
//
//	tp_rank, tp_size, pp_rank, pp_size, start_layer, end_layer, mla (0/1),
//	page_size (tokens), kv_head_num, total_kv_head_num (ASCII decimals), then
//	packed u64 lists: kv_item_lens, kv_items (pages per buffer),
//	aux_item_lens, aux_items (rows), state_item_lens, state_items (slots).
const geometryFrames = 16

// RegisterMsg (decode → prefill, once per connection): the decode rank's KV
// arguments, as SGLang's KV-args registration (spec §5.2.1) carries them,
// with one region ID and item length per buffer.
//
//	3 endpoint        decode control endpoint "tcp://ip:port" (its session id)
//	4–19 geometry     the decode's Geometry (16 frames, see geometryFrames)
//	20 ring_slots
//	21 epoch          segment epoch (>= 1) of this registration: the data path
//	                  the prefill opens for it carries it (SegmentInfo.Epoch),
//	                  and so do TRANSFER, the metadata record and ABORT_ACK
//	22 transport count n, then per transport 3 frames:
//	   name, endpoint blob, region table (packed: u32 count, then per region
//	   u32 id, u64 addr, u64 length, u8 kind, u32 key length, key bytes);
//	   region 0 is the metadata ring, then one per KV buffer, one per aux
//	   buffer and one per state buffer, in KVArgs order.
type RegisterMsg struct {
	Endpoint  string
	Geometry  kvargs.Geometry
	RingSlots int
	// Epoch is the segment epoch of this registration (>= 1). A decode
	// registers again, with a new epoch, after it fenced the previous data
	// path to this prefill rank.
	Epoch      uint64
	Transports []TransportOffer
}

// RegisterAckMsg (prefill → decode, answering REGISTER): whether the prefill
// accepts the decode's KV arguments, and its own geometry, so the decode can
// pair buffers and check records exactly as the prefill writes them.
//
//	3 prefill endpoint   4 refusal ("" = accepted; else why, naming both sides)
//	5–20 geometry        the prefill's Geometry
//	21 epoch             the REGISTER's epoch, echoed
type RegisterAckMsg struct {
	Endpoint string
	Err      string
	Geometry kvargs.Geometry
	Epoch    uint64
}

// TransportOffer is one transport a decode rank opened: its name, its
// endpoint blob (Transport.Endpoint) and its registered regions: the
// metadata ring and one region per KV, aux and state buffer.
type TransportOffer struct {
	Name     string
	Endpoint []byte
	Ring     transport.RegionDesc
	KV       []transport.RegionDesc
	Aux      []transport.RegionDesc
	State    []transport.RegionDesc
}

// Regions is the offer's region table in wire order: Ring, KV, Aux, State.
func (t TransportOffer) Regions() []transport.RegionDesc {
	out := make([]transport.RegionDesc, 0, 1+len(t.KV)+len(t.Aux)+len(t.State))
	out = append(out, t.Ring)
	out = append(out, t.KV...)
	out = append(out, t.Aux...)
	return append(out, t.State...)
}

// TransferMsg (decode → prefill, per request and per producer; spec §5.2.2):
//
//	3 room   4 decode endpoint
//	5 destination page indices, packed int32 ("" for a dummy producer)
//	6 metadata ring slot ("" for a dummy)   7 slot generation
//	8 required_dst_info_num   9 checksum wanted (0/1)
//	10 epoch: the registration's segment epoch (RegisterMsg.Epoch)
//	11 tokens: the request's token count as the decode knows it (0 = not
//	   declared); a producer that declared another count fails the room
//	12 aux index: the decode's aux row this producer writes ("" = none)
//	13 state indices, packed int32 ("" = none)
//	14 decode_prefix_len: prompt tokens the decode already holds (whole
//	   pages); Pages are those of the tokens after them
//	15 attempt: the decode's attempt of the room (>= 1; see Attempt)
type TransferMsg struct {
	Room               uint64
	Endpoint           string
	Pages              []int32
	Dummy              bool
	Slot               int
	Generation         uint64
	RequiredDstInfoNum int
	Checksum           bool
	Epoch              uint64
	Tokens             int
	// AuxIndex is the decode's aux row, or -1 when this producer writes none.
	AuxIndex int
	// StateIndices are the decode's state slots (nil: none).
	StateIndices []int32
	// PrefixTokens is SGLang's decode_prefix_len.
	PrefixTokens int
	// Attempt names this receiver of the room on the decode (>= 1): a
	// decode manager numbers its receivers from a random start, one
	// number per NewReceiver, so two attempts of one bootstrap_room on one
	// decode (a router's retry) never share one, and a later attempt has
	// the larger number. ABORT and ABORT_ACK carry it back, so a frame of
	// a concluded attempt is never taken for a retry's (protocol 7).
	Attempt uint64
}

// AbortMsg (either direction): 3 room, 4 sender endpoint, 5 reason, 6 epoch
// (decode → prefill: the registration epoch the room used, 0 when unknown;
// prefill → decode: 0), 7 attempt (decode → prefill: the attempt that
// failed, TransferMsg.Attempt; 0 when the sender names none). From a decode
// it means: that attempt of the room failed here, stop writing and answer
// ABORT_ACK after your last write.
type AbortMsg struct {
	Room     uint64
	Endpoint string
	Reason   string
	Epoch    uint64
	Attempt  uint64
}

// AbortAckMsg (prefill → decode): the producer will write nothing more for
// the room. 3 room, 4 prefill endpoint, 5 producer rank, 6 epoch of the
// data path it wrote through (0 when it never had one), 7 clean (1: every
// transfer batch of the room ended while the data path was healthy, so no
// byte is still on its way; 0: a batch was abandoned or the data path broke,
// and the decode must fence the epoch before reusing the room's pages),
// 8 detail text, 9 attempt: the decode attempt acknowledged (the ABORT's or
// the TRANSFER's Attempt; 0 when none is known), so a late acknowledgement
// of an earlier attempt of the room does not fence the current one.
type AbortAckMsg struct {
	Room     uint64
	Endpoint string
	Producer int
	Epoch    uint64
	Clean    bool
	Detail   string
	Attempt  uint64
}

// StatusMsg: 3 room, 4 KVPoll state (ASCII decimal, StatusFailed … StatusSuccess), 5 rank, 6 sender
// endpoint, 7 failure reason ("" on Success), 8 epoch.
//
// Prefill → decode (spec §5.2.3): the producer's outcome; 5 is the producer
// rank, 8 the data-path epoch it wrote through. Success means every page and
// the metadata record landed. StatusWaitingForInput answers SUBSCRIBE: the
// producer computed the request (subscribe.go).
//
// Decode → prefill: the decode's verdict, sent once it verified the room
// (Success; a failure is sent as ABORT); 5 is the decode's TP rank, 8 the
// registration epoch. A prefill reports Success only after this verdict, so
// both sides report the same outcome.
type StatusMsg struct {
	Room uint64
	// State is the sender's KVPoll value in SGLang's numbering (engine.KVPoll):
	// StatusFailed (0) … StatusSuccess (4).
	State    int
	Producer int
	Endpoint string
	Reason   string
	Epoch    uint64
}

// HandshakeMsg (prefill → decode, transports with CapHandshake): 3 prefill
// endpoint, 4 transport name, 5 Segment.HandshakeReply blob, 6 epoch of the
// registration the segment was opened for. The decode feeds it to the
// transport's Acceptor.Accept (only for its current epoch with that prefill)
// and answers HANDSHAKE_ACK.
type HandshakeMsg struct {
	Endpoint  string
	Transport string
	Reply     []byte
	Epoch     uint64
}

// HandshakeAckMsg (decode → prefill): 3 decode endpoint, 4 transport name,
// 5 error text ("" when Accept succeeded), 6 epoch (echoed from HANDSHAKE).
type HandshakeAckMsg struct {
	Endpoint  string
	Transport string
	Err       string
	Epoch     uint64
}

// PingMsg (either direction, every heartbeat interval): 3 sender endpoint.
// A peer silent for the peer timeout fails the rooms that wait on it.
type PingMsg struct {
	Endpoint string
}

func header(typ string) [][]byte {
	return [][]byte{[]byte(ControlMagic), []byte(strconv.Itoa(ControlVersion)), []byte(typ)}
}

// Dec is v as an ASCII decimal frame (the wire form of every scalar).
func Dec(v uint64) []byte { return strconv.AppendUint(nil, v, 10) }

func deci(v int) []byte { return strconv.AppendInt(nil, int64(v), 10) }
func b01(v bool) []byte {
	if v {
		return []byte("1")
	}
	return []byte("0")
}

func encodeGeometry(f [][]byte, g *kvargs.Geometry) [][]byte {
	return append(f, deci(g.TPRank), deci(g.TPSize), deci(g.PPRank), deci(g.PPSize), deci(g.StartLayer), deci(g.EndLayer), b01(g.MLA),
		deci(g.PageSize), deci(g.KVHeadNum), deci(g.TotalKVHeadNum), packU64(g.KVItemLens), packU64(g.KVItems),
		packU64(g.AuxItemLens), packU64(g.AuxItems), packU64(g.StateItemLens), packU64(g.StateItems))
}

// Encode returns the message's frames.
func (m *RegisterMsg) Encode() [][]byte {
	f := append(header(MsgRegister), []byte(m.Endpoint))
	f = encodeGeometry(f, &m.Geometry)
	f = append(f, deci(m.RingSlots), Dec(m.Epoch), deci(len(m.Transports)))
	for _, t := range m.Transports {
		f = append(f, []byte(t.Name), t.Endpoint, packRegions(t.Regions()))
	}
	return f
}

// Encode returns the message's frames.
func (m *RegisterAckMsg) Encode() [][]byte {
	f := append(header(MsgRegisterAck), []byte(m.Endpoint), []byte(m.Err))
	return append(encodeGeometry(f, &m.Geometry), Dec(m.Epoch))
}

// Encode returns the message's frames.
func (m *TransferMsg) Encode() [][]byte {
	f := header(MsgTransfer)
	pages, slot, aux, state := packI32(m.Pages), deci(m.Slot), []byte{}, packI32(m.StateIndices)
	if m.AuxIndex >= 0 {
		aux = deci(m.AuxIndex)
	}
	if m.Dummy {
		pages, slot, aux, state = []byte{}, []byte{}, []byte{}, []byte{}
	}
	return append(f, Dec(m.Room), []byte(m.Endpoint), pages, slot, Dec(m.Generation), deci(m.RequiredDstInfoNum), b01(m.Checksum),
		Dec(m.Epoch), deci(m.Tokens), aux, state, deci(m.PrefixTokens), Dec(m.Attempt))
}

// Encode returns the message's frames.
func (m *AbortMsg) Encode() [][]byte {
	return append(header(MsgAbort), Dec(m.Room), []byte(m.Endpoint), []byte(m.Reason), Dec(m.Epoch), Dec(m.Attempt))
}

// Encode returns the message's frames.
func (m *AbortAckMsg) Encode() [][]byte {
	return append(header(MsgAbortAck), Dec(m.Room), []byte(m.Endpoint), deci(m.Producer), Dec(m.Epoch), b01(m.Clean), []byte(m.Detail), Dec(m.Attempt))
}

// Encode returns the message's frames.
func (m *StatusMsg) Encode() [][]byte {
	return append(header(MsgStatus), Dec(m.Room), deci(int(m.State)), deci(m.Producer), []byte(m.Endpoint), []byte(m.Reason), Dec(m.Epoch))
}

// Encode returns the message's frames.
func (m *HandshakeMsg) Encode() [][]byte {
	return append(header(MsgHandshake), []byte(m.Endpoint), []byte(m.Transport), m.Reply, Dec(m.Epoch))
}

// Encode returns the message's frames.
func (m *HandshakeAckMsg) Encode() [][]byte {
	return append(header(MsgHandshakeAck), []byte(m.Endpoint), []byte(m.Transport), []byte(m.Err), Dec(m.Epoch))
}

// Encode returns the message's frames.
func (m *PingMsg) Encode() [][]byte {
	return append(header(MsgPing), []byte(m.Endpoint))
}

// controlType checks frames 0–1 (magic, version) and returns the message type
// in frame 2. Errors wrap ErrBadFrame and say what was found.
func controlType(parts [][]byte) (string, error) {
	if len(parts) < 3 {
		return "", fmt.Errorf("%w: %d frames, want at least 3 (magic, version, type)", ErrBadFrame, len(parts))
	}
	if string(parts[0]) != ControlMagic {
		return "", fmt.Errorf("%w: frame 0 is %q, want magic %q (not a kvxfer peer?)", ErrBadFrame, Trunc(parts[0]), ControlMagic)
	}
	if string(parts[1]) != strconv.Itoa(ControlVersion) {
		return "", fmt.Errorf("%w: protocol version %q not supported (this build speaks %d; upgrade the older side)", ErrBadFrame, Trunc(parts[1]), ControlVersion)
	}
	switch t := string(parts[2]); t {
	case MsgRegister, MsgRegisterAck, MsgTransfer, MsgAbort, MsgAbortAck, MsgStatus, MsgHandshake, MsgHandshakeAck, MsgPing, MsgProbe, MsgProbeResult, MsgSubscribe, MsgVersion, MsgVerdictAck:
		return t, nil
	}
	return "", fmt.Errorf("%w: unknown message type %q", ErrBadFrame, Trunc(parts[2]))
}

// Trunc is b as text for an error message, cut to 32 bytes and an ellipsis
// (a frame from outside may be long or binary).
func Trunc(b []byte) string {
	if len(b) > 32 {
		return string(b[:32]) + "…"
	}
	return string(b)
}

// DecodeControl decodes any control message; it returns one of *RegisterMsg,
// *RegisterAckMsg, *TransferMsg, *AbortMsg, *AbortAckMsg, *StatusMsg, *HandshakeMsg,
// *HandshakeAckMsg, *PingMsg, *ProbeMsg, *ProbeResultMsg, *SubscribeMsg, *VersionMsg, *VerdictAckMsg. Errors wrap ErrBadFrame.
func DecodeControl(parts [][]byte) (any, error) {
	t, err := controlType(parts)
	if err != nil {
		return nil, err
	}
	switch t {
	case MsgRegister:
		return DecodeRegister(parts)
	case MsgRegisterAck:
		return DecodeRegisterAck(parts)
	case MsgTransfer:
		return DecodeTransfer(parts)
	case MsgAbort:
		return DecodeAbort(parts)
	case MsgAbortAck:
		return DecodeAbortAck(parts)
	case MsgStatus:
		return DecodeStatus(parts)
	case MsgHandshake:
		return DecodeHandshake(parts)
	case MsgHandshakeAck:
		return DecodeHandshakeAck(parts)
	case MsgProbe:
		return DecodeProbe(parts)
	case MsgProbeResult:
		return DecodeProbeResult(parts)
	case MsgSubscribe:
		return DecodeSubscribe(parts)
	case MsgVersion:
		return DecodeVersion(parts)
	case MsgVerdictAck:
		return DecodeVerdictAck(parts)
	default:
		return DecodePing(parts)
	}
}

// FrameReader walks a message's frames, recording the first error: each
// read after a failure returns the zero value, and Err is the first
// failure, wrapping ErrBadFrame and naming Msg and the frame index.
type FrameReader struct {
	// Msg names the message in errors ("TRANSFER", "segment RPC reply").
	Msg string
	// Parts are the frames read.
	Parts [][]byte
	// Err is the first failure (nil while every read succeeded).
	Err error
}

func newReader(parts [][]byte, typ string, minFrames int, exact bool) (*FrameReader, error) {
	t, err := controlType(parts)
	if err != nil {
		return nil, err
	}
	if t != typ {
		return nil, fmt.Errorf("%w: message type %s, want %s", ErrBadFrame, t, typ)
	}
	if len(parts) < minFrames || (exact && len(parts) != minFrames) {
		return nil, fmt.Errorf("%w: %s has %d frames, want %d", ErrBadFrame, typ, len(parts), minFrames)
	}
	return &FrameReader{Msg: typ, Parts: parts}, nil
}

// Fail records a failure of frame i (format and a describe it) unless one
// is recorded already.
func (r *FrameReader) Fail(i int, format string, a ...any) {
	if r.Err == nil {
		r.Err = badFrame(r.Msg, i, format, a...)
	}
}

// Uint reads frame i as an ASCII decimal in [0, max]; name says what it is
// in the error.
func (r *FrameReader) Uint(i int, max uint64, name string) uint64 {
	s := r.Parts[i]
	if len(s) == 0 || len(s) > 20 {
		r.Fail(i, "%s: want an ASCII decimal, got %q", name, Trunc(s))
		return 0
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			r.Fail(i, "%s: want an ASCII decimal, got %q", name, Trunc(s))
			return 0
		}
	}
	v, err := strconv.ParseUint(string(s), 10, 64)
	if err != nil || v > max {
		r.Fail(i, "%s: %q out of range [0, %d]", name, Trunc(s), max)
		return 0
	}
	return v
}

func (r *FrameReader) int(i, max int, name string) int { return int(r.Uint(i, uint64(max), name)) }

func (r *FrameReader) bool(i int, name string) bool { return r.Uint(i, 1, name) == 1 }

// Str reads frame i as a string of at most 4096 bytes.
func (r *FrameReader) Str(i int, name string) string {
	if len(r.Parts[i]) > maxStringBytes {
		r.Fail(i, "%s: %d bytes, longer than %d", name, len(r.Parts[i]), maxStringBytes)
		return ""
	}
	return string(r.Parts[i])
}

func (r *FrameReader) endpoint(i int) string {
	s := r.Str(i, "endpoint")
	if r.Err == nil && s == "" {
		r.Fail(i, "endpoint is empty")
	}
	return s
}

// MaxRoom bounds a bootstrap_room on the wire (SGLang's rooms are
// non-negative 63-bit integers).
const MaxRoom = 1<<63 - 1

// maxEpoch bounds a segment epoch on the wire; MaxTokens a token count;
// MaxAttempt a decode attempt (TransferMsg.Attempt).
const (
	maxEpoch   = 1<<63 - 1
	MaxTokens  = 1<<31 - 1
	MaxAttempt = 1<<63 - 1
)

// geometry reads the 16 geometry frames starting at frame i and checks them:
// ranks inside their sizes, a non-empty layer range, a positive page size,
// positive head counts or, on a non-MLA rank that states none (SGLang's
// decode), both 0 (kvargs.Geometry.HeadsUnknown), one KV item length and
// count per buffer of the layer range, and non-zero item lengths and counts
// everywhere.
func (r *FrameReader) geometry(i int) kvargs.Geometry {
	g := kvargs.Geometry{
		TPRank:         r.int(i, 1<<16, "tp_rank"),
		TPSize:         r.int(i+1, 1<<16, "tp_size"),
		PPRank:         r.int(i+2, 1<<16, "pp_rank"),
		PPSize:         r.int(i+3, 1<<16, "pp_size"),
		StartLayer:     r.int(i+4, 1<<16, "start_layer"),
		EndLayer:       r.int(i+5, 1<<16, "end_layer"),
		MLA:            r.bool(i+6, "mla"),
		PageSize:       r.int(i+7, 1<<20, "page_size"),
		KVHeadNum:      r.int(i+8, 1<<16, "kv_head_num"),
		TotalKVHeadNum: r.int(i+9, 1<<16, "total_kv_head_num"),
	}
	lists := []*[]uint64{&g.KVItemLens, &g.KVItems, &g.AuxItemLens, &g.AuxItems, &g.StateItemLens, &g.StateItems}
	names := []string{"kv_item_lens", "kv_items", "aux_item_lens", "aux_items", "state_item_lens", "state_items"}
	for k, l := range lists {
		vs, err := unpackU64(r.Parts[i+10+k], maxBuffers)
		if err != nil {
			r.Fail(i+10+k, "%s: %v", names[k], err)
			return g
		}
		for _, v := range vs {
			if v == 0 || v > 1<<46 {
				r.Fail(i+10+k, "%s: entry %d out of range [1, 2^46]", names[k], v)
				return g
			}
		}
		if len(vs) > 0 {
			*l = vs
		}
	}
	if r.Err != nil {
		return g
	}
	want := g.EndLayer - g.StartLayer
	if !g.MLA {
		want *= 2
	}
	switch {
	case g.TPSize == 0 || g.TPRank >= g.TPSize:
		r.Fail(i, "tp_rank %d not in [0, tp_size %d)", g.TPRank, g.TPSize)
	case g.PPSize == 0 || g.PPRank >= g.PPSize:
		r.Fail(i+2, "pp_rank %d not in [0, pp_size %d)", g.PPRank, g.PPSize)
	case g.StartLayer >= g.EndLayer:
		r.Fail(i+4, "layers [%d, %d) are empty", g.StartLayer, g.EndLayer)
	case g.PageSize == 0:
		r.Fail(i+7, "page_size must be > 0")
	case (g.KVHeadNum == 0) != (g.TotalKVHeadNum == 0):
		r.Fail(i+8, "kv_head_num %d and total_kv_head_num %d: both > 0, or both 0 for a rank that states no head counts", g.KVHeadNum, g.TotalKVHeadNum)
	case g.MLA && g.KVHeadNum == 0:
		r.Fail(i+8, "kv_head_num 0 on an MLA rank (MLA keeps one latent row per token: 1)")
	case len(g.KVItemLens) != want || len(g.KVItems) != want:
		r.Fail(i+10, "%d KV item lengths and %d counts, want %d each for layers [%d, %d) (mla %v)", len(g.KVItemLens), len(g.KVItems), want, g.StartLayer, g.EndLayer, g.MLA)
	case len(g.AuxItemLens) != len(g.AuxItems):
		r.Fail(i+12, "%d aux item lengths but %d row counts", len(g.AuxItemLens), len(g.AuxItems))
	case len(g.StateItemLens) != len(g.StateItems):
		r.Fail(i+14, "%d state item lengths but %d slot counts", len(g.StateItemLens), len(g.StateItems))
	}
	return g
}

// DecodeRegister decodes a REGISTER message. Errors wrap ErrBadFrame.
func DecodeRegister(parts [][]byte) (*RegisterMsg, error) {
	const fixed = 4 + geometryFrames + 3 // header, endpoint, geometry, ring_slots, epoch, transport count
	r, err := newReader(parts, MsgRegister, fixed, false)
	if err != nil {
		return nil, err
	}
	m := &RegisterMsg{Endpoint: r.endpoint(3), Geometry: r.geometry(4)}
	m.RingSlots = r.int(fixed-3, 1<<20, "ring_slots")
	m.Epoch = r.Uint(fixed-2, maxEpoch, "epoch")
	n := r.int(fixed-1, maxTransports, "transport count")
	switch {
	case r.Err != nil:
	case m.RingSlots == 0:
		r.Fail(fixed-3, "ring_slots must be > 0")
	case m.Epoch == 0:
		r.Fail(fixed-2, "epoch must be >= 1")
	case len(parts) != fixed+3*n:
		r.Fail(fixed-1, "%d transports need %d frames, message has %d", n, fixed+3*n, len(parts))
	}
	if r.Err != nil {
		return nil, r.Err
	}
	g := &m.Geometry
	nkv, naux, nst := len(g.KVItemLens), len(g.AuxItemLens), len(g.StateItemLens)
	for k := 0; k < n; k++ {
		i := fixed + 3*k
		name := r.Str(i, "transport name")
		if len(parts[i+1]) > MaxBlobBytes {
			r.Fail(i+1, "endpoint blob of %d bytes, longer than %d", len(parts[i+1]), MaxBlobBytes)
		}
		regs, err := unpackRegions(parts[i+2])
		if err != nil {
			r.Fail(i+2, "region table: %v", err)
		} else if len(regs) != 1+nkv+naux+nst {
			r.Fail(i+2, "region table has %d regions, want %d (metadata ring, %d KV, %d aux, %d state buffers)", len(regs), 1+nkv+naux+nst, nkv, naux, nst)
		}
		if name == "" {
			r.Fail(i, "transport name is empty")
		}
		if r.Err != nil {
			return nil, r.Err
		}
		m.Transports = append(m.Transports, TransportOffer{Name: name, Endpoint: append([]byte(nil), parts[i+1]...), Ring: regs[0],
			KV: regs[1 : 1+nkv], Aux: regs[1+nkv : 1+nkv+naux], State: regs[1+nkv+naux:]})
	}
	return m, nil
}

// DecodeRegisterAck decodes a REGISTER_ACK message. Errors wrap ErrBadFrame.
func DecodeRegisterAck(parts [][]byte) (*RegisterAckMsg, error) {
	r, err := newReader(parts, MsgRegisterAck, 6+geometryFrames, true)
	if err != nil {
		return nil, err
	}
	m := &RegisterAckMsg{Endpoint: r.endpoint(3), Err: r.Str(4, "refusal"), Geometry: r.geometry(5)}
	m.Epoch = r.Uint(5+geometryFrames, maxEpoch, "epoch")
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// Frames of TRANSFER, ABORT and ABORT_ACK, header included (protocol 7:
// each ends with the attempt frame; protocol 6 had one frame fewer).
const (
	transferFrames = 16
	abortFrames    = 8
	abortAckFrames = 10
)

// DecodeTransfer decodes a TRANSFER message. Errors wrap ErrBadFrame.
func DecodeTransfer(parts [][]byte) (*TransferMsg, error) {
	r, err := newReader(parts, MsgTransfer, transferFrames, true)
	if err != nil {
		return nil, err
	}
	m := &TransferMsg{
		Room:               r.Uint(3, MaxRoom, "room"),
		Endpoint:           r.endpoint(4),
		Generation:         r.Uint(7, 1<<63, "generation"),
		RequiredDstInfoNum: r.int(8, 1<<16, "required_dst_info_num"),
		Checksum:           r.bool(9, "checksum"),
		Epoch:              r.Uint(10, maxEpoch, "epoch"),
		Tokens:             r.int(11, MaxTokens, "tokens"),
		AuxIndex:           -1,
		PrefixTokens:       r.int(14, MaxTokens, "decode_prefix_len"),
		Attempt:            r.Uint(15, MaxAttempt, "attempt"),
	}
	if r.Err == nil && m.RequiredDstInfoNum == 0 {
		r.Fail(8, "required_dst_info_num must be >= 1")
	}
	if r.Err == nil && m.Epoch == 0 {
		r.Fail(10, "epoch must be >= 1")
	}
	if r.Err == nil && m.Attempt == 0 {
		r.Fail(15, "attempt must be >= 1")
	}
	if len(parts[5]) == 0 && len(parts[6]) == 0 {
		m.Dummy = true
	} else {
		m.Slot = r.int(6, 1<<20, "slot")
		pages, err := unpackI32(parts[5], maxPages)
		if err != nil {
			r.Fail(5, "pages: %v", err)
		}
		for _, p := range pages {
			if p < 0 {
				r.Fail(5, "page index %d is negative", p)
				break
			}
		}
		m.Pages = pages
		if len(parts[12]) > 0 {
			m.AuxIndex = r.int(12, 1<<31-1, "aux index")
		}
		st, err := unpackI32(parts[13], maxPages)
		if err != nil {
			r.Fail(13, "state indices: %v", err)
		}
		for _, p := range st {
			if p < 0 {
				r.Fail(13, "state index %d is negative", p)
				break
			}
		}
		if len(st) > 0 {
			m.StateIndices = st
		}
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodeAbort decodes an ABORT message. Errors wrap ErrBadFrame.
func DecodeAbort(parts [][]byte) (*AbortMsg, error) {
	r, err := newReader(parts, MsgAbort, abortFrames, true)
	if err != nil {
		return nil, err
	}
	m := &AbortMsg{Room: r.Uint(3, MaxRoom, "room"), Endpoint: r.endpoint(4), Reason: r.Str(5, "reason"), Epoch: r.Uint(6, maxEpoch, "epoch"),
		Attempt: r.Uint(7, MaxAttempt, "attempt")}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodeAbortAck decodes an ABORT_ACK message. Errors wrap ErrBadFrame.
func DecodeAbortAck(parts [][]byte) (*AbortAckMsg, error) {
	r, err := newReader(parts, MsgAbortAck, abortAckFrames, true)
	if err != nil {
		return nil, err
	}
	m := &AbortAckMsg{Room: r.Uint(3, MaxRoom, "room"), Endpoint: r.endpoint(4), Producer: r.int(5, 1<<30, "producer rank"),
		Epoch: r.Uint(6, maxEpoch, "epoch"), Clean: r.bool(7, "clean"), Detail: r.Str(8, "detail"), Attempt: r.Uint(9, MaxAttempt, "attempt")}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodeStatus decodes a STATUS message. Errors wrap ErrBadFrame.
func DecodeStatus(parts [][]byte) (*StatusMsg, error) {
	r, err := newReader(parts, MsgStatus, 9, true)
	if err != nil {
		return nil, err
	}
	m := &StatusMsg{
		Room:     r.Uint(3, MaxRoom, "room"),
		State:    r.int(4, StatusSuccess, "state"),
		Producer: r.int(5, 1<<30, "producer rank"),
		Endpoint: r.endpoint(6),
		Reason:   r.Str(7, "reason"),
		Epoch:    r.Uint(8, maxEpoch, "epoch"),
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodeHandshake decodes a HANDSHAKE message. Errors wrap ErrBadFrame.
func DecodeHandshake(parts [][]byte) (*HandshakeMsg, error) {
	r, err := newReader(parts, MsgHandshake, 7, true)
	if err != nil {
		return nil, err
	}
	m := &HandshakeMsg{Endpoint: r.endpoint(3), Transport: r.Str(4, "transport"), Epoch: r.Uint(6, maxEpoch, "epoch")}
	if len(parts[5]) > MaxBlobBytes {
		r.Fail(5, "reply blob of %d bytes, longer than %d", len(parts[5]), MaxBlobBytes)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	m.Reply = append([]byte(nil), parts[5]...)
	return m, nil
}

// DecodeHandshakeAck decodes a HANDSHAKE_ACK message. Errors wrap ErrBadFrame.
func DecodeHandshakeAck(parts [][]byte) (*HandshakeAckMsg, error) {
	r, err := newReader(parts, MsgHandshakeAck, 7, true)
	if err != nil {
		return nil, err
	}
	m := &HandshakeAckMsg{Endpoint: r.endpoint(3), Transport: r.Str(4, "transport"), Err: r.Str(5, "error"), Epoch: r.Uint(6, maxEpoch, "epoch")}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodePing decodes a PING message. Errors wrap ErrBadFrame.
func DecodePing(parts [][]byte) (*PingMsg, error) {
	r, err := newReader(parts, MsgPing, 4, true)
	if err != nil {
		return nil, err
	}
	m := &PingMsg{Endpoint: r.endpoint(3)}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// packU64 packs vs as little-endian u64s.
func packU64(vs []uint64) []byte {
	b := make([]byte, 8*len(vs))
	for i, v := range vs {
		binary.LittleEndian.PutUint64(b[8*i:], v)
	}
	return b
}

// unpackU64 parses little-endian u64s; len(b) must be a multiple of 8 and
// the count at most max.
func unpackU64(b []byte, max int) ([]uint64, error) {
	if len(b)%8 != 0 || len(b)/8 > max {
		return nil, fmt.Errorf("%d bytes is not a whole number (at most %d) of 8-byte integers", len(b), max)
	}
	vs := make([]uint64, len(b)/8)
	for i := range vs {
		vs[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return vs, nil
}

// packI32 packs vs as little-endian int32s (SGLang's page-index arrays).
func packI32(vs []int32) []byte {
	b := make([]byte, 4*len(vs))
	for i, v := range vs {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	return b
}

// unpackI32 parses little-endian int32s; len(b) must be a multiple of 4 and
// the count at most max.
func unpackI32(b []byte, max int) ([]int32, error) {
	if len(b)%4 != 0 || len(b)/4 > max {
		return nil, fmt.Errorf("%d bytes is not a whole number (at most %d) of 4-byte integers", len(b), max)
	}
	vs := make([]int32, len(b)/4)
	for i := range vs {
		vs[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return vs, nil
}

// packRegions encodes a region table: u32 count, then per region u32 id,
// u64 addr, u64 length, u8 kind, u32 key length and the key, little-endian.
func packRegions(rs []transport.RegionDesc) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(len(rs)))
	for _, r := range rs {
		b = binary.LittleEndian.AppendUint32(b, uint32(r.ID))
		b = binary.LittleEndian.AppendUint64(b, r.Addr)
		b = binary.LittleEndian.AppendUint64(b, r.Length)
		b = append(b, byte(r.Kind))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(r.Key)))
		b = append(b, r.Key...)
	}
	return b
}

// unpackRegions decodes packRegions' encoding; errors say which region and
// field is short or invalid.
func unpackRegions(b []byte) ([]transport.RegionDesc, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("%d bytes, too short for the region count", len(b))
	}
	if len(b) > MaxRegionTableBytes {
		return nil, fmt.Errorf("%d bytes, more than %d", len(b), MaxRegionTableBytes)
	}
	n := binary.LittleEndian.Uint32(b)
	if n > maxRegions {
		return nil, fmt.Errorf("%d regions, more than %d", n, maxRegions)
	}
	b = b[4:]
	out := make([]transport.RegionDesc, 0, n)
	for i := uint32(0); i < n; i++ {
		if len(b) < 25 {
			return nil, fmt.Errorf("region %d: %d bytes left, want 25", i, len(b))
		}
		r := transport.RegionDesc{
			ID:     transport.RegionID(binary.LittleEndian.Uint32(b)),
			Addr:   binary.LittleEndian.Uint64(b[4:]),
			Length: binary.LittleEndian.Uint64(b[12:]),
			Kind:   transport.MemoryKind(b[20]),
		}
		if r.Kind > transport.MemoryCUDA {
			return nil, fmt.Errorf("region %d: unknown memory kind %d", i, b[20])
		}
		kl := binary.LittleEndian.Uint32(b[21:])
		b = b[25:]
		if kl > maxKeyBytes || uint64(kl) > uint64(len(b)) {
			return nil, fmt.Errorf("region %d: key of %d bytes, %d left", i, kl, len(b))
		}
		if kl > 0 {
			r.Key = append([]byte(nil), b[:kl]...)
		}
		b = b[kl:]
		out = append(out, r)
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%d trailing bytes after %d regions", len(b), n)
	}
	return out, nil
}
