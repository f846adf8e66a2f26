package engine

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// Step is one link of the evidence chain a room walks (DESIGN: register →
// resolve topology → resolve rank → connect → transfer → verify → consume).
// A decode walks all seven; a prefill walks register, connect (every
// destination's TRANSFER arrived), transfer, verify (its STATUS sent and,
// where the decode answers, the decode's verdict) and consume.
type Step string

// The steps, in chain order.
const (
	// StepRegister: the room exists on this rank (NewSender/NewReceiver).
	StepRegister Step = "register"
	// StepResolveTopology (decode): the prefill instance's
	// PrefillServerInfo and the room's prefill DP rank are known.
	StepResolveTopology Step = "resolve_topology"
	// StepResolveRank (decode): every producer rank's control endpoint is
	// known (GET /route per rank, or the cache).
	StepResolveRank Step = "resolve_rank"
	// StepConnect: decode: registered with every producer (REGISTER_ACK)
	// and metadata slots taken; prefill: every decode destination sent
	// TRANSFER.
	StepConnect Step = "connect"
	// StepTransfer: decode: every producer reported Success; prefill: every
	// page, the aux row and the metadata record landed.
	StepTransfer Step = "transfer"
	// StepVerify: decode: every producer's metadata record verified (room,
	// epoch, counts, checksum); prefill: Success reported to the decode.
	StepVerify Step = "verify"
	// StepConsume: the room is Success and its KV is the caller's.
	StepConsume Step = "consume"
)

// Steps returns the steps of role's side of a room, in order.
func Steps(role Role) []Step {
	if role == RoleDecode {
		return []Step{StepRegister, StepResolveTopology, StepResolveRank, StepConnect, StepTransfer, StepVerify, StepConsume}
	}
	return []Step{StepRegister, StepConnect, StepTransfer, StepVerify, StepConsume}
}

// DefaultTimelineRooms is how many finished rooms' timelines a manager
// keeps (ManagerConfig.TimelineRooms).
const DefaultTimelineRooms = 1024

// maxRoomEvents bounds one room's event list; later events are counted in
// RoomTimeline.Dropped (batch events past it: see batchTailEvents).
const maxRoomEvents = 128

// RoomEvent is one timestamped event of a room on one rank.
type RoomEvent struct {
	// At is when it happened (this host's clock).
	At time.Time `json:"at"`
	// Step is the evidence-chain step the event belongs to.
	Step Step `json:"step"`
	// Done marks the completion of Step for the room (per-peer events
	// leave it false).
	Done bool `json:"done,omitempty"`
	// Peer is the peer rank's control address (host:port) the event
	// concerns, or the bootstrap address for the resolve steps.
	Peer string `json:"peer,omitempty"`
	// Detail says what happened ("STATUS Success", "state Transferring").
	Detail string `json:"detail,omitempty"`
	// Error is set on the failure event.
	Error string `json:"error,omitempty"`
}

// RoomTimeline is one rank's record of one room: when each step of the
// evidence chain completed and, for a failed room, where and why it failed.
type RoomTimeline struct {
	Room uint64 `json:"room"`
	// Role is prefill or decode; Rank the rank's coordinates (dp/tp/pp);
	// Endpoint its control endpoint.
	Role     string `json:"role"`
	Rank     string `json:"rank"`
	Endpoint string `json:"endpoint"`
	// Created is when the room was created on this rank; Finished when it
	// became final (zero while active).
	Created  time.Time `json:"created"`
	Finished time.Time `json:"finished,omitzero"`
	// State is the KVPoll state (SGLang's name).
	State string `json:"state"`
	// Step is the step in progress, or for a failed room the step it
	// failed at ("" once Success).
	Step Step `json:"step,omitempty"`
	// Reason is the failure class (FailureReason) and Error the failure.
	Reason string `json:"reason,omitempty"`
	Error  string `json:"error,omitempty"`
	// Events in order; Dropped counts events beyond the per-room limit
	// (batch events between a room's first and last ones are marked by
	// one "N batch events not kept" event where they were).
	Events  []RoomEvent `json:"events"`
	Dropped int         `json:"dropped,omitempty"`
}

// String renders the timeline on one line: each event as "+offset step"
// (offset since the room's creation), with its detail, peer and "done" or
// "FAILED", then the outcome.
func (tl RoomTimeline) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "room %d on %s %s:", tl.Room, tl.Role, tl.Rank)
	for i, e := range tl.Events {
		if i > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(&b, " +%s %s", fmtOffset(e.At.Sub(tl.Created)), e.Step)
		if e.Detail != "" {
			b.WriteString(": " + e.Detail)
		}
		if e.Peer != "" {
			b.WriteString(" @" + e.Peer)
		}
		switch {
		case e.Error != "":
			b.WriteString(" FAILED")
		case e.Done:
			b.WriteString(" done")
		}
	}
	switch {
	case tl.State == KVFailed.String():
		fmt.Fprintf(&b, " → Failed at %s (%s)", tl.Step, tl.Reason)
	case !tl.Finished.IsZero():
		b.WriteString(" → " + tl.State)
	default:
		b.WriteString(" … " + tl.State)
	}
	if tl.Dropped > 0 {
		fmt.Fprintf(&b, " (%d more events not kept)", tl.Dropped)
	}
	return b.String()
}

