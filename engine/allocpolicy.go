package engine

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// The "prefill_complete" decode allocation policy (SGLang's
// --disaggregation-decode-allocation-policy prefill_complete; common/
// bootstrap.py DeferredBootstrap), both roles configured with
// ManagerConfig.DecodeAllocationPolicy = bootstrap.PolicyPrefillComplete:
//
//   - a decode Receiver resolves and registers with its producers as under
//     "early", then sends each real producer SUBSCRIBE and stays
//     Bootstrapping: it takes no metadata ring slot and sends no TRANSFER
//     (its caller, which allocates the destination pages once Poll says
//     WaitingForInput, reserves nothing) until every real producer answered
//     STATUS WaitingForInput, within the waiting timeout (else the room fails
//     with ErrTimeout, and the producers are told);
//   - a prefill Sender answers a subscription once Sender.MarkPrefillComplete
//     was called (at once when the subscription comes later; one that comes
//     before the Sender exists waits for it, up to the bootstrap timeout),
//     and its bootstrap timeout counts from that call, not from its creation
//     (the request was being computed meanwhile);
//   - a room that fails on either side is failed on the other as under
//     "early": a prefill that fails or closes tells its subscribers (STATUS
//     Failed), a decode that fails tells its producers (ABORT), and a peer
//     lost fails the rooms subscribed to or waiting on it. Nothing was sent
//     for the room before TRANSFER, so nothing needs fencing.
//
// A decode running "prefill_complete" refuses a prefill instance that
// declares "early" (its senders would never be marked complete), naming
// both; a decode running "early" accepts either (TRANSFER then comes before
// the completion, which the prefill's sender does not need).

// pendingSub is a SUBSCRIBE that arrived before the room's Sender existed.
type pendingSub struct {
	msg *control.SubscribeMsg
	at  time.Time
}

// DecodeAllocationPolicy returns the rank's decode allocation policy
// (ManagerConfig.DecodeAllocationPolicy; bootstrap.PolicyEarly when none was
// given). A caller of a decode under bootstrap.PolicyPrefillComplete
// allocates a room's destination pages once its Receiver is
// WaitingForInput; a prefill's calls Sender.MarkPrefillComplete once the
// request's KV is computed.
func (m *Manager) DecodeAllocationPolicy() string {
	if m.prefillComplete() {
		return bootstrap.PolicyPrefillComplete
	}
	return bootstrap.PolicyEarly
}

// prefillComplete reports whether this rank runs the prefill_complete policy.
func (m *Manager) prefillComplete() bool {
	return m.cfg.DecodeAllocationPolicy == bootstrap.PolicyPrefillComplete
}

// checkAllocationPolicy (decode) refuses a prefill instance whose declared
// decode allocation policy cannot serve this decode's, naming both.
func (m *Manager) checkAllocationPolicy(addr string, info *bootstrap.PrefillServerInfo) error {
	if !m.prefillComplete() || info.AllocationPolicy() == bootstrap.PolicyPrefillComplete {
		return nil
	}
	return fmt.Errorf("engine: decode allocation policy mismatch: the prefill instance at %s declares %q, this decode runs %q (its prefill senders would never report the request computed); run both with the same --disaggregation-decode-allocation-policy (kvxfer --decode-allocation-policy, kvx_kv_config.decode_allocation_policy)",
		addr, info.AllocationPolicy(), bootstrap.PolicyPrefillComplete)
}

// handleSubscribe (prefill): a decode subscribed to a room's completion.
// A registration this rank does not have (lost, or of another epoch) is
// refused as a TRANSFER would be, so the decode registers again; a room
// that failed here is refused with its failure; one without a Sender yet
// waits for it (expirePendingSubsLocked).
func (m *Manager) handleSubscribe(v *control.SubscribeMsg) {
	tm := &control.TransferMsg{Room: v.Room, Endpoint: v.Endpoint, Epoch: v.Epoch}
	m.mu.Lock()
	p := m.pre.dpeers[v.Endpoint]
	s := m.pre.senders[v.Room]
	memo, failedHere := m.pre.recent[v.Room]
	switch {
	case p == nil || s != nil || failedHere:
	case v.Epoch == p.reg.Epoch:
		if m.pre.subs[v.Room] == nil {
			m.pre.subs[v.Room] = map[string]pendingSub{}
		}
		if _, again := m.pre.subs[v.Room][v.Endpoint]; !again { // the decode asks every second: the first one counts
			m.pre.subs[v.Room][v.Endpoint] = pendingSub{msg: v, at: time.Now()}
		}
		m.mu.Unlock()
		return
	}
	m.mu.Unlock()
	switch {
	case p == nil:
		m.rejectTransfer(tm, "prefill got SUBSCRIBE before REGISTER from "+v.Endpoint+" (this prefill lost the registration; the decode registers again)", false)
	case v.Epoch != p.reg.Epoch:
		m.rejectTransfer(tm, fmt.Sprintf("SUBSCRIBE names data-path epoch %d, but the decode's registration here is epoch %d (stale; the decode registers again)", v.Epoch, p.reg.Epoch), false)
	case s != nil:
		s.addSubscriber(v)
	default:
		m.rejectTransfer(tm, fmt.Sprintf("prefill %s failed room %d %s before this SUBSCRIBE arrived: %s", m.endpoint, v.Room, time.Since(memo.at).Round(time.Millisecond), memo.failure), true)
	}
}

