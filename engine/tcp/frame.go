package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
)

// Wire format of one data connection (all integers little-endian). It is our
// own format, versioned by the hello; nothing here comes from another project.
//
//	sender → receiver, once:   hello  (24 bytes)
//	sender → receiver, repeat: header (48 bytes) [+ scatter table] + payload
//	receiver → sender, repeat: ack    (24 bytes) + MsgLen bytes of UTF-8 text
//
// Hello:
//
//	0  [8]byte "KVXFTCP\x00"
//	8  u16     protocol version (3; version 1 had no scatter frames, 2 no epoch)
//	10 u16     stream index (informational)
//	12 u32     reserved, 0
//	16 u64     segment epoch (transport.SegmentInfo.Epoch; 0 = none): every
//	           write on the connection belongs to it, and the receiver
//	           refuses the connection unless the epoch is admitted
//	           (Transport.AdmitEpoch) and not fenced
//
// Data-frame header, kind 1 (write: one WriteRequest chunk; a strided
// request is ONE header followed by its Count blocks back to back):
//
//	0  u32 magic 0x5758564B ("KVXW")
//	4  u8  kind (1 = write)
//	5  u8  flags (0)
//	6  u16 reserved (0)
//	8  u64 seq: per-connection sequence number, echoed in the ack
//	16 u32 remote region ID
//	20 u32 block count (>= 1)
//	24 u64 offset of block 0 in the region, bytes
//	32 u64 block length, bytes
//	40 u64 remote stride between block starts, bytes (0 when count == 1)
//
// Data-frame header, kind 2 (scatter: many small contiguous writes of one
// transfer batch, possibly to several regions, in one frame):
//
//	0  u32 magic 0x5758564B ("KVXW")
//	4  u8  kind (2 = scatter)
//	5  u8  flags (0)
//	6  u16 reserved (0)
//	8  u64 seq
//	16 u32 reserved (0)
//	20 u32 entry count n (1..maxScatterEntries)
//	24 u64 total payload bytes (the sum of the entry lengths)
//	32 u64 reserved (0)
//	40 u64 reserved (0)
//
// followed by the scatter table, n entries of 16 bytes:
//
//	0  u32 remote region ID
//	4  u32 length, bytes (>= 1)
//	8  u64 offset in the region, bytes
//
// and then the n payloads back to back, in table order. The receiver reads
// the table, checks every entry (region registered, range inside it) before
// any byte lands, and reads the payload with vectored reads straight into
// the destination ranges; one refused entry refuses the whole frame (its
// payload is drained) with one ack naming the entry.
//
// Data-frame header, kind 3 (read: the receiver sends back Count blocks of
// Length bytes from its region, block i at Offset+i*Stride): the same
// fields as kind 1, and no payload follows the header. Kind 4 (read
// scatter: many small reads of one transfer batch, possibly from several
// regions): the same header and scatter table as kind 2, and no payload
// follows the table. The receiver checks a read as it checks a write (region
// registered and not deregistered, every byte inside it, the connection's
// epoch admitted) and answers with its ack: status ackOK and Bytes = the
// frame's read size, then exactly Bytes bytes of payload (the blocks, or the
// entries in table order, back to back), written with one vectored write
// straight from the region; a refused read gets a refusal ack and no
// payload. Kinds 3 and 4 came without a version bump: a receiver of an
// older build answers them with a protocol error (unknown frame kind), and
// writes keep working between builds.
//
// Ack (one per data frame, in the order the frames arrived):
//
//	0  u32 magic 0x41585643 ("CVXA")
//	4  u8  status (ackOK, ackUnknownRegion, ...)
//	5  u8  reserved (0)
//	6  u16 message length in bytes (<= maxAckMsg)
//	8  u64 seq of the frame acknowledged
//	16 u64 payload bytes that landed in the region(s); for an ackOK to a
//	       read frame, the payload bytes that follow the ack

