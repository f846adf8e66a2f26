package engine

import (
	"sync"
)

// KVPoll is the state of one request's KV transfer as SGLang reports it
// (base/conn.py KVPoll; spec §7). The numeric values are SGLang's, so a poll
// can be all-reduced with MIN across a TP group: a single Failed rank fails the
// request and progress only counts when every rank agrees.
type KVPoll int

//go:generate go run golang.org/x/tools/cmd/stringer@v0.51.0 -type KVPoll -linecomment -output kvpoll_string.go

const (
	// KVFailed: the transfer failed; sticky. Failure() says why.
	KVFailed KVPoll = 0 // Failed
	// KVBootstrapping: created; the sender waits for its destinations'
	// TRANSFER frames, the receiver resolves its producers.
	KVBootstrapping KVPoll = 1 // Bootstrapping
	// KVWaitingForInput: sender: every destination is known, Send may be
	// called; receiver: producers resolved and registered.
	KVWaitingForInput KVPoll = 2 // WaitingForInput
	// KVTransferring: pages are moving (sender), or the TRANSFER frames were
	// sent and the receiver waits for every producer's STATUS.
	KVTransferring KVPoll = 3 // Transferring
	// KVSuccess: receiver: every producer reported Success and its metadata
	// record was verified; sender: every page and the metadata record landed,
	// STATUS was sent, and every decode destination answered that it
	// verified the room (its verdict), so a sender never reports Success for
	// a room its decode failed.
	KVSuccess KVPoll = 4 // Success
)

// Valid reports whether p is one of the five states.
func (p KVPoll) Valid() bool { return p >= KVFailed && p <= KVSuccess }

// pollState is a forward-only KVPoll cell: Failed is sticky and overrides
// everything, any other update only moves the state forward (SGLang's
// CommonKVManager.update_status, spec §7). The first failure's error is kept.
type pollState struct {
	mu      sync.Mutex
	state   KVPoll
	err     error
	changed chan struct{} // closed and replaced on every change
	// hook, when set (before the state is shared), sees every change after
	// it happened, outside the lock, in order for each caller (the room's
	// timeline, metrics and span: roomTrace.onState).
	hook func(KVPoll, error)
}

func newPollState() *pollState {
	return &pollState{state: KVBootstrapping, changed: make(chan struct{})}
}

// get returns the state and the failure (nil unless Failed).
func (s *pollState) get() (KVPoll, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state, s.err
}

// advance moves to next if next is later; it returns whether it changed.
// Advancing to KVFailed is done with fail.
func (s *pollState) advance(next KVPoll) bool {
	s.mu.Lock()
	if s.state == KVFailed || next <= s.state || next == KVFailed {
		s.mu.Unlock()
		return false
	}
	s.state = next
	s.notifyLocked()
	s.mu.Unlock()
	if s.hook != nil {
		s.hook(next, nil)
	}
	return true
}

// fail makes the state Failed with err unless it is already terminal
// (Failed, or Success when onlyBeforeSuccess). It returns whether it changed.
func (s *pollState) fail(err error, onlyBeforeSuccess bool) bool {
	s.mu.Lock()
	if s.state == KVFailed || (onlyBeforeSuccess && s.state == KVSuccess) {
		s.mu.Unlock()
		return false
	}
	s.state = KVFailed
	err = onePrefix(err)
	s.err = err
	s.notifyLocked()
	s.mu.Unlock()
	if s.hook != nil {
		s.hook(KVFailed, err)
	}
	return true
}

func (s *pollState) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// waitChan returns a channel closed at the next change.
func (s *pollState) waitChan() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}
