package engine

import (
	"sync"
	"time"
)

// Verdicts that outlive their room's decision (issue 22 case 1). A decode
// decides a room (Success, or a failure) and then tells its producers from
// goroutines of their own; a caller that sees the decision may close the
// manager (its process exits) before those sends ran, and a PUSH socket
// closed with LINGER 0 drops what it still queues. So:
//
//   - Manager.Close first waits, at most verdictFlush, for the verdict sends
//     already decided (verdictFlight), and closes the control sockets of
//     live peers with a linger of verdictFlush, so the frames they queue go
//     out before the context terminates (Close returns within about
//     2 x verdictFlush even when a peer stopped reading).
//   - A prefill that wrote a room and waits only for the decode's verdict
//     does not fail it the moment the decode's control connection drops: the
//     verdict travels on the decode's own connection, which may be read
//     after the drop is noticed. It fails the room only once its receive
//     loop emptied its inbox verdictGrace after the drop and no verdict came
//     (Manager.peerLostAfterVerdictWait); a verdict already received from
//     that decode is never undone by its loss.

// verdictFlush bounds how long Close waits for decided verdicts to be
// handed to their sockets, and how long those sockets linger to send them.
const verdictFlush = time.Second

// verdictGrace is how long after a decode's control connection dropped a
// prefill still takes the verdict that decode sent before it went (it comes
// on another TCP connection, which may be read later).
const verdictGrace = 250 * time.Millisecond

// flight counts operations in progress; wait returns when none is left.
// Unlike sync.WaitGroup, add may be called at any time, also while a wait
// runs.
type flight struct {
	mu   sync.Mutex
	n    int
	idle chan struct{}
}

// add records n more operations in progress.
func (f *flight) add(n int) {
	if n <= 0 {
		return
	}
	f.mu.Lock()
	if f.n == 0 {
		f.idle = make(chan struct{})
	}
	f.n += n
	f.mu.Unlock()
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

// goVerdict sends a decided verdict from a goroutine of its own, counted in
// verdictFlight (the caller added it before the decision became visible).
func (m *Manager) goVerdict(ep string, room uint64, ok bool, reason string, epoch uint64) {
	go func() {
		defer m.verdictFlight.done(1)
		if h := m.beforeVerdict.Load(); h != nil {
			(*h)()
		}
		m.sendVerdict(ep, room, ok, reason, epoch)
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
