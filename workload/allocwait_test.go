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