// expirePendingSubsLocked drops subscriptions that waited longer than the
// bootstrap timeout for their room's Sender and returns them, for the
// decodes to be told (as pending TRANSFERs are); m.mu held.
func (m *Manager) expirePendingSubsLocked(now time.Time) []*control.SubscribeMsg {
	var out []*control.SubscribeMsg
	for _, p := range expirePending(m.pre.subs, now, m.cfg.BootstrapTimeout, func(p pendingSub) time.Time { return p.at }) {
		out = append(out, p.msg)
	}
	return out
}

// expirePending removes and returns the entries of pend (room → endpoint →
// entry) older than ttl, dropping rooms left empty.
func expirePending[V any](pend map[uint64]map[string]V, now time.Time, ttl time.Duration, at func(V) time.Time) []V {
	var out []V
	for room, ps := range pend {
		for ep, p := range ps {
			if now.Sub(at(p)) > ttl {
				delete(ps, ep)
				out = append(out, p)
			}
		}
		if len(ps) == 0 {
			delete(pend, room)
		}
	}
	return out
}

// rejectExpiredSubs tells the decodes of expired subscriptions (nothing was
// written for their rooms).
func (m *Manager) rejectExpiredSubs(subs []*control.SubscribeMsg) {
	for _, v := range subs {
		m.rejectTransfer(&control.TransferMsg{Room: v.Room, Endpoint: v.Endpoint, Epoch: v.Epoch},
			fmt.Sprintf("prefill %s got no request for room %d within its bootstrap timeout %s of this SUBSCRIBE (the room was sent to another prefill, or its prefill request was lost)", m.endpoint, v.Room, m.cfg.BootstrapTimeout), true)
	}
}

// takePendingSubsLocked hands the subscriptions of room that came before
// its Sender to it; m.mu held.
func (m *Manager) takePendingSubsLocked(room uint64) []*control.SubscribeMsg {
	ps := m.pre.subs[room]
	delete(m.pre.subs, room)
	out := make([]*control.SubscribeMsg, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.msg)
	}
	return out
}

