package engine

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestMetaRingWait: with every slot in use, AcquireWait callers queue and
// get released slots first come first served, with a fresh generation; a
// caller whose context ends leaves the queue with an error naming the ring
// (ErrRingFull), and a slot handed to it as it gives up goes to the next
// caller; Acquire does not overtake queued callers.
func TestMetaRingWait(t *testing.T) {
	r, err := NewMetaRing(1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	s0, g0, err := r.AcquireWait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		slot int
		gen  uint64
		err  error
	}
	wait := func(ctx context.Context) chan got {
		c := make(chan got, 1)
		go func() {
			s, g, err := r.AcquireWait(ctx)
			c <- got{s, g, err}
		}()
		return c
	}
	queued := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); r.Waiting() != n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d callers queued, want %d", r.Waiting(), n)
			}
		}
	}
	first := wait(ctx)
	queued(1)
	cctx, cancel := context.WithCancel(ctx)
	gaveUp := wait(cctx)
	queued(2)
	third := wait(ctx)
	queued(3)
	if _, _, err := r.Acquire(); !errors.Is(err, ErrRingFull) {
		t.Fatalf("Acquire with callers queued: %v, want ErrRingFull", err)
	}
	cancel()
	if g := <-gaveUp; !errors.Is(g.err, ErrRingFull) || !errors.Is(g.err, context.Canceled) {
		t.Fatalf("cancelled wait: %+v, want ErrRingFull and context.Canceled", g)
	}
	queued(2)
	r.Release(s0)
	g1 := <-first
	if g1.err != nil || g1.slot != s0 || g1.gen == g0 {
		t.Fatalf("first waiter got %+v, want slot %d with a generation after %d", g1, s0, g0)
	}
	select {
	case g := <-third:
		t.Fatalf("third waiter got %+v before a second release", g)
	default:
	}
	r.Release(g1.slot)
	g3 := <-third
	if g3.err != nil || g3.gen <= g1.gen {
		t.Fatalf("third waiter got %+v after the first's release (gen %d)", g3, g1.gen)
	}
	r.Release(g3.slot)
	// A hand-off racing a cancellation loses no slot.
	for range 200 {
		s, _, err := r.Acquire()
		if err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(ctx)
		c := wait(cctx)
		queued(1)
		go cancel()
		r.Release(s)
		if g := <-c; g.err == nil {
			r.Release(g.slot)
		}
		if r.Waiting() != 0 {
			t.Fatal("waiter left queued")
		}
	}
	if _, _, err := r.Acquire(); err != nil {
		t.Fatalf("the slot was lost in a hand-off race: %v", err)
	}
}
