package workload

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestAllocWait(t *testing.T) {
	a := NewPageAllocator(4)
	if _, err := a.AllocWait(context.Background(), 5); !errors.Is(err, ErrPoolTooSmall) {
		t.Fatalf("5 of 4 pages: %v, want ErrPoolTooSmall", err)
	}
	held, err := a.AllocWait(context.Background(), 3)
	if err != nil {
		t.Fatal(err)
	}
	// Two more must wait until the three come back.
	got := make(chan error, 1)
	go func() {
		_, err := a.AllocWait(context.Background(), 2)
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("AllocWait(2) with 1 free returned %v before any Free", err)
	case <-time.After(50 * time.Millisecond):
	}
	if err := a.Free(held); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("AllocWait after Free: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("AllocWait did not wake on Free")
	}
	// Nothing is freed: the context ends the wait, with both causes.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := a.AllocWait(ctx, 3); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("AllocWait past the deadline: %v, want DeadlineExceeded and ErrPoolExhausted", err)
	}
}

// waitQueued waits until n AllocWait calls are queued on a.
func waitQueued(t *testing.T, a *PageAllocator, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for a.Waiting() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d AllocWait calls queued, want %d", a.Waiting(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestAllocWaitFIFO: a request for the whole pool, queued first, is served
// before a small one queued after it, though pages for the small one come
// free first (before: the small one took them, and every later small room
// overtook the large one: it finished 408th of 408). A queued call that
// gives up lets the next one through.
func TestAllocWaitFIFO(t *testing.T) {
	a := NewPageAllocator(8)
	all, err := a.Alloc(8)
	if err != nil {
		t.Fatal(err)
	}
	order := make(chan string, 2)
	pages := make(chan []int32, 2)
	wait := func(name string, n int) {
		p, err := a.AllocWait(context.Background(), n)
		if err != nil {
			t.Error(err)
		}
		pages <- p
		order <- name
	}
	go wait("whole pool", 8)
	waitQueued(t, a, 1)
	go wait("small", 1)
	waitQueued(t, a, 2)
	if err := a.Free(all[:1]); err != nil { // enough for the small one only
		t.Fatal(err)
	}
	if err := a.Free(all[1:]); err != nil {
		t.Fatal(err)
	}
	if first := <-order; first != "whole pool" {
		t.Fatalf("%s was served first, want the whole-pool request queued before it", first)
	}
	if err := a.Free(<-pages); err != nil {
		t.Fatal(err)
	}
	if second := <-order; second != "small" {
		t.Fatalf("second %s", second)
	}
	if err := a.Free(<-pages); err != nil {
		t.Fatal(err)
	}

	// The head gives up: the one behind it is served.
	held, _ := a.Alloc(8)
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan error, 1)
	go func() { _, err := a.AllocWait(ctx, 8); gaveUp <- err }()
	waitQueued(t, a, 1)
	small := make(chan error, 1)
	go func() { _, err := a.AllocWait(context.Background(), 1); small <- err }()
	waitQueued(t, a, 2)
	if err := a.Free(held[:1]); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-gaveUp; !errors.Is(err, context.Canceled) || !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("canceled head: %v", err)
	}
	if err := <-small; err != nil {
		t.Fatalf("the request behind a canceled head: %v", err)
	}
	if n := a.Waiting(); n != 0 {
		t.Fatalf("%d still queued", n)
	}
}
