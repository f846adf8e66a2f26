package engine

import (
	"context"
	"errors"
	"fmt"
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

// FuzzLayerAdmit drives a layer-wise room's progress with arbitrary calls
// (what a C ABI or Python caller may pass: page lists, layer ranges, Send
// and SendLayers mixed, in any order): it never panics, a refused call
// changes nothing, no (position, layer) is covered twice, the pages a
// position got are the same for every layer, and the room completes
// exactly when every layer holds every page, once.
func FuzzLayerAdmit(f *testing.F) {
	f.Add([]byte{4, 3, 0, 0, 2, 0, 1, 2, 2, 1, 3, 0, 2})
	f.Add([]byte{2, 2, 1, 0, 1, 2, 0, 1, 1, 2})
	f.Add([]byte{0, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < 2 {
			return
		}
		want, layers := int(b[0]%9), int(b[1]%5)+1
		if b[0]%10 == 9 {
			want = -1 // only dummy destinations
		}
		var ls layerState
		ls.init(layers, want)
		covered := map[[2]int]bool{}
		done := false
		for i := 2; i+3 <= len(b); i += 3 {
			x, y, n := int(b[i])%layers, int(b[i+1])%layers, int(b[i+2]%6)
			whole := b[i+2]&0x80 != 0
			last := b[i+2]&0x40 != 0
			a, z := min(x, y), max(x, y)
			if whole {
				a, z = 0, layers-1
			}
			pages := make([]int32, n)
			for k := range pages {
				pages[k] = int32(k + int(b[i+1]&0x10)) // two source page tables
			}
			before := fmt.Sprint(ls.cursor, ls.touched, ls.src)
			if done {
				continue // the engine refuses calls after the last before admit
			}
			at, commit, why := ls.admit(pages, a, z, 7, want, whole, last)
			if why != "" {
				if fmt.Sprint(ls.cursor, ls.touched, ls.src) != before {
					t.Fatalf("a refused call changed the progress: %s", why)
				}
				return // the room failed: nothing more is admitted
			}
			for l := a; l <= z && want >= 0; l++ {
				for p := at; p < at+n; p++ {
					if covered[[2]int{p, l}] {
						t.Fatalf("position %d of layer %d covered twice", p, l)
					}
					covered[[2]int{p, l}] = true
					if ls.src[p] != pages[p-at] {
						t.Fatalf("position %d holds page %d, the call gave %d", p, ls.src[p], pages[p-at])
					}
				}
			}
			if commit {
				done = true
				if want >= 0 && len(covered) != want*layers && !(whole && last) {
					t.Fatalf("completed with %d of %d (position, layer) pairs", len(covered), want*layers)
				}
				if want >= 0 && whole && last && !ls.complete(want) {
					t.Fatal("a last Send completed a room short of a layer")
				}
			} else if !whole && ls.complete(want) {
				t.Fatal("every layer holds every page but the call was not the last")
			}
		}
	})
}
