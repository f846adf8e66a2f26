package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"unicode/utf8"
)

// Agent metadata, the byte string get_agent_metadata returns and
// add_remote_agent loads (little-endian):
//
//	0   8 bytes  magic "KVXAGENT"
//	8   u16      version (MetadataVersion)
//	10  u16      reserved, 0
//	12  u64      instance: the agent's engine epoch (random, new per start)
//	20  then four strings, each a u16 byte count and the bytes:
//	    name       the agent's name (1..MaxNameBytes bytes of UTF-8)
//	    control    "host:port" of its control channel (HELLO, OPENED, NOTIF)
//	    segment    its segment name ("host:rpc_port", the segment RPC)
//	    transport  its transport's registry name ("tcp", "shm", "rdma")
//
// Nothing follows the last string. The registered memory is not in it: the
// peer reads the regions from the segment RPC when it adds the agent, and
// again when a prepared descriptor misses them.
const (
	metadataMagic = "KVXAGENT"
	// MetadataVersion is the version this build writes and reads.
	MetadataVersion = 1
	// MaxNameBytes bounds an agent name.
	MaxNameBytes = 256
	// maxAddrBytes bounds the address and transport strings.
	maxAddrBytes = 512
	// MaxMetadataBytes bounds an encoded metadata string.
	MaxMetadataBytes = 20 + 2*4 + MaxNameBytes + 3*maxAddrBytes
)

// ErrBadMetadata is wrapped by every DecodeMetadata error.
var ErrBadMetadata = errors.New("agent: bad agent metadata")

// Metadata is what a peer needs to add an agent (AddRemoteAgent).
type Metadata struct {
	// Name is the agent's name, unique among the agents that talk to each
	// other.
	Name string
	// Instance is the agent's incarnation (its engine's epoch): a restarted
	// agent of the same name has another one.
	Instance uint64
	// Control is "host:port" of the agent's control channel.
	Control string
	// Segment is the agent's segment name ("host:rpc_port").
	Segment string
	// Transport is the agent's transport name.
	Transport string
}

// Encode returns the versioned byte string (see the layout above).
func (m Metadata) Encode() []byte {
	b := make([]byte, 20, 20+8+len(m.Name)+len(m.Control)+len(m.Segment)+len(m.Transport))
	copy(b, metadataMagic)
	binary.LittleEndian.PutUint16(b[8:], MetadataVersion)
	binary.LittleEndian.PutUint64(b[12:], m.Instance)
	for _, s := range []string{m.Name, m.Control, m.Segment, m.Transport} {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(s)))
		b = append(b, s...)
	}
	return b
}

// DecodeMetadata parses an agent metadata string. Errors wrap
// ErrBadMetadata and say which field is wrong: a short or long string, an
// unknown magic or version (the peer runs another kvxfer or is not kvxfer),
// an empty or oversized name, an address that is not host:port, bytes after
// the last field. It never panics on any input (FuzzDecodeMetadata).
func DecodeMetadata(b []byte) (Metadata, error) {
	if len(b) > MaxMetadataBytes {
		return Metadata{}, fmt.Errorf("%w: %d bytes, longer than %d (is this kvxfer agent metadata?)", ErrBadMetadata, len(b), MaxMetadataBytes)
	}
	if len(b) < 20 {
		return Metadata{}, fmt.Errorf("%w: %d bytes, shorter than the 20-byte header (truncated in transit?)", ErrBadMetadata, len(b))
	}
	if string(b[:8]) != metadataMagic {
		return Metadata{}, fmt.Errorf("%w: magic %q, want %q (NIXL's own metadata cannot be loaded by kvxfer: both sides must run the kvxfer agent)", ErrBadMetadata, b[:8], metadataMagic)
	}
	if v := binary.LittleEndian.Uint16(b[8:]); v != MetadataVersion {
		return Metadata{}, fmt.Errorf("%w: version %d, this build reads version %d (upgrade the older side)", ErrBadMetadata, v, MetadataVersion)
	}
	if r := binary.LittleEndian.Uint16(b[10:]); r != 0 {
		return Metadata{}, fmt.Errorf("%w: reserved field is %d, want 0", ErrBadMetadata, r)
	}
	m := Metadata{Instance: binary.LittleEndian.Uint64(b[12:])}
	rest := b[20:]
	fields := []struct {
		name string
		dst  *string
		max  int
	}{{"name", &m.Name, MaxNameBytes}, {"control address", &m.Control, maxAddrBytes}, {"segment name", &m.Segment, maxAddrBytes}, {"transport", &m.Transport, maxAddrBytes}}
	for _, f := range fields {
		if len(rest) < 2 {
			return Metadata{}, fmt.Errorf("%w: truncated before the %s", ErrBadMetadata, f.name)
		}
		n := int(binary.LittleEndian.Uint16(rest))
		rest = rest[2:]
		if n > len(rest) {
			return Metadata{}, fmt.Errorf("%w: %s of %d bytes, only %d left", ErrBadMetadata, f.name, n, len(rest))
		}
		if n == 0 || n > f.max {
			return Metadata{}, fmt.Errorf("%w: %s is %d bytes, want 1..%d", ErrBadMetadata, f.name, n, f.max)
		}
		if !utf8.Valid(rest[:n]) {
			return Metadata{}, fmt.Errorf("%w: %s is not UTF-8", ErrBadMetadata, f.name)
		}
		*f.dst = string(rest[:n])
		rest = rest[n:]
	}
	if len(rest) != 0 {
		return Metadata{}, fmt.Errorf("%w: %d bytes after the last field", ErrBadMetadata, len(rest))
	}
	for _, a := range []struct{ what, v string }{{"control address", m.Control}, {"segment name", m.Segment}} {
		if h, p, err := net.SplitHostPort(a.v); err != nil || h == "" || p == "" {
			return Metadata{}, fmt.Errorf("%w: %s %q is not host:port", ErrBadMetadata, a.what, a.v)
		}
	}
	return m, nil
}
