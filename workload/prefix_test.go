package workload

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

func TestPrefixCache(t *testing.T) {
	const ps, bt = 16, 64 // 4 pages per block
	a := NewPageAllocator(200)
	c, err := NewPrefixCache(a, ps, bt, 4)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	alloc := func(n int) ([]int32, error) { return a.Alloc(n) }

	// Request 1: 3 whole blocks + 10 tokens, nothing held.
	l1 := c.Plan(1, []int64{0, 1, 2, 3}, 3*bt+10)
	if l1.PrefixTokens != 0 || c.Blocks() != 3 {
		t.Fatalf("first request: prefix %d, %d blocks indexed", l1.PrefixTokens, c.Blocks())
	}
	// Request 2 shares blocks 0-1, planned while request 1 is in flight.
	l2 := c.Plan(2, []int64{0, 1, 7}, 2*bt+bt)
	if l2.PrefixTokens != 2*bt {
		t.Fatalf("second request: prefix %d, want %d (blocks 0-1 counted while in flight)", l2.PrefixTokens, 2*bt)
	}
	p1, err := l1.Pages(ctx, alloc)
	if err != nil || len(p1) != 13 {
		t.Fatalf("pages of request 1: %v %v", p1, err)
	}
	p2, err := l2.Pages(ctx, alloc)
	if err != nil || len(p2) != 12 || !slices.Equal(p2[:8], p1[:8]) {
		t.Fatalf("pages of request 2: %v %v; want request 1's first 8 pages first", p2, err)
	}
	done := make(chan []PrefixSegment)
	go func() {
		segs, err := l2.WaitPrefix(ctx)
		if err != nil {
			t.Error(err)
		}
		done <- segs
	}()
	select {
	case <-done:
		t.Fatal("WaitPrefix returned before the owner finished")
	case <-time.After(50 * time.Millisecond):
	}
	l1.Finish(true)
	segs := <-done
	if len(segs) != 2 || segs[0].Room != 1 || segs[1].FirstPage != 4 || !slices.Equal(segs[1].Pages, p1[4:8]) {
		t.Fatalf("segments %+v", segs)
	}
	l2.Finish(true)
	l2.Finish(true) // idempotent
	// Held: request 1's 3 blocks + request 2's block 2 = 4 blocks of 4 pages.
	if c.Blocks() != 4 || a.FreePages() != 200-16 {
		t.Fatalf("%d blocks, %d free pages; want 4 and %d", c.Blocks(), a.FreePages(), 200-16)
	}
	// Prefix never covers the whole prompt: a 2-block prompt holds 1 block.
	l3 := c.Plan(3, []int64{0, 1}, 2*bt)
	if l3.PrefixTokens != bt {
		t.Fatalf("whole-prompt hit: prefix %d, want %d", l3.PrefixTokens, bt)
	}
	if _, err := l3.Pages(ctx, alloc); err != nil {
		t.Fatal(err)
	}
	l3.Finish(true)
	// A new chain evicts the least recently used blocks (capacity 4).
	l4 := c.Plan(4, []int64{9, 10, 11}, 3*bt)
	if l4.PrefixTokens != 0 || c.Blocks() != 4 {
		t.Fatalf("new chain: prefix %d, %d blocks", l4.PrefixTokens, c.Blocks())
	}
	if _, err := l4.Pages(ctx, alloc); err != nil {
		t.Fatal(err)
	}
	l4.Finish(true)
	if a.FreePages() != 200-16 {
		t.Fatalf("%d free pages after eviction, want %d", a.FreePages(), 200-16)
	}
	if l := c.Plan(5, []int64{0, 1, 2}, 3*bt+1); l.PrefixTokens != bt {
		t.Fatalf("after eviction: prefix %d, want %d (block 0 was used most recently)", l.PrefixTokens, bt)
	} else {
		l.Finish(false)
	}
}

func TestPrefixCacheOwnerFails(t *testing.T) {
	a := NewPageAllocator(64)
	c, err := NewPrefixCache(a, 4, 8, 8)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	alloc := func(n int) ([]int32, error) { return a.Alloc(n) }
	l1 := c.Plan(1, []int64{5, 6}, 20)
	l2 := c.Plan(2, []int64{5, 6}, 20)
	if l2.PrefixTokens != 16 {
		t.Fatalf("prefix %d", l2.PrefixTokens)
	}
	if _, err := l1.Pages(ctx, alloc); err != nil {
		t.Fatal(err)
	}
	if _, err := l2.Pages(ctx, alloc); err != nil {
		t.Fatal(err)
	}
	l1.Finish(false)
	if _, err := l2.WaitPrefix(ctx); !errors.Is(err, ErrPrefixLost) {
		t.Fatalf("WaitPrefix after the owner failed: %v, want ErrPrefixLost", err)
	}
	l2.Finish(false)
	if a.FreePages() != 64 || c.Blocks() != 0 {
		t.Fatalf("%d free pages, %d blocks after both failed", a.FreePages(), c.Blocks())
	}
	// An owner that never allocates releases its waiters at Finish.
	l3 := c.Plan(3, []int64{5, 6}, 20)
	l4 := c.Plan(4, []int64{5, 6}, 20)
	l3.Finish(false)
	if _, err := l4.Pages(ctx, alloc); err == nil {
		t.Fatal("pages of a prefix whose owner never allocated")
	}
	l4.Finish(false)
	if a.FreePages() != 64 {
		t.Fatalf("%d free pages", a.FreePages())
	}
	if _, err := NewPrefixCache(a, 16, 100, 1); err == nil {
		t.Fatal("block of 100 tokens over 16-token pages accepted")
	}
}
