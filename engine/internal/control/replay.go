package control

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// Replay protection for authenticated control frames. The envelope tag
// (envelope.go) proves a frame came from a holder of the deployment's
// token, and its send time bounds how long a captured frame stays
// acceptable (ReplayWindow); within that window the same captured frame
// would verify again. So every frame also carries the sender's sequence
// number (envelope frame n-2, covered by the tag): a sender numbers its
// frames 1, 2, 3, ... (one counter per manager, taken under the socket lock
// just before the send, so the frames to one receiver leave in increasing
// order), and a receiver keeps, per sender (instance id, epoch), the
// highest sequence seen and a bitmap of the replayWindowFrames before it. A
// frame whose sequence it has seen, or that is older than the bitmap, is
// dropped as a replay (kvxfer_control_frames_dropped_total{reason="replay"}).
//
// Bounds: at most maxReplaySenders senders are tracked (only senders whose
// frames verified: without the token nobody can add one). A sender not
// heard from for 2 x ReplayWindow is forgotten (its old frames are outside
// the send-time window anyway); when the table is full of senders heard
// from more recently, the least recently heard one is forgotten and its
// last send time becomes a floor: frames of senders the table does not know
// that were sent at or before the floor are dropped too, since they may be
// the forgotten sender's.
//
// What it does not cover: a frame captured on its way to one rank and
// replayed, within ReplayWindow, to another rank that has not seen that
// sequence number from the sender (the tag does not name the receiver);
// and a rank restarted at the same address accepts frames captured on
// their way to its predecessor within ReplayWindow. Both need the
// receiver's identity under the tag, which a first REGISTER cannot know
// for every deployment form (a wildcard or advertised address).

// replayWindowFrames is how far behind the highest sequence number seen
// from a sender a frame may arrive and still be accepted once.
const replayWindowFrames = 64

// maxReplaySenders bounds the senders whose sequence numbers a rank keeps.
const maxReplaySenders = 8192

// ErrReplayed is wrapped by errors about authenticated control frames whose
// sequence number this rank has already accepted from that sender (or that
// are too old to tell).
var ErrReplayed = errors.New("engine: control frame replayed")

// replaySender is one sender's sequence state.
type replaySender struct {
	last   uint64    // highest sequence accepted
	seen   uint64    // bit i: last-1-i accepted
	heard  time.Time // receiver's clock at the last accepted frame
	sentAt time.Time // sender's send time of the highest-numbered frame
}

// ReplayGuard holds the per-sender sequence state of one rank (the zero
// value is ready; safe for concurrent use).
type ReplayGuard struct {
	mu      sync.Mutex
	senders map[PeerID]*replaySender
	// floor: frames from senders not in the table sent at or before it are
	// dropped (a forgotten sender's frames may be among them).
	floor time.Time
	max   int // maxReplaySenders (tests lower it)
}

// Check accepts env's sequence number from its sender once; a repeat, or a
// number more than replayWindowFrames below the highest seen, is an error
// wrapping ErrReplayed. Sequence 0 (a sender that does not number its
// frames) is refused: an authenticated sender always numbers them.
func (g *ReplayGuard) Check(env Envelope, now time.Time) error {
	id := PeerID{instance: env.Instance, epoch: env.Epoch}
	if env.Seq == 0 {
		return fmt.Errorf("%w: frame from instance %s carries no sequence number", ErrReplayed, id)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.senders == nil {
		g.senders = map[PeerID]*replaySender{}
		if g.max == 0 {
			g.max = maxReplaySenders
		}
	}
	s := g.senders[id]
	if s == nil {
		if !env.SentAt.After(g.floor) {
			return fmt.Errorf("%w: frame from instance %s sent at %s, before this rank forgot the oldest of %d senders (%s): it may be a replay of that sender's",
				ErrReplayed, id, env.SentAt.UTC().Format(time.RFC3339Nano), g.max, g.floor.UTC().Format(time.RFC3339Nano))
		}
		if len(g.senders) >= g.max {
			g.evictLocked(now)
		}
		g.senders[id] = &replaySender{last: env.Seq, heard: now, sentAt: env.SentAt}
		return nil
	}
	switch {
	case env.Seq > s.last:
		shift := env.Seq - s.last
		if shift >= 64 {
			s.seen = 0
		} else {
			s.seen <<= shift
		}
		s.seen |= 1 << (shift - 1) // the previous highest
		s.last = env.Seq
		s.sentAt = env.SentAt
	case env.Seq == s.last:
		return fmt.Errorf("%w: frame %d from instance %s accepted before", ErrReplayed, env.Seq, id)
	default:
		back := s.last - env.Seq // >= 1
		if back > replayWindowFrames {
			return fmt.Errorf("%w: frame %d from instance %s is %d behind its newest (%d): older than the %d-frame window", ErrReplayed, env.Seq, id, back, s.last, replayWindowFrames)
		}
		bit := uint64(1) << (back - 1)
		if s.seen&bit != 0 {
			return fmt.Errorf("%w: frame %d from instance %s accepted before", ErrReplayed, env.Seq, id)
		}
		s.seen |= bit
	}
	s.heard = now
	return nil
}

// evictLocked forgets senders not heard from for 2 x ReplayWindow; when
// none is that old, the least recently heard one, raising the floor to its
// last send time. g.mu held.
func (g *ReplayGuard) evictLocked(now time.Time) {
	var oldest PeerID
	var oldestAt time.Time
	for id, s := range g.senders {
		if now.Sub(s.heard) > 2*ReplayWindow {
			delete(g.senders, id)
			continue
		}
		if oldestAt.IsZero() || s.heard.Before(oldestAt) {
			oldest, oldestAt = id, s.heard
		}
	}
	if len(g.senders) < g.max {
		return
	}
	if s := g.senders[oldest]; s != nil {
		if s.sentAt.After(g.floor) {
			g.floor = s.sentAt
		}
		delete(g.senders, oldest)
	}
}

// UnauthMemory remembers, per claimed sender endpoint, the last control
// frame dropped as unauthenticated, so a registration that times out can
// say why the peer seemed silent. The endpoints are claims of frames that
// did not verify: they are used for that message only. Bounded to
// maxUnauthMemory endpoints.
type UnauthMemory struct {
	mu sync.Mutex
	by map[string]unauthDrop
}

// unauthDrop is the last unauthenticated frame claiming one endpoint.
type unauthDrop struct {
	n   int
	err string
	at  time.Time
}

const maxUnauthMemory = 64

// Note records err for a frame claiming endpoint ep.
func (u *UnauthMemory) Note(ep string, err error, now time.Time) {
	if ep == "" {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.by == nil {
		u.by = map[string]unauthDrop{}
	}
	d, ok := u.by[ep]
	if !ok && len(u.by) >= maxUnauthMemory {
		var oldest string
		var at time.Time
		for k, v := range u.by {
			if at.IsZero() || v.at.Before(at) {
				oldest, at = k, v.at
			}
		}
		delete(u.by, oldest)
	}
	u.by[ep] = unauthDrop{n: d.n + 1, err: err.Error(), at: now}
}

// Since returns what was dropped for ep at or after t ("" when nothing).
func (u *UnauthMemory) Since(ep string, t time.Time) string {
	u.mu.Lock()
	defer u.mu.Unlock()
	d, ok := u.by[ep]
	if !ok || d.at.Before(t) {
		return ""
	}
	return fmt.Sprintf("this rank dropped %d control frame(s) claiming to come from %s as unauthenticated, the last: %s", d.n, ep, d.err)
}
