package engine

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// pendingEvent never completes; it counts its queries.
type pendingEvent struct{ queries atomic.Int64 }

func (e *pendingEvent) Query() (bool, error) { e.queries.Add(1); return false, nil }

// funcEvent is not comparable (a func field): it is polled privately.
type funcEvent struct{ f func() (bool, error) }

func (e funcEvent) Query() (bool, error) { return e.f() }

// TestEventPollerLeavingWaiter: once a wait returns because its room ended,
// the event is never queried again for it (the caller may destroy the
// event then), for the shared poller and for a non-comparable event.
func TestEventPollerLeavingWaiter(t *testing.T) {
	ev := &pendingEvent{}
	var fq atomic.Int64
	fev := funcEvent{func() (bool, error) { fq.Add(1); return false, nil }}
	for _, tc := range []struct {
		name string
		ev   Event
		n    func() int64
	}{{"shared", ev, ev.queries.Load}, {"private", fev, fq.Load}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- events.wait(ctx, tc.ev) }()
			for tc.n() < 3 {
				time.Sleep(time.Millisecond)
			}
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("wait after cancel = %v", err)
			}
			n := tc.n()
			time.Sleep(5 * time.Millisecond) // a bug would query meanwhile; a correct poller never does
			if got := tc.n(); got != n {
				t.Fatalf("%d queries after the wait returned", got-n)
			}
		})
	}
	events.mu.Lock()
	left := len(events.waits)
	events.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d poller entries left with nobody waiting", left)
	}
}

// TestEventPollerShared: two waits for one event share one poller; both
// see its completion, and an error reaches both.
func TestEventPollerShared(t *testing.T) {
	for _, fail := range []bool{false, true} {
		var state atomic.Int32 // 0 pending, 1 done, 2 failed
		ev := &sharedEvent{state: &state}
		errs := make(chan error, 2)
		for range 2 {
			go func() { errs <- events.wait(context.Background(), ev) }()
		}
		for ev.queries.Load() < 4 {
			time.Sleep(time.Millisecond)
		}
		if fail {
			state.Store(2)
		} else {
			state.Store(1)
		}
		for range 2 {
			err := <-errs
			if (err != nil) != fail {
				t.Fatalf("fail=%v: wait = %v", fail, err)
			}
		}
	}
}

type sharedEvent struct {
	state   *atomic.Int32
	queries atomic.Int64
}

func (e *sharedEvent) Query() (bool, error) {
	e.queries.Add(1)
	switch e.state.Load() {
	case 1:
		return true, nil
	case 2:
		return false, errors.New("kernel failed")
	}
	return false, nil
}
