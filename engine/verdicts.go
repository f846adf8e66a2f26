package engine

import (
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// Verdicts that outlive their room's decision (issue 22 case 1). A decode
// decides a room (Success, or a failure) and then tells its producers from
// goroutines of their own; a caller that sees the decision may close the
// manager (its process exits) before those sends ran, and a PUSH socket
// closed with LINGER 0 drops what it still queues. So:
//
//   - Manager.Close first stops new Success decisions (a room whose last
//     record is verified once Close began fails as closed, as every room
//     still in flight does, at once, with an ABORT to its producers: its
//     verdict could not be waited for), then waits, at most verdictFlush,
//     for the verdict sends already decided, those ABORTs and the
//     re-answers of producers that asked again (verdictFlight), then for
//     the acknowledgements of the Success verdicts (verdictack.go, at most
//     verdictAckWait), and closes the control sockets of live peers with a
//     linger of verdictFlush, so the frames they queue go out before the
//     context terminates (Close returns within about 3 x verdictFlush even
//     when a peer stopped reading).
//   - A prefill that wrote a room and waits only for the decode's verdict
//     does not fail it the moment the decode's control connection drops: the
//     verdict travels on the decode's own connection, which may be read
//     after the drop is noticed. It fails the room only once its receive
//     loop emptied its inbox verdictGrace after the drop and no verdict came
//     (Manager.peerLost); a verdict already received from that decode is
//     never undone by its loss. The grace is longer than the decode's close
//     needs to hand the verdict over: its control sockets linger up to
//     verdictFlush after its PULL socket closed (which is what the prefill
//     sees as the drop), and a loaded host delays both ends.
//   - A decode restarted on the same address answers the prefill's re-ask
//     for the verdict with "has no room" (the new incarnation never held
//     it) while the old incarnation's verdict may still be on its way on
//     the old connection. A prefill that wrote the room and waits for that
//     verdict takes such an answer only after the same grace, once its
//     inbox was read, and only if the verdict did not come meanwhile
//     (Manager.deferNoRoomAbort).
//
// A decode that is killed (SIGKILL, a crash) or whose close runs past
// its bounds cannot deliver what it decided: its prefill then fails the
// room naming the lost decode, after the grace (the documented limit).

// verdictFlush bounds how long Close waits for decided verdicts to be
// handed to their sockets, and how long those sockets linger to send them.
const verdictFlush = time.Second

// verdictGrace is how long after a decode's control connection dropped (or
// after a "no room" answer for a room it wrote) a prefill still takes the
// verdict that decode sent before it went (it comes on another TCP
// connection, which may be read later): the decode's linger, verdictFlush,
// and as much again for a loaded host. A room of a killed decode fails that
// much later; nothing else waits for it.
const verdictGrace = 2 * verdictFlush

// noRoomReason is the part of a decode's ABORT reason that says it does not
// hold the room asked about (decode.go handleStatus; the text is the same
// since protocol 4, so older decodes' answers are recognised too).
const noRoomReason = "has no room"

// deferNoRoomAbort (prefill): v is a decode's "no room" answer for a room
// this prefill wrote and whose verdict it awaits from that decode. The
// answer may come from a new incarnation on the same address while the old
// one's verdict is still on its way (see above), so it is handled only once
// the inbox was read verdictGrace later, and dropped if the Success verdict
// came meanwhile. It reports whether it took v over.
func (m *Manager) deferNoRoomAbort(v *control.AbortMsg) bool {
	if m.cfg.Role != RolePrefill || !strings.Contains(v.Reason, noRoomReason) {
		return false
	}
	m.mu.Lock()
	s := m.pre.senders[v.Room]
	m.mu.Unlock()
	if s == nil || !s.hasDst(v.Endpoint) || !s.awaitingVerdict() || s.verdictFrom(v.Endpoint) {
		return false
	}
	at := time.Now()
	m.goTracked(func() {
		if !m.afterInboxDrained(at.Add(verdictGrace)) {
			return // closing: the sender fails with ErrManagerClosed
		}
		if s.verdictFrom(v.Endpoint) {
			m.log.Debug("a \"no room\" answer overtaken by the verdict of the decode's previous incarnation", "room", v.Room, "peer", peerLabel(v.Endpoint))
			return
		}
		m.handleAbortNow(v)
	})
	return true
}

// flight counts operations in progress; wait returns when none is left.
// Unlike sync.WaitGroup, add may be called at any time, also while a wait
// runs. After shut, admit refuses new operations, so a wait that starts
// after shut cannot miss one that is admitted later.
type flight struct {
	mu   sync.Mutex
	n    int
	idle chan struct{}
	shut bool
}

// admit records n more operations in progress unless shut was called, and
// reports whether it did.
func (f *flight) admit(n int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.shut {
		return false
	}
	f.addLocked(n)
	return true
}

// shutdown makes admit refuse from now on.
func (f *flight) shutdown() {
	f.mu.Lock()
	f.shut = true
	f.mu.Unlock()
}

// add records n more operations in progress.
func (f *flight) add(n int) {
	f.mu.Lock()
	f.addLocked(n)
	f.mu.Unlock()
}

// addLocked is add with f.mu held.
func (f *flight) addLocked(n int) {
	if n <= 0 {
		return
	}
	if f.n == 0 {
		f.idle = make(chan struct{})
	}
	f.n += n
}

// done records that n operations ended.
func (f *flight) done(n int) {
	if n <= 0 {
		return
	}
	f.mu.Lock()
	f.n -= n
	if f.n <= 0 {
		f.n = 0
		if f.idle != nil {
			close(f.idle)
			f.idle = nil
		}
	}
	f.mu.Unlock()
}

// wait returns once no operation is in progress or after limit, and
// reports whether none is.
func (f *flight) wait(limit time.Duration) bool {
	f.mu.Lock()
	if f.n == 0 {
		f.mu.Unlock()
		return true
	}
	ch := f.idle
	f.mu.Unlock()
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
		return false
	}
}

// goVerdict sends a decided Success verdict (of attempt, for registration
// epoch) from a goroutine of its own, counted in verdictFlight (the caller
// added it before the decision became visible); it stays recorded as
// unacknowledged until the producer's VERDICT_ACK (verdictack.go).
func (m *Manager) goVerdict(ep string, room, epoch, attempt uint64) {
	m.noteUnacked(ep, room, epoch, attempt)
	go func() {
		defer m.verdictFlight.done(1)
		if h := m.beforeVerdict.Load(); h != nil {
			(*h)()
		}
		m.sendVerdict(ep, room, true, "", epoch)
	}()
}

// afterInboxDrained returns once the receive loop found its inbox empty at
// or after t (everything that arrived before t was dispatched), or the
// manager closes (false).
func (m *Manager) afterInboxDrained(t time.Time) bool {
	for {
		if m.drainedAt.Load() >= t.UnixNano() {
			return true
		}
		select {
		case <-m.done:
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}
