package rdma

import (
	"encoding/json"
	"fmt"
	"net"
)

// Wire formats of the handshake blobs the engine carries over its control
// channel (JSON, versioned, validated on decode: they come from the network).

const wireVersion = 1

// maxWireQPs bounds the QPs one blob may describe.
const maxWireQPs = 256

// qpInfo is what one side tells the other about one of its RC QPs.
type qpInfo struct {
	// Dev is the owner's verbs device name (keys RegionKey.Devs).
	Dev string `json:"dev"`
	// QPN is the QP number (24 bits).
	QPN uint32 `json:"qpn"`
	// PSN is the QP's initial send PSN (24 bits).
	PSN uint32 `json:"psn"`
	// GID is the source GID the QP uses (IPv6 text).
	GID string `json:"gid"`
	// LID is the port LID (InfiniBand; 0 on RoCE).
	LID uint16 `json:"lid"`
	// MTU is the port's active MTU enum (1=256 ... 5=4096).
	MTU uint8 `json:"mtu"`
	// Global is true when the path needs a GRH (RoCE).
	Global bool `json:"global"`
	// RdAtom is how many incoming RDMA READs the QP serves at once (its
	// max_dest_rd_atomic); the peer keeps at most that many outstanding.
	// Absent (0) from builds before READ: 1.
	RdAtom uint8 `json:"rd_atom,omitempty"`
}

// handshake is the Endpoint blob (receiver -> sender) and the
// HandshakeReply blob (sender -> receiver): one entry per QP, in pairing
// order (entry i of the reply connects to entry i of the endpoint).
type handshake struct {
	V   int      `json:"v"`
	QPs []qpInfo `json:"qps"`
}

// mrChunkDesc is one MR of a region on one device: bytes [Off, Off+Len) of
// the region, writable with RKey.
type mrChunkDesc struct {
	Off  uint64 `json:"off"`
	Len  uint64 `json:"len"`
	RKey uint32 `json:"rkey"`
}

// devKey is a region's MRs on one device, in offset order.
type devKey struct {
	Dev    string        `json:"dev"`
	Chunks []mrChunkDesc `json:"chunks"`
}

// regionKey is RegionDesc.Key for rdma: the rkeys of every MR the region was
// split into, per device.
type regionKey struct {
	V int `json:"v"`
	// ID is the owner's region ID the MRs belong to; the sender refuses a
	// RegionDesc whose ID differs (a forged or mixed-up descriptor would
	// otherwise write into another region with a valid rkey).
	ID   uint32   `json:"id"`
	Devs []devKey `json:"devs"`
}

func encodeHandshake(h handshake) []byte {
	h.V = wireVersion
	b, _ := json.Marshal(h)
	return b
}

func decodeHandshake(b []byte) (handshake, error) {
	var h handshake
	if err := json.Unmarshal(b, &h); err != nil {
		return h, fmt.Errorf("rdma: bad handshake blob: %w", err)
	}
	if h.V != wireVersion {
		return h, fmt.Errorf("rdma: handshake blob version %d, want %d (mixed kvxfer versions?)", h.V, wireVersion)
	}
	if len(h.QPs) == 0 || len(h.QPs) > maxWireQPs {
		return h, fmt.Errorf("rdma: handshake blob has %d QPs, want 1..%d", len(h.QPs), maxWireQPs)
	}
	for i, q := range h.QPs {
		if q.QPN == 0 || q.QPN >= 1<<24 || q.PSN >= 1<<24 {
			return h, fmt.Errorf("rdma: handshake QP %d: QPN %d / PSN %d outside 24 bits", i, q.QPN, q.PSN)
		}
		if q.MTU < 1 || q.MTU > 5 {
			return h, fmt.Errorf("rdma: handshake QP %d: MTU enum %d, want 1..5", i, q.MTU)
		}
		if net.ParseIP(q.GID) == nil {
			return h, fmt.Errorf("rdma: handshake QP %d: bad GID %q", i, q.GID)
		}
		if q.Dev == "" || len(q.Dev) > 64 {
			return h, fmt.Errorf("rdma: handshake QP %d: bad device name %q", i, q.Dev)
		}
	}
	return h, nil
}

func encodeRegionKey(k regionKey) []byte {
	k.V = wireVersion
	b, _ := json.Marshal(k)
	return b
}

// decodeRegionKey parses and checks a region key: each device's chunks must
// tile [0, extent) in order. Writes are later bounded by both the
// descriptor's Length and the key's extent (the NIC enforces the latter).
func decodeRegionKey(b []byte) (regionKey, error) {
	var k regionKey
	if err := json.Unmarshal(b, &k); err != nil {
		return k, fmt.Errorf("rdma: bad region key: %w", err)
	}
	if k.V != wireVersion {
		return k, fmt.Errorf("rdma: region key version %d, want %d", k.V, wireVersion)
	}
	if len(k.Devs) == 0 || len(k.Devs) > maxWireQPs {
		return k, fmt.Errorf("rdma: region key lists %d devices", len(k.Devs))
	}
	for _, d := range k.Devs {
		var off uint64
		if len(d.Chunks) == 0 {
			return k, fmt.Errorf("rdma: region key for %s has no MRs", d.Dev)
		}
		for _, c := range d.Chunks {
			if c.Off != off || c.Len == 0 || c.Off+c.Len < c.Off {
				return k, fmt.Errorf("rdma: region key for %s: MR at %d+%d does not continue at %d", d.Dev, c.Off, c.Len, off)
			}
			off += c.Len
		}
	}
	return k, nil
}

// extent returns the bytes the key's MRs on dev cover (0 if dev is absent).
func (k regionKey) extent(dev string) uint64 {
	for _, d := range k.Devs {
		if d.Dev == dev {
			last := d.Chunks[len(d.Chunks)-1]
			return last.Off + last.Len
		}
	}
	return 0
}

func (k regionKey) chunks(dev string) []mrChunkDesc {
	for _, d := range k.Devs {
		if d.Dev == dev {
			return d.Chunks
		}
	}
	return nil
}
