package transport

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
)

// SegmentDescriptor is what a sender needs to open a named segment on
// another engine (Mooncake's segment descriptor): the engine's segment name,
// its incarnation, how to reach it, and its registered regions with their
// base virtual addresses, so a write addressed to a peer virtual address
// (Mooncake's peer_buffer_address) can be translated to (region, offset).
//
// A TransferEngine answers a peer's request for it over its RPC listener
// (P2P handshake, the default), publishes it in a SegmentDirectory when one
// is configured (etcd), and writes it for kvx_segment_export. Encode and
// DecodeSegmentDescriptor are its wire form (versioned JSON).
type SegmentDescriptor struct {
	// Name is the segment name peers open ("host:rpc_port" by default).
	Name string
	// Epoch is the engine's incarnation: a random non-zero value chosen when
	// the engine starts, so a restarted engine with the same name has a
	// different epoch and a sender can tell it from the old one.
	Epoch uint64
	// RPC is the "host:port" of the engine's segment RPC listener (descriptor
	// refresh, per-peer endpoints, handshake accept); empty for a KV manager
	// rank, which publishes its descriptor for liveness only (Kind).
	RPC string
	// Kind says what publishes the segment: "engine" (a TransferEngine),
	// "prefill" or "decode" (a KV manager rank); informational.
	Kind string
	// Hostname and PID identify the process (informational, for listings).
	Hostname string
	PID      int
	// Devices are the NICs/GPUs the engine was configured with (may be empty).
	Devices []string
	// PreparedFor is the peer id the per-peer endpoints in Transports were
	// prepared for (the id the sender must name when it sends its handshake
	// reply back); empty when no per-peer endpoint is included.
	PreparedFor string
	// Transports are the transports the engine runs, each with its endpoint.
	Transports []SegmentTransport
	// Regions are the registered regions, sorted by Addr, non-overlapping.
	Regions []RegionDesc
}

// SegmentTransport is one transport entry of a SegmentDescriptor.
type SegmentTransport struct {
	// Name is the registry name ("tcp", "shm", "rdma").
	Name string
	// Endpoint is the transport's endpoint blob (Transport.Endpoint). It is
	// empty when PerPeer is set and the descriptor was not prepared for a
	// specific peer (the published, directory form).
	Endpoint []byte
	// PerPeer is set for transports that prepare state per sender
	// (CapHandshake, e.g. RDMA QPs): a sender asks the engine's RPC listener
	// for an endpoint prepared for it and sends back its handshake reply.
	PerPeer bool
}

// SegmentDescriptorVersion is the wire version Encode writes; decoders
// refuse others.
const SegmentDescriptorVersion = 1

// Limits on a decoded descriptor: bytes of the encoded form, regions,
// transports and string lengths.
const (
	MaxSegmentDescriptorBytes = 8 << 20
	MaxSegmentRegions         = 1 << 16
	maxSegmentTransports      = 8
	maxSegmentNameBytes       = 1024
)

// ErrBadDescriptor is wrapped by every segment-descriptor decoding error.
var ErrBadDescriptor = errors.New("engine: malformed segment descriptor")

type wireRegion struct {
	ID     uint32 `json:"id"`
	Addr   uint64 `json:"addr"`
	Length uint64 `json:"length"`
	Kind   string `json:"kind"`
	Key    []byte `json:"key,omitempty"`
}

type wireTransport struct {
	Name     string `json:"name"`
	Endpoint []byte `json:"endpoint,omitempty"`
	PerPeer  bool   `json:"per_peer,omitempty"`
}

type wireDescriptor struct {
	Version    int             `json:"v"`
	Name       string          `json:"name"`
	Epoch      uint64          `json:"epoch"`
	RPC        string          `json:"rpc,omitempty"`
	Kind       string          `json:"kind,omitempty"`
	Hostname   string          `json:"hostname,omitempty"`
	PID        int             `json:"pid,omitempty"`
	Devices    []string        `json:"devices,omitempty"`
	Peer       string          `json:"peer,omitempty"`
	Transports []wireTransport `json:"transports"`
	Regions    []wireRegion    `json:"regions"`
}