func fmtOffset(d time.Duration) string {
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

// roomTrace is the live timeline of one room on this rank, also its
// OpenTelemetry span (trace.go) and the source of its final metrics.
type roomTrace struct {
	m       *Manager
	room    uint64
	created time.Time
	steps   []Step

	mu      sync.Mutex
	events  []RoomEvent
	dropped int
	// seqs[i] is events[i]'s place among every event kept; tail holds
	// the last batchTailEvents batch events once the head budget is
	// used (a ring from tailNext), tailDropped those it overwrote.
	seqs        []uint64
	seq         uint64
	tail        []seqEvent
	tailNext    int
	tailDropped int
	done        map[Step]bool
	peers       map[Step]map[string]bool
	expect      int // producers or destinations a per-peer step waits for (0: unknown)
	xferStart   time.Time
	state       KVPoll
	failStep    Step
	reason      string
	err         error
	finished    time.Time
	lastMark    time.Time
	span        roomSpan
	logOnFinish bool
}

// newRoomTrace returns the room's timeline (StepRegister done) and sets
// it as st's hook; start lists it once the room is the rank's.
func (m *Manager) newRoomTrace(room uint64, st *pollState) *roomTrace {
	now := time.Now()
	t := &roomTrace{m: m, room: room, created: now, steps: Steps(m.cfg.Role), done: map[Step]bool{}, peers: map[Step]map[string]bool{},
		state: KVBootstrapping, lastMark: now, logOnFinish: true}
	t.appendLocked(RoomEvent{At: now, Step: StepRegister, Done: true})
	t.done[StepRegister] = true
	st.hook = t.onState
	return t
}

// start lists the trace among the manager's active rooms and starts its
// span; called once the room is registered on the rank (m.mu held).
func (t *roomTrace) start() {
	t.mu.Lock()
	t.span = t.m.startRoomSpan(t.room, t.created)
	t.mu.Unlock()
	t.m.timelines.add(t)
}

// currentLocked is the first step of the chain not yet done.
func (t *roomTrace) currentLocked() Step {
	for _, s := range t.steps {
		if !t.done[s] {
			return s
		}
	}
	return ""
}

func (t *roomTrace) appendLocked(e RoomEvent) {
	if len(t.events) >= maxRoomEvents {
		t.dropped++
		return
	}
	t.events = append(t.events, e)
	t.seqs = append(t.seqs, t.seq)
	t.seq++
}

// mark records that step completed for the room (idempotent); detail and
// peer are optional.
func (t *roomTrace) mark(step Step, peer, detail string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.markLocked(step, peer, detail, time.Now())
}

func (t *roomTrace) markLocked(step Step, peer, detail string, now time.Time) {
	if t.done[step] {
		return
	}
	t.done[step] = true
	t.appendLocked(RoomEvent{At: now, Step: step, Done: true, Peer: peerLabel(peer), Detail: detail})
	t.span.step(step, t.lastMark, now)
	t.lastMark = now
}

// expectPeers sets how many peers a per-peer step needs before it is done
// (the room's real producers on a decode).
func (t *roomTrace) expectPeers(n int) {
	t.mu.Lock()
	t.expect = n
	t.mu.Unlock()
}

// peer records that step completed for one peer; with every expected peer
// done, the step is done for the room.
func (t *roomTrace) peer(step Step, peer, detail string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	ps := t.peers[step]
	if ps == nil {
		ps = map[string]bool{}
		t.peers[step] = ps
	}
	if ps[peer] {
		return
	}
	ps[peer] = true
	t.appendLocked(RoomEvent{At: now, Step: step, Peer: peerLabel(peer), Detail: detail})
	if t.expect > 0 && (step == StepTransfer || step == StepVerify) && len(ps) >= t.expect {
		t.markLocked(step, "", "", now)
	}
}

// batchEventsReserve is the room kept in a timeline's event list for the
// chain's own events (steps done, STATUS, the failure, fencing) once
// per-batch events (noteBatch) fill it.
const batchEventsReserve = 48

// batchTailEvents is how many of a room's last batch events its timeline
// keeps once its first ones filled the list up to batchEventsReserve: a
// layer-by-layer room of more batches than fit keeps its first and its
// last batches (the ones before the handover) and says how many between
// them were left out.
const batchTailEvents = 32

// seqEvent is a kept batch event of the tail ring with its place in the
// room's event order.
type seqEvent struct {
	seq uint64
	ev  RoomEvent
}

// noteBatch records a transfer batch event (posted, ended). Until the
// timeline is within batchEventsReserve of its limit the event joins the
// list; after that it goes to a ring of the last batchTailEvents batch
// events, the oldest of which it may push out (counted in Dropped and
// shown as one "batch events not kept" event where they were).
func (t *roomTrace) noteBatch(peer, detail string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := RoomEvent{At: time.Now(), Step: StepTransfer, Peer: peerLabel(peer), Detail: detail}
	if len(t.events) < maxRoomEvents-batchEventsReserve {
		t.appendLocked(e)
		return
	}
	se := seqEvent{seq: t.seq, ev: e}
	t.seq++
	if len(t.tail) < batchTailEvents {
		t.tail = append(t.tail, se)
		return
	}
	t.tail[t.tailNext] = se
	t.tailNext = (t.tailNext + 1) % batchTailEvents
	t.tailDropped++
}

// eventsLocked merges the list and the tail ring in the order the events
// happened, with one marker event where tail batch events were pushed out.
func (t *roomTrace) eventsLocked() []RoomEvent {
	if len(t.tail) == 0 {
		return slices.Clone(t.events)
	}
	tail := make([]seqEvent, 0, len(t.tail))
	tail = append(tail, t.tail[t.tailNext:]...)
	tail = append(tail, t.tail[:t.tailNext]...)
	out := make([]RoomEvent, 0, len(t.events)+len(tail)+1)
	i, j := 0, 0
	for i < len(t.events) || j < len(tail) {
		if j < len(tail) && (i == len(t.events) || tail[j].seq < t.seqs[i]) {
			if j == 0 && t.tailDropped > 0 {
				out = append(out, RoomEvent{At: tail[0].ev.At, Step: StepTransfer,
					Detail: fmt.Sprintf("%d batch events not kept", t.tailDropped)})
			}
			out = append(out, tail[j].ev)
			j++
			continue
		}
		out = append(out, t.events[i])
		i++
	}
	return out
}

// peersDone returns the peers (control endpoints) that completed step.
func (t *roomTrace) peersDone(step Step) map[string]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]bool, len(t.peers[step]))
	for p := range t.peers[step] {
		out[p] = true
	}
	return out
}

