package transport

import (
	"math/rand/v2"
	"sync/atomic"
)

// epochs hands out segment epochs; it starts at a random 32-bit value so that
// a restarted process does not reuse the epochs its predecessor announced.
var epochs atomic.Uint64

func init() { epochs.Store(uint64(rand.Uint32()) << 8) }

// NewEpoch returns a segment epoch (>= 1) never returned before in this
// process. A decode manager takes one for every registration with a prefill
// rank (RegisterMsg.Epoch): it names that data path in SegmentInfo.Epoch, in
// TRANSFER, in the metadata record and in ABORT_ACK, and fencing it
// (Fencer.FenceEpoch) cuts exactly that data path.
func NewEpoch() uint64 { return epochs.Add(1) }