// Encode returns the descriptor's wire form: JSON with a version field "v",
// regions as {id, addr, length, kind ("host"|"cuda"), key (base64)}.
func (d SegmentDescriptor) Encode() []byte {
	w := wireDescriptor{Version: SegmentDescriptorVersion, Name: d.Name, Epoch: d.Epoch, RPC: d.RPC, Kind: d.Kind,
		Hostname: d.Hostname, PID: d.PID, Devices: d.Devices, Peer: d.PreparedFor,
		Transports: make([]wireTransport, 0, len(d.Transports)), Regions: make([]wireRegion, 0, len(d.Regions))}
	for _, t := range d.Transports {
		w.Transports = append(w.Transports, wireTransport(t))
	}
	for _, r := range d.Regions {
		w.Regions = append(w.Regions, wireRegion{ID: uint32(r.ID), Addr: r.Addr, Length: r.Length, Kind: r.Kind.String(), Key: r.Key})
	}
	b, err := json.Marshal(w)
	if err != nil {
		panic("engine: encode segment descriptor: " + err.Error()) // only plain types: cannot fail
	}
	return b
}

// DecodeSegmentDescriptor parses and validates a descriptor from Encode.
// It refuses (with an error wrapping ErrBadDescriptor that names the field)
// another version, an empty name, a zero epoch, more than
// MaxSegmentRegions regions, a zero-length or wrapping region, overlapping
// regions, a duplicate region ID or transport, an unknown memory kind, and
// input over MaxSegmentDescriptorBytes. Regions come back sorted by Addr.
func DecodeSegmentDescriptor(b []byte) (SegmentDescriptor, error) {
	var d SegmentDescriptor
	bad := func(format string, a ...any) (SegmentDescriptor, error) {
		return SegmentDescriptor{}, fmt.Errorf("%w: %s", ErrBadDescriptor, fmt.Sprintf(format, a...))
	}
	if len(b) == 0 {
		return bad("empty")
	}
	if len(b) > MaxSegmentDescriptorBytes {
		return bad("%d bytes, over the %d-byte limit", len(b), MaxSegmentDescriptorBytes)
	}
	var w wireDescriptor
	if err := json.Unmarshal(b, &w); err != nil {
		return bad("not JSON from SegmentDescriptor.Encode: %v", err)
	}
	if w.Version != SegmentDescriptorVersion {
		return bad("version %d, this build reads %d (both sides must run compatible kvxfer versions)", w.Version, SegmentDescriptorVersion)
	}
	switch {
	case w.Name == "" || len(w.Name) > maxSegmentNameBytes:
		return bad("name is empty or longer than %d bytes", maxSegmentNameBytes)
	case w.Epoch == 0:
		return bad("segment %q: epoch is 0", w.Name)
	case len(w.RPC) > maxSegmentNameBytes || len(w.Kind) > 64:
		return bad("segment %q: rpc address longer than %d bytes or kind longer than 64", w.Name, maxSegmentNameBytes)
	case len(w.Transports) == 0 || len(w.Transports) > maxSegmentTransports:
		return bad("segment %q: %d transports, want 1..%d", w.Name, len(w.Transports), maxSegmentTransports)
	case len(w.Regions) > MaxSegmentRegions:
		return bad("segment %q: %d regions, more than %d", w.Name, len(w.Regions), MaxSegmentRegions)
	case len(w.Devices) > 64:
		return bad("segment %q: %d devices, more than 64", w.Name, len(w.Devices))
	}
	if len(w.Peer) > maxSegmentNameBytes {
		return bad("segment %q: peer id longer than %d bytes", w.Name, maxSegmentNameBytes)
	}
	d = SegmentDescriptor{Name: w.Name, Epoch: w.Epoch, RPC: w.RPC, Kind: w.Kind, Hostname: w.Hostname, PID: w.PID, Devices: w.Devices, PreparedFor: w.Peer}
	if len(d.Devices) == 0 {
		d.Devices = nil // "devices":[] and an absent list are the same descriptor
	}
	for i, t := range w.Transports {
		if t.Name == "" || len(t.Name) > 64 {
			return bad("segment %q: transport %d: name is empty or longer than 64 bytes", w.Name, i)
		}
		if slices.ContainsFunc(d.Transports, func(o SegmentTransport) bool { return o.Name == t.Name }) {
			return bad("segment %q: transport %q listed twice", w.Name, t.Name)
		}
		if !t.PerPeer && len(t.Endpoint) == 0 {
			return bad("segment %q: transport %q has no endpoint", w.Name, t.Name)
		}
		ep := t.Endpoint
		if len(ep) == 0 {
			ep = nil // "endpoint":"" and an absent endpoint are the same
		}
		d.Transports = append(d.Transports, SegmentTransport{Name: t.Name, Endpoint: ep, PerPeer: t.PerPeer})
	}
	seen := make(map[uint32]bool, len(w.Regions))
	for i, r := range w.Regions {
		var kind MemoryKind
		switch r.Kind {
		case "host":
			kind = MemoryHost
		case "cuda":
			kind = MemoryCUDA
		default:
			return bad("segment %q: region %d: kind %q is not \"host\" or \"cuda\"", w.Name, i, r.Kind)
		}
		if r.Length == 0 || r.Addr+r.Length < r.Addr {
			return bad("segment %q: region %d [%#x, +%d bytes) is empty or wraps the address space", w.Name, r.ID, r.Addr, r.Length)
		}
		if seen[r.ID] {
			return bad("segment %q: region %d listed twice", w.Name, r.ID)
		}
		seen[r.ID] = true
		key := r.Key
		if len(key) == 0 {
			key = nil // "key":"" and an absent key are the same
		}
		d.Regions = append(d.Regions, RegionDesc{ID: RegionID(r.ID), Addr: r.Addr, Length: r.Length, Kind: kind, Key: key})
	}
	SortRegions(d.Regions)
	for i := 1; i < len(d.Regions); i++ {
		p, q := d.Regions[i-1], d.Regions[i]
		if q.Addr < p.Addr+p.Length {
			return bad("segment %q: regions %d [%#x, +%d) and %d [%#x, +%d) overlap", w.Name, p.ID, p.Addr, p.Length, q.ID, q.Addr, q.Length)
		}
	}
	return d, nil
}