// MarkPrefillComplete (SGLang's KVSender.mark_prefill_complete) tells the
// sender that this rank finished computing the request's KV. Under the
// prefill_complete policy (ManagerConfig.DecodeAllocationPolicy) the decodes
// that subscribed to the room are answered now (STATUS WaitingForInput;
// later subscribers at once), and only then reserve their pages and send
// TRANSFER; the sender's bootstrap timeout counts from this call. Under
// "early" it only records the time (no decode waits for it). Call it once
// the KV is in the source pages, before Send; a second call does nothing.
// Errors: the sender already failed (its failure), or it was closed.
func (s *Sender) MarkPrefillComplete() error {
	if p, err := s.st.get(); p == KVFailed {
		return fmt.Errorf("engine: sender room %d already failed: %w", s.room, err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("engine: sender room %d: MarkPrefillComplete after Close", s.room)
	}
	if s.completed {
		s.mu.Unlock()
		return nil
	}
	s.completed, s.completedAt = true, time.Now()
	subs := maps.Clone(s.subs)
	s.mu.Unlock()
	s.tr.note(StepConnect, "", fmt.Sprintf("prefill complete: the request's KV is computed; %d decode(s) subscribed", len(subs)))
	for ep, epoch := range subs {
		s.sendReady(ep, epoch)
	}
	return nil
}

// addSubscriber records a decode's SUBSCRIBE and answers it at once when
// the request is computed; a failed or closed sender answers Failed.
func (s *Sender) addSubscriber(v *control.SubscribeMsg) {
	s.mu.Lock()
	st, err := s.st.get()
	if st == KVFailed || s.closed {
		tell := !s.failTold[v.Endpoint]
		s.failTold[v.Endpoint] = true
		s.mu.Unlock()
		if err == nil {
			err = fmt.Errorf("%w: room %d: the prefill closed the room", ErrAborted, s.room)
		}
		if tell {
			go s.tellFailed(v.Endpoint, v.Epoch, err)
		}
		return
	}
	_, again := s.subs[v.Endpoint]
	s.subs[v.Endpoint] = v.Epoch
	done := s.completed
	s.mu.Unlock()
	if !again {
		s.tr.note(StepConnect, v.Endpoint, "SUBSCRIBE received")
	}
	if done {
		s.sendReady(v.Endpoint, v.Epoch)
	}
}

// sendReady answers a subscription: the request is computed.
func (s *Sender) sendReady(ep string, epoch uint64) {
	go func() {
		msg := &control.StatusMsg{Room: s.room, State: control.StatusWaitingForInput, Producer: s.m.producerRank(), Endpoint: s.m.endpoint, Epoch: epoch}
		if err := s.m.send(ep, msg.Encode(), false); err != nil {
			s.m.log.Debug("prefill-complete STATUS not sent (the decode asks again)", "room", s.room, "decode", ep, "err", err)
		}
	}()
}

// tellFailed sends STATUS Failed to a decode of the room (notifyFailed
// follows it with ABORT_ACK for a real destination; a decode that only
// subscribed gets none: nothing was written for it).
func (s *Sender) tellFailed(ep string, epoch uint64, err error) {
	msg := &control.StatusMsg{Room: s.room, State: int(KVFailed), Producer: s.m.producerRank(), Endpoint: s.m.endpoint, Reason: err.Error(), Epoch: epoch}
	if e := s.m.send(ep, msg.Encode(), false); e != nil {
		s.m.log.Debug("STATUS Failed not sent", "room", s.room, "decode", ep, "err", e)
	}
}

// subscribersOnlyLocked returns the subscribers that sent no TRANSFER and
// were not told of the failure yet, marking them told; s.mu held.
func (s *Sender) subscribersOnlyLocked() map[string]uint64 {
	out := map[string]uint64{}
	for ep, epoch := range s.subs {
		if _, dst := s.dsts[ep]; !dst && !s.failTold[ep] {
			s.failTold[ep] = true
			out[ep] = epoch
		}
	}
	return out
}

// bootstrapClock returns when the sender's bootstrap timeout started: its
// creation, or under prefill_complete its MarkPrefillComplete; ok false while
// a prefill_complete sender is still being computed (no timeout yet).
func (s *Sender) bootstrapClock() (since time.Time, ok bool) {
	if !s.m.prefillComplete() {
		return s.created, true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.completedAt, s.completed
}

// errNotComputed names the producers that did not report the request
// computed within the waiting timeout.
var errNotComputed = errors.New("the prefill did not report the request computed")

// awaitPrefillComplete (decode, prefill_complete) subscribes to every real
// producer's completion and waits, the room Bootstrapping, until each one
// answered WaitingForInput, the room failed or closed (nil: the caller sees
// r.ctx end), or the waiting timeout passed (ErrTimeout naming the producers
// still computing). SUBSCRIBE is sent again every second until answered, so
// a subscription or an answer lost with a dropped connection is repeated.
func (r *Receiver) awaitPrefillComplete() error {
	r.mu.Lock()
	var ts []*recvTarget
	for _, t := range r.targets {
		if !t.rank.Dummy {
			ts = append(ts, t)
		}
	}
	r.mu.Unlock()
	if len(ts) == 0 {
		return nil
	}
	r.tr.note(StepConnect, "", fmt.Sprintf("prefill_complete: waiting for %d producer(s) to compute the request; no pages or slots reserved", len(ts)))
	deadline := time.NewTimer(r.m.cfg.WaitingTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(verdictAsk)
	defer tick.Stop()
	for first := true; ; first = false {
		for _, t := range ts {
			r.mu.Lock()
			ready := t.ready
			r.mu.Unlock()
			if ready {
				continue
			}
			err := r.m.send(t.endpoint, (&control.SubscribeMsg{Room: r.room, Endpoint: r.m.endpoint, Epoch: t.epoch}).Encode(), !first)
			if err != nil && first {
				return fmt.Errorf("engine: room %d: SUBSCRIBE to prefill %s: %w", r.room, t.endpoint, err)
			}
			if first {
				r.tr.note(StepConnect, t.endpoint, "SUBSCRIBE sent")
			}
		}
		select {
		case <-r.readyCh:
			r.tr.note(StepConnect, "", "every producer computed the request: reserving")
			return nil
		case <-r.ctx.Done():
			return nil
		case <-deadline.C:
			var wait []string
			r.mu.Lock()
			for _, t := range ts {
				if !t.ready {
					wait = append(wait, t.endpoint)
				}
			}
			r.mu.Unlock()
			slices.Sort(wait)
			return fmt.Errorf("%w: room %d: %w within the waiting timeout %s (decode allocation policy %q): prefill %s (%s, or check that the prefill calls MarkPrefillComplete / mark_prefill_complete)",
				ErrTimeout, r.room, errNotComputed, r.m.cfg.WaitingTimeout, bootstrap.PolicyPrefillComplete, strings.Join(wait, ", "), waitingTimeoutHint)
		case <-tick.C:
		}
	}
}

// onReady (decode) records a producer's answer to SUBSCRIBE; the room
// proceeds once every real producer answered. t is the producer, by
// endpoint; an answer for another registration epoch is ignored. r.mu held.
func (r *Receiver) onReadyLocked(t *recvTarget, epoch uint64) {
	if t.rank.Dummy || t.ready || (epoch != t.epoch && epoch != 0) {
		return
	}
	t.ready = true
	for _, c := range r.targets {
		if !c.rank.Dummy && !c.ready {
			return
		}
	}
	r.readyOnce.Do(func() { close(r.readyCh) })
}