const (
	helloSize  = 24
	headerSize = 48
	ackSize    = 24
	entrySize  = 16 // one scatter-table entry

	// protoVersion 3: scatter frames (2) and the epoch in the hello (3).
	protoVersion = 3

	frameMagic = 0x5758564B
	ackMagic   = 0x41585643

	kindWrite       = 1
	kindScatter     = 2
	kindRead        = 3
	kindReadScatter = 4

	// maxScatterEntries bounds the entries of one scatter frame (its table
	// is at most 16 KiB; its payload fits one readv of IOV_MAX slices).
	maxScatterEntries = 1024

	// maxAckMsg bounds the error text of an ack, bytes.
	maxAckMsg = 1024
	// maxFramePayload bounds Count*Length of one frame (64 GiB). A larger
	// header is a protocol error: the receiver cannot drain it in a sane time.
	maxFramePayload = 64 << 30
)

var helloMagic = [8]byte{'K', 'V', 'X', 'F', 'T', 'C', 'P', 0}

// Ack status codes.
const (
	ackOK            uint8 = 0
	ackUnknownRegion uint8 = 1 // region not registered on the receiver
	ackOutOfBounds   uint8 = 2 // write falls outside the region
	ackBadRequest    uint8 = 3 // well-framed but invalid (overlapping stride)
	ackProtocol      uint8 = 4 // framing broken; the receiver closes the stream
	ackShutdown      uint8 = 5 // receiver is closing
	ackInternal      uint8 = 6 // receiver-side failure (device copy, ...)
	ackFenced        uint8 = 7 // the connection's epoch is fenced or was never admitted; the receiver closes the stream
)

// errProtocol marks a frame that cannot be decoded; the stream must close.
var errProtocol = errors.New("tcp: protocol error")

type hello struct {
	Version uint16
	Stream  uint16
	Epoch   uint64
}

func (h hello) encode(b *[helloSize]byte) {
	copy(b[0:8], helloMagic[:])
	binary.LittleEndian.PutUint16(b[8:], h.Version)
	binary.LittleEndian.PutUint16(b[10:], h.Stream)
	binary.LittleEndian.PutUint32(b[12:], 0)
	binary.LittleEndian.PutUint64(b[16:], h.Epoch)
}

func decodeHello(b []byte) (hello, error) {
	if len(b) < helloSize {
		return hello{}, fmt.Errorf("%w: hello is %d bytes, want %d", errProtocol, len(b), helloSize)
	}
	if [8]byte(b[0:8]) != helloMagic {
		return hello{}, fmt.Errorf("%w: bad hello magic %q (is the peer a kvxfer tcp sender?)", errProtocol, b[0:8])
	}
	h := hello{Version: binary.LittleEndian.Uint16(b[8:]), Stream: binary.LittleEndian.Uint16(b[10:]), Epoch: binary.LittleEndian.Uint64(b[16:])}
	if h.Version != protoVersion {
		return h, fmt.Errorf("%w: protocol version %d, this build speaks %d (upgrade both ends)", errProtocol, h.Version, protoVersion)
	}
	return h, nil
}

// header is a decoded data-frame header. For a scatter frame (Kind ==
// kindScatter or kindReadScatter) Count is the number of table entries,
// Length the total payload in bytes, and Region, Offset and Stride are zero.
type header struct {
	Kind   uint8
	Seq    uint64
	Region uint32
	Count  uint32
	Offset uint64
	Length uint64
	Stride uint64
}

// read reports whether the frame is a read (kindRead, kindReadScatter).
func (h header) read() bool { return h.Kind == kindRead || h.Kind == kindReadScatter }

// scattered reports whether a scatter table follows the header.
func (h header) scattered() bool { return h.Kind == kindScatter || h.Kind == kindReadScatter }

// size returns the frame's data bytes: Count*Length for a write or read
// frame, Length for a scatter frame of either direction.
func (h header) size() uint64 {
	if h.scattered() {
		return h.Length
	}
	return uint64(h.Count) * h.Length
}

// payload returns the payload bytes that follow the header (and the scatter
// table) from the sender: size() for a write, 0 for a read (its bytes
// follow the receiver's ack instead).
func (h header) payload() uint64 {
	if h.read() {
		return 0
	}
	return h.size()
}

// tableBytes returns the size of the scatter table after the header (0 for a
// write or read frame).
func (h header) tableBytes() int {
	if h.scattered() {
		return int(h.Count) * entrySize
	}
	return 0
}

