package segengine

// DecodeSegmentReply decodes a segment RPC reply (tests outside the package
// speak the wire protocol to a listener).
var DecodeSegmentReply = decodeSegmentReply
