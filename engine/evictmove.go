package engine

import (
	"context"
	"fmt"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// A prefill evicts a decode's registration only while no room of that
// decode is on it (evictIdleDecodeLocked: no sender has the decode as a
// destination, no TRANSFER or SUBSCRIBE of it waits), or, after a silent
// drop, once every room it wrote for the decode has the decode's verdict
// (silentdrop.go). So a room of this decode still on the evicted
// registration when the notice (a REGISTER_ACK with EvictedPrefix) comes
// had nothing written: its TRANSFER is still to be sent, or crossed the
// notice, and the prefill rejects it as "TRANSFER before REGISTER" — a
// rejection that may never arrive, as a prefill at its socket cap cannot
// open a socket back to a decode it no longer has registered. Such a room
// registers again and sends its TRANSFER over the new registration
// (moveEvicted); a room that cannot fails at once, naming the eviction,
// instead of when the prefill is judged silent.

// transferMsgLocked is the room's TRANSFER for producer t over t's
// registration epoch; r.mu held, destination pages given.
func (r *Receiver) transferMsgLocked(t *recvTarget) *control.TransferMsg {
	msg := &control.TransferMsg{Room: r.room, Endpoint: r.m.endpoint, Dummy: t.rank.Dummy, Pages: r.pages, Slot: t.slot, Generation: t.gen,
		RequiredDstInfoNum: r.requiredDst, Checksum: r.m.cfg.Checksum, Epoch: t.epoch, Tokens: r.tokens, AuxIndex: -1, PrefixTokens: r.prefix, Attempt: r.attempt}
	if t.extras {
		msg.AuxIndex, msg.StateIndices = r.auxIndex, r.state
	}
	return msg
}

// beginMove marks this room's producer on the evicted registration (ep,
// epoch) as moving and reports whether there is one: the room is not
// terminal and that producer neither reported Success nor had its record
// verified. A moving producer is not failed by the fence of the evicted
// epoch (usesEpoch).
func (r *Receiver) beginMove(ep string, epoch uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p, _ := r.st.get(); p == KVFailed || p == KVSuccess || r.closed {
		return false
	}
	hit := false
	for _, t := range r.targets {
		if t.endpoint == ep && t.epoch == epoch && !t.wrote && !t.done && !t.moving {
			t.moving, hit = true, true
		}
	}
	return hit
}

// moveEvicted registers this room with prefill ep again after the
// registration epoch it used was evicted (notice: the prefill's refusal
// text), moves its producer there and, when its TRANSFER was sent already,
// sends it again over the new registration; on a failure to register the
// room fails naming the eviction. id is the evicted registration's prefill
// instance. Runs off the control loop (it waits for REGISTER_ACK).
func (r *Receiver) moveEvicted(ep string, epoch uint64, id control.PeerID, notice string) {
	m := r.m
	ctx, cancel := context.WithTimeout(r.ctx, m.cfg.BootstrapTimeout)
	defer cancel()
	newEpoch, _, err := m.ensureRegistered(ctx, ep, id)
	if err == nil && newEpoch == epoch {
		err = fmt.Errorf("the registration is still epoch %d", epoch)
	}
	r.sendMu.Lock()
	r.mu.Lock()
	var t *recvTarget
	for _, c := range r.targets {
		if c.endpoint == ep && c.epoch == epoch && c.moving {
			t = c
		}
	}
	if t == nil {
		r.mu.Unlock()
		r.sendMu.Unlock()
		return
	}
	t.moving = false
	p, _ := r.st.get()
	if closed := r.closed; err != nil || p == KVFailed || closed {
		r.mu.Unlock()
		r.sendMu.Unlock()
		if err != nil && !closed {
			r.failLocal(fmt.Errorf("%w: room %d: prefill %s dropped this decode's registration (epoch %d) before it held the room's TRANSFER, so nothing was written for it (%s); registering again failed: %v",
				transport.ErrPeerLost, r.room, ep, epoch, notice, err))
		}
		return
	}
	t.epoch, t.fenced = newEpoch, false
	var msg *control.TransferMsg
	if t.sent {
		msg = r.transferMsgLocked(t)
	}
	r.mu.Unlock()
	if msg != nil {
		err = m.send(ep, msg.Encode(), false)
	}
	r.sendMu.Unlock()
	what := "registered again"
	if msg != nil {
		what = "registered again and sent TRANSFER again"
	}
	r.tr.event(r.tr.step(), ep, fmt.Sprintf("registration epoch %d evicted by the prefill before it held the room: %s (epoch %d)", epoch, what, newEpoch))
	r.tr.log(ep).Info("room moved to a new registration after its registration was evicted", "evicted_epoch", epoch, "epoch", newEpoch, "transfer_resent", msg != nil)
	if err != nil {
		r.failLocal(fmt.Errorf("engine: room %d: TRANSFER to prefill %s (again, after its registration epoch %d was evicted): %w", r.room, ep, epoch, err))
	}
}
