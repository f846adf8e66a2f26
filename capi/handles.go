//go:build cgo

package main

import (
	"sync"
	"sync/atomic"
)

// nextHandle is shared by every table so that a handle of one kind is never a
// valid handle of another kind, and a destroyed handle is never reissued.
var nextHandle atomic.Uint64

// table maps handles given to C to the Go objects they name. It is safe for
// concurrent use.
type table[T any] struct {
	mu sync.Mutex
	m  map[uint64]T
}

func newTable[T any]() *table[T] { return &table[T]{m: map[uint64]T{}} }

// add stores v and returns its new handle (never 0).
func (t *table[T]) add(v T) uint64 {
	h := nextHandle.Add(1)
	t.mu.Lock()
	t.m[h] = v
	t.mu.Unlock()
	return h
}

// get returns the object named by h.
func (t *table[T]) get(h uint64) (T, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	return v, ok
}

// take removes h and returns its object; exactly one caller gets ok == true,
// which makes destroy idempotent-safe under races.
func (t *table[T]) take(h uint64) (T, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	if ok {
		delete(t.m, h)
	}
	return v, ok
}
