package transport

import (
	"context"
	"fmt"
	"sync"
)

// TableBatch is what a BatchTable needs from a transport's batch type.
type TableBatch interface {
	// Status returns the batch's current status (Err set once terminal).
	Status() BatchStatus
	// Done returns a channel closed when the batch reaches a terminal state.
	Done() <-chan struct{}
	// Terminal reports whether the batch has ended, so that Release may
	// forget it.
	Terminal() bool
}

// BatchTable is a segment's table of submitted transfer batches, shared by
// the transports so that Poll, Wait and Release behave the same everywhere:
// IDs are 1, 2, 3, … per table; an ID never returned by Add, or already
// released, gives ErrUnknownBatch; Release forgets only terminal batches.
// Owner prefixes the errors ("tcp", "shm"). A table is not the segment's
// lock: a segment that must check its own state and insert atomically calls
// Add under its own mutex. Safe for concurrent use; create it with
// NewBatchTable.
type BatchTable[B TableBatch] struct {
	owner string
	mu    sync.Mutex
	next  BatchID
	m     map[BatchID]B
}

// NewBatchTable returns an empty table whose errors start with owner.
func NewBatchTable[B TableBatch](owner string) *BatchTable[B] {
	return &BatchTable[B]{owner: owner, next: 1, m: map[BatchID]B{}}
}

// Add stores b under the next ID and returns the ID.
func (t *BatchTable[B]) Add(b B) BatchID {
	t.mu.Lock()
	defer t.mu.Unlock()
	id := t.next
	t.next++
	t.m[id] = b
	return id
}

// Get returns the batch with this ID. Errors: "<owner>: batch <id>: …"
// wrapping ErrUnknownBatch.
func (t *BatchTable[B]) Get(id BatchID) (B, error) {
	t.mu.Lock()
	b, ok := t.m[id]
	t.mu.Unlock()
	if !ok {
		return b, fmt.Errorf("%s: batch %d: %w", t.owner, id, ErrUnknownBatch)
	}
	return b, nil
}

// Poll returns the batch's status without blocking (Segment.Poll).
func (t *BatchTable[B]) Poll(id BatchID) (BatchStatus, error) {
	b, err := t.Get(id)
	if err != nil {
		return BatchStatus{}, err
	}
	return b.Status(), nil
}

// Wait blocks until the batch is terminal or ctx ends; then it returns the
// current status and an error "<owner>: wait for batch <id>: …" wrapping
// ctx's error (Segment.Wait).
func (t *BatchTable[B]) Wait(ctx context.Context, id BatchID) (BatchStatus, error) {
	b, err := t.Get(id)
	if err != nil {
		return BatchStatus{}, err
	}
	select {
	case <-b.Done():
		return b.Status(), nil
	case <-ctx.Done():
		return b.Status(), fmt.Errorf("%s: wait for batch %d: %w", t.owner, id, ctx.Err())
	}
}

// Release forgets a terminal batch; a pending or unknown one is ignored
// (Segment.Release).
func (t *BatchTable[B]) Release(id BatchID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if b, ok := t.m[id]; ok && b.Terminal() {
		delete(t.m, id)
	}
}

// All returns the batches not yet released, in no particular order.
func (t *BatchTable[B]) All() []B {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]B, 0, len(t.m))
	for _, b := range t.m {
		out = append(out, b)
	}
	return out
}
