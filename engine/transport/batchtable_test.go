package transport

import (
	"context"
	"errors"
	"testing"
	"time"
)

// fakeBatch is a TableBatch whose state the test sets.
type fakeBatch struct {
	st   BatchStatus
	done chan struct{}
}

func (b *fakeBatch) Status() BatchStatus   { return b.st }
func (b *fakeBatch) Done() <-chan struct{} { return b.done }
func (b *fakeBatch) Terminal() bool        { return b.st.State.Terminal() }

func (b *fakeBatch) end(s BatchState) { b.st.State = s; close(b.done) }

func TestBatchTable(t *testing.T) {
	tb := NewBatchTable[*fakeBatch]("tcp")
	a := &fakeBatch{done: make(chan struct{})}
	b := &fakeBatch{done: make(chan struct{}), st: BatchStatus{BytesDone: 7}}
	if id := tb.Add(a); id != 1 {
		t.Fatalf("first ID %d, want 1", id)
	}
	if id := tb.Add(b); id != 2 {
		t.Fatalf("second ID %d, want 2", id)
	}
	for _, tc := range []struct {
		name    string
		id      BatchID
		want    *fakeBatch
		wantErr string
	}{
		{"first", 1, a, ""},
		{"second", 2, b, ""},
		{"never returned", 3, nil, "tcp: batch 3: unknown batch"},
		{"zero", 0, nil, "tcp: batch 0: unknown batch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tb.Get(tc.id)
			if tc.wantErr != "" {
				if !errors.Is(err, ErrUnknownBatch) || err.Error() != tc.wantErr {
					t.Fatalf("Get(%d): %v, want %q wrapping ErrUnknownBatch", tc.id, err, tc.wantErr)
				}
				if _, perr := tb.Poll(tc.id); !errors.Is(perr, ErrUnknownBatch) {
					t.Fatalf("Poll(%d): %v", tc.id, perr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("Get(%d) = %p, %v; want %p", tc.id, got, err, tc.want)
			}
		})
	}
	if st, err := tb.Poll(2); err != nil || st.BytesDone != 7 || st.State != BatchPending {
		t.Fatalf("Poll(2) = %+v, %v", st, err)
	}

	// Wait on a pending batch ends with ctx's error, prefixed and wrapped.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if st, err := tb.Wait(ctx, 1); !errors.Is(err, context.Canceled) || err.Error() != "tcp: wait for batch 1: context canceled" || st.State != BatchPending {
		t.Fatalf("Wait on a pending batch with a canceled ctx: %+v, %v", st, err)
	}
	// Release keeps a pending batch.
	tb.Release(1)
	if _, err := tb.Get(1); err != nil {
		t.Fatalf("pending batch released: %v", err)
	}
	a.end(BatchCompleted)
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if st, err := tb.Wait(wctx, 1); err != nil || st.State != BatchCompleted {
		t.Fatalf("Wait on a completed batch: %+v, %v", st, err)
	}
	if n := len(tb.All()); n != 2 {
		t.Fatalf("All: %d batches, want 2", n)
	}
	tb.Release(1)
	tb.Release(1)  // twice: ignored
	tb.Release(99) // unknown: ignored
	if _, err := tb.Get(1); !errors.Is(err, ErrUnknownBatch) {
		t.Fatalf("released batch still known: %v", err)
	}
	if all := tb.All(); len(all) != 1 || all[0] != b {
		t.Fatalf("All after Release: %v", all)
	}
	// IDs are not reused after a release.
	if id := tb.Add(&fakeBatch{done: make(chan struct{})}); id != 3 {
		t.Fatalf("ID after a release %d, want 3", id)
	}
}
