package control

// VERDICT_ACK (prefill → decode, protocol 8): the producer received the
// decode's Success verdict (STATUS Success from the decode) for one room. A
// decode keeps the Success verdicts it sent but that no VERDICT_ACK
// answered yet; its Close re-sends those, for a bounded time, until each is
// acknowledged, so a verdict lost on the way (a dropped frame, a control
// reset) before the decode's process exits is not lost for good. The
// producer acknowledges every copy it receives (copies are harmless: the
// first one decided), since an acknowledgement may be lost as well.
//
//	VERDICT_ACK: 3 room, 4 prefill endpoint, 5 epoch (the verdict's: the
//	decode's registration with this prefill rank), 6 attempt (the
//	decode attempt whose TRANSFER the producer serves, TransferMsg.Attempt;
//	0 when it holds none: the room was closed there), 7 accepted (1: the
//	verdict counts, the room is Success or only waits for the other
//	decodes' verdicts there, or was closed there; 0: the room had already
//	failed there), 8 detail (the room's failure there when accepted is 0,
//	else "")
const MsgVerdictAck = "VERDICT_ACK"

// verdictAckFrames is VERDICT_ACK's frame count, header included.
const verdictAckFrames = 9

// VerdictAckMsg is VERDICT_ACK (see the frame table above).
type VerdictAckMsg struct {
	Room     uint64
	Endpoint string
	Epoch    uint64
	Attempt  uint64
	Accepted bool
	Detail   string
}

// Encode returns the message's frames.
func (m *VerdictAckMsg) Encode() [][]byte {
	return append(header(MsgVerdictAck), Dec(m.Room), []byte(m.Endpoint), Dec(m.Epoch), Dec(m.Attempt), b01(m.Accepted), []byte(m.Detail))
}

// DecodeVerdictAck decodes a VERDICT_ACK message. Errors wrap ErrBadFrame.
func DecodeVerdictAck(parts [][]byte) (*VerdictAckMsg, error) {
	r, err := newReader(parts, MsgVerdictAck, verdictAckFrames, true)
	if err != nil {
		return nil, err
	}
	m := &VerdictAckMsg{Room: r.Uint(3, MaxRoom, "room"), Endpoint: r.endpoint(4), Epoch: r.Uint(5, maxEpoch, "epoch"),
		Attempt: r.Uint(6, MaxAttempt, "attempt"), Accepted: r.bool(7, "accepted"), Detail: r.Str(8, "detail")}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}
