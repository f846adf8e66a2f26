package engine

import (
	"context"
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// A decode whose directory lookup points at another live prefill than the
// one holding the room (issue 22 case 5). The common case is a rolling
// restart: the successor registered the rank's coordinates, the room's
// request went to it, and a decode still holding the predecessor's entry
// (its cache, or a lookup just before the takeover) sends TRANSFER to the
// predecessor, which is alive and never gets that request. The TRANSFER
// used to wait there for the predecessor's bootstrap timeout (300 s).
//
//   - A prefill that gets a TRANSFER for a room it does not hold checks its
//     directory entry at once (watchDirectory's next check is brought
//     forward, at most every checkNowSpacing; a rank whose directory check
//     is disabled does not check). Once the directory names a newer instance for its
//     coordinates it is replaced: every TRANSFER for a room it does not
//     hold, waiting or arriving, is refused at once (clean: nothing was
//     written), naming the successor. Its own rooms are served to the end.
//   - A decode whose room a producer refuses (STATUS Failed) drops its
//     cached directory entries naming that producer, looks the room's
//     producers up again and tells those that are not the refusing one
//     (ABORT), so the prefill that holds the room fails it at once too; the
//     next room resolves the successor.

// checkNowSpacing bounds how often TRANSFERs for rooms a prefill rank
// does not hold (yet) bring its directory check forward.
const checkNowSpacing = 250 * time.Millisecond

// markReplaced records why this prefill rank gets no new rooms and refuses
// the TRANSFERs waiting for rooms it does not hold.
func (m *Manager) markReplaced(why string) {
	if !m.pre.replaced.CompareAndSwap(nil, &why) {
		return
	}
	m.mu.Lock()
	var refuse []pendingTransfer
	for room, byEP := range m.pre.pending {
		if m.pre.senders[room] != nil {
			continue
		}
		for _, pt := range byEP {
			refuse = append(refuse, pt)
		}
		delete(m.pre.pending, room)
	}
	m.mu.Unlock()
	for _, pt := range refuse {
		m.rejectTransfer(pt.msg, m.replacedRefusal(pt.msg.Room, why), true)
	}
}

// replacedRefusal words the refusal of a TRANSFER for room by a replaced
// prefill rank.
func (m *Manager) replacedRefusal(room uint64, why string) string {
	return fmt.Sprintf("prefill %s does not hold room %d and was replaced (%s): new rooms go to its successor, so this decode's directory lookup was stale; the decode looks the rank up again", m.endpoint, room, why)
}

// askDirectoryCheck brings the directory check forward (non-blocking).
func (m *Manager) askDirectoryCheck() {
	select {
	case m.pre.checkNow <- struct{}{}:
	default:
	}
}

// tellCurrentProducers (decode): after producer ep refused the room, drop
// the cached directory entries naming ep, look the room's producers up
// again and send ABORT to those other than ep (best effort, 2 s).
func (r *Receiver) tellCurrentProducers(ep string, cause error) {
	m := r.m
	m.mu.Lock()
	for addr, inst := range m.dec.bcache {
		if inst.names(ep) {
			delete(m.dec.bcache, addr)
		}
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(m.life, 2*time.Second)
	defer cancel()
	inst, err := m.instance(ctx, r.addr)
	if err != nil {
		return
	}
	dp, ok := bootstrap.SelectDPRank(*inst.info, r.room)
	if r.dpRank >= 0 {
		dp, ok = r.dpRank, true
	}
	if !ok {
		return // the DP rank is the directory's (query_dp_ranks): the refusing producer was it
	}
	g := m.geo
	tg, err := bootstrap.TargetRanks(*inst.info, bootstrap.DecodeRank{AttnTPSize: g.TPSize, AttnTPRank: g.TPRank, AttnCPSize: 1,
		PPSize: g.PPSize, PPRank: g.PPRank, IsMLA: g.MLA}, dp)
	if err != nil {
		return
	}
	for _, tr := range tg.Ranks {
		cur, err := inst.rank(ctx, tr.Coord())
		if err != nil || cur == ep || r.hasTarget(cur) {
			continue
		}
		r.tr.event(r.tr.step(), cur, "ABORT sent to the producer the directory names now")
		m.sendAbort(cur, r.room, cause.Error(), 0, r.attempt)
	}
}