// note records an event that completes nothing (a message sent, a state
// change). Transfer-start notes also start the transfer latency clock.
func (t *roomTrace) note(step Step, peer, detail string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if step == StepTransfer && t.xferStart.IsZero() {
		t.xferStart = now
	}
	t.appendLocked(RoomEvent{At: now, Step: step, Peer: peerLabel(peer), Detail: detail})
}

// step returns the step in progress (the failed step once Failed).
func (t *roomTrace) step() Step {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.state == KVFailed {
		return t.failStep
	}
	return t.currentLocked()
}

// log returns the manager's logger with the room's attributes: room, step
// and, when given, peer (the rank attribute comes with the manager's).
func (t *roomTrace) log(peer string) *slog.Logger {
	l := t.m.log.With("room", t.room, "step", string(t.step()))
	if peer != "" {
		l = l.With("peer", peerLabel(peer))
	}
	return l
}

// onState is the room's pollState hook: it records the state change and,
// on a final state, the outcome (metrics, span, the failure log with the
// whole timeline) and moves the timeline to the finished rooms.
func (t *roomTrace) onState(p KVPoll, err error) {
	now := time.Now()
	t.mu.Lock()
	if t.state == KVFailed || t.state == KVSuccess || (p != KVFailed && p <= t.state) {
		// final already, or a hook that lost the race with a later change
		t.mu.Unlock()
		return
	}
	t.state = p
	switch p {
	case KVWaitingForInput:
		// Every step before the input is done: the decode resolved and
		// registered with its producers; the prefill knows its destinations.
		for _, s := range t.steps {
			if s == StepTransfer {
				break
			}
			t.markLocked(s, "", "", now)
		}
	case KVTransferring:
		if t.xferStart.IsZero() {
			t.xferStart = now
		}
		t.appendLocked(RoomEvent{At: now, Step: StepTransfer, Detail: "state Transferring"})
	case KVSuccess:
		for _, s := range t.steps {
			t.markLocked(s, "", "", now)
		}
	case KVFailed:
		t.failStep = t.currentLocked()
		t.reason = FailureReason(err)
		t.err = err
		t.appendLocked(RoomEvent{At: now, Step: t.failStep, Error: errText(err)})
	}
	if p != KVSuccess && p != KVFailed {
		t.mu.Unlock()
		return
	}
	t.finished = now
	var xfer time.Duration
	if !t.xferStart.IsZero() {
		xfer = now.Sub(t.xferStart)
	}
	step, reason := t.failStep, t.reason
	t.span.end(p, err, step, reason, now)
	var tl RoomTimeline
	if p == KVFailed {
		tl = t.snapshotLocked()
	}
	t.mu.Unlock()
	t.m.met.roomDone(t.m.cfg.Role, p == KVSuccess, reason, step, now.Sub(t.created), xfer)
	t.m.timelines.finish(t)
	if p == KVFailed && t.logOnFinish {
		t.m.log.Warn("room failed", "room", t.room, "step", string(step), "peer", lastPeer(tl), "reason", reason, "err", err, "timeline", tl.String())
	}
}

