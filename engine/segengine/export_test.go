package segengine

import (
	"context"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// DecodeSegmentReply decodes a segment RPC reply (tests outside the package
// speak the wire protocol to a listener).
var DecodeSegmentReply = decodeSegmentReply

// ResolveRuns is resolve as SubmitEntries calls it (runs emitted as
// descriptors; strided says whether strided ones may be formed), for tests
// outside the package.
func (s *RemoteSegment) ResolveRuns(ctx context.Context, op transport.Op, e Entries, strided bool, add func(r transport.WriteRequest, localEnd uint64)) error {
	return s.resolve(ctx, op, e, true, strided, add)
}
