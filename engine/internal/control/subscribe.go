package control

// The "prefill_complete" decode allocation policy (SGLang's
// --disaggregation-decode-allocation-policy prefill_complete; common/
// bootstrap.py DeferredBootstrap): a decode reserves no KV pages for a room
// until the prefill has computed the request. Once it has resolved and
// registered with the room's producers it sends each one SUBSCRIBE and keeps
// the room Bootstrapping; a producer answers with STATUS WaitingForInput
// (StatusWaitingForInput) when its sender is marked complete (at once when
// it already is), or with STATUS Failed when the room failed there. Only
// then does the decode take pages and metadata slots and send TRANSFER.
// SGLang's decode sends [BOOTSTRAP, room, decode_ip, decode_port] on the
// same control channel; kvxfer's frame adds the registration epoch, as
// every other per-room frame does.
//
//	SUBSCRIBE (decode → prefill): 3 room, 4 decode endpoint, 5 epoch of the
//	decode's registration with this prefill rank (RegisterMsg.Epoch, >= 1)
const MsgSubscribe = "SUBSCRIBE"

// StatusWaitingForInput is the STATUS state a producer answers SUBSCRIBE
// with once it computed the request (KVPoll WaitingForInput).
const StatusWaitingForInput = 2

// SubscribeMsg is SUBSCRIBE (see the frame table above).
type SubscribeMsg struct {
	Room     uint64
	Endpoint string
	Epoch    uint64
}

// Encode returns the message's frames.
func (m *SubscribeMsg) Encode() [][]byte {
	return append(header(MsgSubscribe), Dec(m.Room), []byte(m.Endpoint), Dec(m.Epoch))
}

// DecodeSubscribe decodes a SUBSCRIBE message. Errors wrap ErrBadFrame.
func DecodeSubscribe(parts [][]byte) (*SubscribeMsg, error) {
	r, err := newReader(parts, MsgSubscribe, 6, true)
	if err != nil {
		return nil, err
	}
	m := &SubscribeMsg{Room: r.Uint(3, MaxRoom, "room"), Endpoint: r.endpoint(4), Epoch: r.Uint(5, maxEpoch, "epoch")}
	if r.Err == nil && m.Epoch == 0 {
		r.Fail(5, "epoch must be >= 1")
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}
