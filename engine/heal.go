package engine

import (
	"context"
	"time"
)

// Self-healing data paths (issue 18 case 1). A data path that breaks is
// re-established without restarting a process:
//
//   - A tcp data connection lost while idle (reset between rooms) is dialled
//     again by the next transfer batch, with the same epoch and bounded
//     backoff (engine/tcp, segment.redial): no room fails.
//   - A data path that breaks under a room's writes fails that room once,
//     on both sides, with the cause; the producer's unclean ABORT_ACK makes
//     the decode fence the epoch and drop the registration (fence.go), so
//     the next room registers again with a new epoch: new connections (tcp),
//     new QPs (rdma), a new admission (shm).
//   - rdma has no redial: an RC QP is one half of a pair whose other half
//     (QP number, PSN, GID) the peer creates for a registration, so a new QP
//     needs the peer's part, i.e. a new registration through the control
//     plane, not a dial the transport can do alone. What happens today:
//     a peer process that restarts is a new instance with a new epoch:
//     a restarted decode's REGISTER replaces its old registration on the
//     prefill (the old segment and its QPs are closed), a restarted
//     prefill's lost control connection makes the decode fence the old
//     epoch (rdma FenceEpoch: its receiver QPs to ERR, destroyed) and the
//     next room registers again, so the next room runs on new QPs. A QP
//     that breaks while idle with both processes alive (link down past the
//     retry timeout, a NIC reset) is not noticed then: RC has no keepalive
//     and rdma does not read the device's async events, so the next room's
//     first WRITE fails (IBV_WC_RETRY_EXC_ERR after about 4.096 us x
//     2^qp_timeout x (retry_cnt+1), or rdma's stall_timeout, 10 s), that
//     room fails once on both sides with the cause, its unclean ABORT_ACK
//     makes the decode fence the epoch, and the room after it registers
//     new QPs (the second bullet). Healing that break with no failed room
//     would need the prefill to refuse the room before its first write
//     and the decode to re-register and resend TRANSFER; it is not built.
//   - A room that starts while an earlier room's producer on the same
//     registration has not yet said whether its data path is clean
//     (awaitEpochSettled) waits for that answer (at most FenceTimeout)
//     instead of starting on a data path about to be fenced, so one break
//     fails one room, not also the next.

// awaitEpochSettled waits, at most FenceTimeout or until ctx ends, while a
// failed room other than self sent TRANSFER to the prefill rank peer over
// epoch and that producer is neither done nor fenced yet: its ABORT_ACK
// (clean, or unclean and the epoch fenced) decides whether the registration
// can carry another room.
func (m *Manager) awaitEpochSettled(ctx context.Context, self *Receiver, peer string, epoch uint64) {
	m.mu.Lock()
	rs := make([]*Receiver, 0, len(m.dec.receivers))
	for _, r := range m.dec.receivers {
		if r != self {
			rs = append(rs, r)
		}
	}
	m.mu.Unlock()
	var wait []<-chan struct{}
	for _, r := range rs {
		if r.Poll() == KVFailed && r.unsettled(peer, epoch) {
			wait = append(wait, r.fenceCh)
		}
	}
	if len(wait) == 0 {
		return
	}
	t := time.NewTimer(m.cfg.FenceTimeout)
	defer t.Stop()
	for _, ch := range wait {
		select {
		case <-ch:
		case <-ctx.Done():
			return
		case <-t.C:
			return
		case <-m.done:
			return
		}
	}
}

// unsettled reports whether this room sent TRANSFER to (peer, epoch) and
// that producer neither reported its last write nor is fenced.
func (r *Receiver) unsettled(peer string, epoch uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range r.targets {
		if t.endpoint == peer && t.epoch == epoch && t.sent && !t.rank.Dummy && !t.wrote && !t.fenced {
			return true
		}
	}
	return false
}