// encode writes the header; Kind 0 is encoded as kindWrite.
func (h header) encode(b *[headerSize]byte) {
	kind := h.Kind
	if kind == 0 {
		kind = kindWrite
	}
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	b[4] = kind
	b[5] = 0
	binary.LittleEndian.PutUint16(b[6:], 0)
	binary.LittleEndian.PutUint64(b[8:], h.Seq)
	binary.LittleEndian.PutUint32(b[16:], h.Region)
	binary.LittleEndian.PutUint32(b[20:], h.Count)
	binary.LittleEndian.PutUint64(b[24:], h.Offset)
	binary.LittleEndian.PutUint64(b[32:], h.Length)
	binary.LittleEndian.PutUint64(b[40:], h.Stride)
}

// decodeHeader parses a data-frame header. An error (wrapping errProtocol)
// means the stream is unusable: bad magic, unknown kind or flags, zero count,
// a payload over maxFramePayload, or (scatter) more than maxScatterEntries
// entries or reserved fields set. Bounds are not checked here. The returned
// header has Kind set (kindWrite, kindScatter, kindRead or kindReadScatter).
func decodeHeader(b []byte) (header, error) {
	if len(b) < headerSize {
		return header{}, fmt.Errorf("%w: frame header is %d bytes, want %d", errProtocol, len(b), headerSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != frameMagic {
		return header{}, fmt.Errorf("%w: bad frame magic %#08x, want %#08x (stream out of sync)", errProtocol, m, frameMagic)
	}
	if b[4] < kindWrite || b[4] > kindReadScatter {
		return header{}, fmt.Errorf("%w: unknown frame kind %d", errProtocol, b[4])
	}
	if b[5] != 0 || binary.LittleEndian.Uint16(b[6:]) != 0 {
		return header{}, fmt.Errorf("%w: reserved frame bits set (flags %#x)", errProtocol, b[5])
	}
	h := header{
		Kind:   b[4],
		Seq:    binary.LittleEndian.Uint64(b[8:]),
		Region: binary.LittleEndian.Uint32(b[16:]),
		Count:  binary.LittleEndian.Uint32(b[20:]),
		Offset: binary.LittleEndian.Uint64(b[24:]),
		Length: binary.LittleEndian.Uint64(b[32:]),
		Stride: binary.LittleEndian.Uint64(b[40:]),
	}
	if h.Count == 0 {
		return h, fmt.Errorf("%w: frame %d has block count 0", errProtocol, h.Seq)
	}
	if h.scattered() {
		switch {
		case h.Count > maxScatterEntries:
			return h, fmt.Errorf("%w: scatter frame %d has %d entries, the limit is %d", errProtocol, h.Seq, h.Count, maxScatterEntries)
		case h.Region != 0 || h.Offset != 0 || h.Stride != 0:
			return h, fmt.Errorf("%w: scatter frame %d has reserved header fields set", errProtocol, h.Seq)
		case h.Length < uint64(h.Count) || h.Length > maxFramePayload:
			return h, fmt.Errorf("%w: scatter frame %d declares %d payload bytes for %d entries (want %d..%d)",
				errProtocol, h.Seq, h.Length, h.Count, h.Count, uint64(maxFramePayload))
		}
		return h, nil
	}
	hi, lo := bits.Mul64(uint64(h.Count), h.Length)
	if hi != 0 || lo > maxFramePayload {
		return h, fmt.Errorf("%w: frame %d payload %d x %d bytes exceeds the %d-byte limit", errProtocol, h.Seq, h.Count, h.Length, uint64(maxFramePayload))
	}
	return h, nil
}

// entry is one decoded scatter-table entry: Length bytes at Offset of
// remote region Region.
type entry struct {
	Region uint32
	Length uint32
	Offset uint64
}

// end returns Offset+Length and false on overflow.
func (e entry) end() (uint64, bool) {
	end, c := bits.Add64(e.Offset, uint64(e.Length), 0)
	return end, c == 0
}

// putEntry encodes e into b[0:entrySize].
func putEntry(b []byte, e entry) {
	binary.LittleEndian.PutUint32(b[0:], e.Region)
	binary.LittleEndian.PutUint32(b[4:], e.Length)
	binary.LittleEndian.PutUint64(b[8:], e.Offset)
}

// decodeTable parses the scatter table of h (h.Count entries of entrySize
// bytes in b) into dst[:0] and returns it. An error wraps errProtocol: a
// short table, an entry of length 0, or entry lengths that do not add up to
// the header's payload (the receiver could not tell where the frame ends).
// Regions and bounds are checked by the receiver, not here.
func decodeTable(h header, b []byte, dst []entry) ([]entry, error) {
	n := int(h.Count)
	if len(b) < n*entrySize {
		return dst[:0], fmt.Errorf("%w: scatter frame %d table is %d bytes, want %d", errProtocol, h.Seq, len(b), n*entrySize)
	}
	dst = dst[:0]
	var sum uint64
	for i := 0; i < n; i++ {
		p := b[i*entrySize:]
		e := entry{Region: binary.LittleEndian.Uint32(p[0:]), Length: binary.LittleEndian.Uint32(p[4:]), Offset: binary.LittleEndian.Uint64(p[8:])}
		if e.Length == 0 {
			return dst, fmt.Errorf("%w: scatter frame %d entry %d has length 0", errProtocol, h.Seq, i)
		}
		sum += uint64(e.Length) // n <= 1024 entries of < 4 GiB: no overflow
		dst = append(dst, e)
	}
	if sum != h.Length {
		return dst, fmt.Errorf("%w: scatter frame %d entries add up to %d bytes, header says %d", errProtocol, h.Seq, sum, h.Length)
	}
	return dst, nil
}

// span returns the end (exclusive) of the bytes the frame touches in its
// region: Offset + (Count-1)*Stride + Length, and false on overflow.
func (h header) span() (uint64, bool) {
	hi, step := bits.Mul64(uint64(h.Count-1), h.Stride)
	if hi != 0 {
		return 0, false
	}
	end, c := bits.Add64(h.Offset, step, 0)
	if c != 0 {
		return 0, false
	}
	end, c = bits.Add64(end, h.Length, 0)
	return end, c == 0
}

// ack is a decoded acknowledgement.
type ack struct {
	Status uint8
	Seq    uint64
	Bytes  uint64
	Msg    string
}

// encodeAck appends the ack (header and message, truncated to maxAckMsg) to dst.
func encodeAck(dst []byte, a ack) []byte {
	msg := a.Msg
	if len(msg) > maxAckMsg {
		msg = msg[:maxAckMsg]
	}
	var b [ackSize]byte
	binary.LittleEndian.PutUint32(b[0:], ackMagic)
	b[4] = a.Status
	b[5] = 0
	binary.LittleEndian.PutUint16(b[6:], uint16(len(msg)))
	binary.LittleEndian.PutUint64(b[8:], a.Seq)
	binary.LittleEndian.PutUint64(b[16:], a.Bytes)
	dst = append(dst, b[:]...)
	return append(dst, msg...)
}

// decodeAckHeader parses the fixed part of an ack and returns it with the
// message length to read next. Errors wrap errProtocol.
func decodeAckHeader(b []byte) (ack, int, error) {
	if len(b) < ackSize {
		return ack{}, 0, fmt.Errorf("%w: ack is %d bytes, want %d", errProtocol, len(b), ackSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != ackMagic {
		return ack{}, 0, fmt.Errorf("%w: bad ack magic %#08x, want %#08x", errProtocol, m, ackMagic)
	}
	a := ack{Status: b[4], Seq: binary.LittleEndian.Uint64(b[8:]), Bytes: binary.LittleEndian.Uint64(b[16:])}
	if a.Status > ackFenced {
		return a, 0, fmt.Errorf("%w: unknown ack status %d", errProtocol, a.Status)
	}
	if b[5] != 0 {
		return a, 0, fmt.Errorf("%w: reserved ack byte set", errProtocol)
	}
	n := int(binary.LittleEndian.Uint16(b[6:]))
	if n > maxAckMsg {
		return a, 0, fmt.Errorf("%w: ack message of %d bytes exceeds %d", errProtocol, n, maxAckMsg)
	}
	return a, n, nil
}