func SortRegions(rs []RegionDesc) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].Addr < rs[j].Addr })
}

// sortedCopy returns a copy of rs sorted by Addr, the order FindRegion
// needs (rs is not modified).
func SortedRegions(rs []RegionDesc) []RegionDesc {
	out := append([]RegionDesc(nil), rs...)
	SortRegions(out)
	return out
}

// Transport returns the entry for the named transport.
func (d SegmentDescriptor) Transport(name string) (SegmentTransport, bool) {
	for _, t := range d.Transports {
		if t.Name == name {
			return t, true
		}
	}
	return SegmentTransport{}, false
}

// TransportNames lists the descriptor's transports in order.
func (d SegmentDescriptor) TransportNames() []string {
	out := make([]string, len(d.Transports))
	for i, t := range d.Transports {
		out[i] = t.Name
	}
	return out
}

// FindRegion returns the region that holds [addr, addr+length) entirely
// (regions sorted by Addr, as DecodeSegmentDescriptor and TransferEngine
// produce them). ok is false when no single region holds the whole range.
func FindRegion(regions []RegionDesc, addr, length uint64) (RegionDesc, bool) {
	if length == 0 || addr+length < addr {
		return RegionDesc{}, false
	}
	// First region whose Addr is above addr; the candidate is the one before.
	i := sort.Search(len(regions), func(i int) bool { return regions[i].Addr > addr })
	if i == 0 {
		return RegionDesc{}, false
	}
	r := regions[i-1]
	if addr-r.Addr > r.Length || length > r.Length-(addr-r.Addr) {
		return RegionDesc{}, false
	}
	return r, true
}