// lastPeer is the peer of the timeline's last event that names one.
func lastPeer(tl RoomTimeline) string {
	for i := len(tl.Events) - 1; i >= 0; i-- {
		if p := tl.Events[i].Peer; p != "" {
			return p
		}
	}
	return ""
}

// event records a late event (after the room became final it still goes
// into the kept timeline: an ABORT_ACK, the release of the pages).
func (t *roomTrace) event(step Step, peer, detail string) { t.note(step, peer, detail) }

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// snapshot returns a copy of the timeline.
func (t *roomTrace) snapshot() RoomTimeline {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.snapshotLocked()
}

func (t *roomTrace) snapshotLocked() RoomTimeline {
	tl := RoomTimeline{Room: t.room, Role: t.m.cfg.Role.String(), Rank: t.m.rankName, Endpoint: t.m.endpoint, Created: t.created,
		Finished: t.finished, State: t.state.String(), Events: t.eventsLocked(), Dropped: t.dropped + t.tailDropped}
	switch t.state {
	case KVFailed:
		tl.Step, tl.Reason, tl.Error = t.failStep, t.reason, errText(t.err)
	case KVSuccess:
	default:
		tl.Step = t.currentLocked()
	}
	return tl
}

// timelineStore keeps the active rooms' timelines and the last N finished
// ones.
type timelineStore struct {
	mu     sync.Mutex
	keep   int
	active map[*roomTrace]struct{}
	ring   []*roomTrace // finished, oldest overwritten first
	next   int
}

func newTimelineStore(keep int) *timelineStore {
	return &timelineStore{keep: keep, active: map[*roomTrace]struct{}{}}
}

func (s *timelineStore) add(t *roomTrace) {
	s.mu.Lock()
	s.active[t] = struct{}{}
	s.mu.Unlock()
}

func (s *timelineStore) finish(t *roomTrace) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.active[t]; !ok {
		return
	}
	delete(s.active, t)
	if s.keep <= 0 {
		return
	}
	if len(s.ring) < s.keep {
		s.ring = append(s.ring, t)
		return
	}
	s.ring[s.next] = t
	s.next = (s.next + 1) % s.keep
}

// lookup returns the newest trace of room: an active one first, else the
// most recently finished.
func (s *timelineStore) lookup(room uint64) *roomTrace {
	s.mu.Lock()
	defer s.mu.Unlock()
	for t := range s.active {
		if t.room == room {
			return t
		}
	}
	var best *roomTrace
	for _, t := range s.ring {
		if t.room == room && (best == nil || t.created.After(best.created)) {
			best = t
		}
	}
	return best
}

// all returns the active traces and the finished ones, newest first.
func (s *timelineStore) all() []*roomTrace {
	s.mu.Lock()
	out := make([]*roomTrace, 0, len(s.active)+len(s.ring))
	for t := range s.active {
		out = append(out, t)
	}
	out = append(out, s.ring...)
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b *roomTrace) int { return b.created.Compare(a.created) })
	return out
}

// RoomTimeline returns this rank's timeline of room: the active room's, or
// the most recent finished one among the last ManagerConfig.TimelineRooms;
// false when this rank has none.
func (m *Manager) RoomTimeline(room uint64) (RoomTimeline, bool) {
	t := m.timelines.lookup(room)
	if t == nil {
		return RoomTimeline{}, false
	}
	return t.snapshot(), true
}

// RoomTimelines returns the timelines of the active rooms and the last
// finished ones, newest first; failedOnly keeps the failed rooms; limit > 0
// caps the count.
func (m *Manager) RoomTimelines(failedOnly bool, limit int) []RoomTimeline {
	var out []RoomTimeline
	for _, t := range m.timelines.all() {
		tl := t.snapshot()
		if failedOnly && tl.State != KVFailed.String() {
			continue
		}
		out = append(out, tl)
		if limit > 0 && len(out) >= limit {
			break
		}
	}
	return out
}
