//go:build cgo

package cuda

import (
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// Event is a CUDA event created by this package (cudaEventCreateWithFlags
// with cudaEventDisableTiming) on one device: Stream.Record marks a point of
// a stream, Query and Synchronize tell when the work before it is done. It
// is safe for concurrent use; Close destroys it (idempotent), and a cleanup
// destroys a leaked one (counted by Leaked).
type Event struct {
	mu      sync.Mutex
	dev     int
	h       unsafe.Pointer
	cleanup runtime.Cleanup
}

// NewEvent creates an event on dev. Close it when done.
func NewEvent(dev int) (*Event, error) {
	unlock, err := use("create event", dev)
	if err != nil {
		return nil, err
	}
	defer unlock()
	h, err := rawEventCreate(dev)
	if err != nil {
		return nil, err
	}
	e := &Event{dev: dev, h: h}
	e.cleanup = runtime.AddCleanup(e, func(h uintptr) { destroyLeakedEvent(dev, h) }, uintptr(h))
	return e, nil
}

// handle returns the event's handle, or an error wrapping ErrInvalidValue
// once it is closed.
func (e *Event) handle(op string) (unsafe.Pointer, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.h == nil {
		return nil, fmt.Errorf("cuda: %s on a closed event: %w", op, ErrInvalidValue)
	}
	return e.h, nil
}

// Handle is the event as a caller's handle (its cudaEvent_t), valid until
// Close; 0 after Close.
func (e *Event) Handle() EventHandle {
	e.mu.Lock()
	defer e.mu.Unlock()
	return EventHandle{Device: e.dev, Event: uintptr(e.h)}
}

// Device returns the event's device ordinal.
func (e *Event) Device() int { return e.dev }

// Query reports whether the work recorded before the event has completed:
// (true, nil) when it has (or the event was never recorded, as CUDA
// defines it), (false, nil) while it is pending, and an error (an *Error,
// or ErrInvalidValue after Close) when CUDA reports one: that work failed
// or the handle is bad, and it will never complete.
func (e *Event) Query() (bool, error) {
	h, err := e.handle("query")
	if err != nil {
		return false, err
	}
	return EventHandle{Device: e.dev, Event: uintptr(h)}.Query()
}

// Synchronize blocks the calling thread until the recorded work completes
// (cudaEventSynchronize; with the default flags the driver may spin a CPU).
func (e *Event) Synchronize() error {
	h, err := e.handle("synchronize")
	if err != nil {
		return err
	}
	unlock, err := use("synchronize event", e.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawEventSync(e.dev, h)
}

// Close destroys the event; idempotent. Work recorded before it still
// completes (CUDA releases the event then).
func (e *Event) Close() error {
	e.mu.Lock()
	h := e.h
	e.h = nil
	e.mu.Unlock()
	if h == nil {
		return nil
	}
	e.cleanup.Stop()
	unlock, err := use("destroy event", e.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawEventDestroy(e.dev, h)
}

// destroyLeakedEvent is the safety net for an Event never closed.
func destroyLeakedEvent(dev int, h uintptr) {
	leaked.Add(1)
	lib.mu.RLock()
	defer lib.mu.RUnlock()
	if lib.loaded {
		_ = rawEventDestroy(dev, *(*unsafe.Pointer)(unsafe.Pointer(&h)))
	}
}

// Query is cudaEventQuery on the handle: (true, nil) when the work
// recorded before it has completed (or it was never recorded), (false,
// nil) while pending, an error otherwise (a zero handle: ErrInvalidValue;
// a handle CUDA does not know: an *Error matching ErrInvalidValue; a
// failed kernel before the event: that *Error).
func (h EventHandle) Query() (bool, error) {
	if h.Event == 0 {
		return false, fmt.Errorf("cuda: query event: handle is 0: %w", ErrInvalidValue)
	}
	unlock, err := use("query event", h.Device)
	if err != nil {
		return false, err
	}
	defer unlock()
	code, err := rawEventQuery(h.Device, *(*unsafe.Pointer)(unsafe.Pointer(&h.Event)))
	if err != nil {
		return false, err
	}
	return code != codeNotReady, nil
}

// Record enqueues e on the stream: e completes once every operation
// enqueued on s before it has (cudaEventRecord).
func (s *Stream) Record(e *Event) error {
	s.mu.Lock()
	sh := s.h
	s.mu.Unlock()
	if sh == nil {
		return fmt.Errorf("cuda: record event on closed stream: %w", ErrInvalidValue)
	}
	eh, err := e.handle("record")
	if err != nil {
		return err
	}
	if e.dev != s.dev {
		return fmt.Errorf("cuda: record an event of cuda:%d on a stream of cuda:%d: %w", e.dev, s.dev, ErrInvalidValue)
	}
	unlock, err := use("record event", s.dev)
	if err != nil {
		return err
	}
	defer unlock()
	return rawEventRecord(s.dev, eh, sh)
}

// Gate holds a stream at one point until the host opens it: work enqueued
// on the stream after Stream.Gate waits, as it would behind a kernel of
// unknown length. It is a host function on the stream (cudaLaunchHostFunc)
// that returns once Open is called, so it occupies CUDA's callback thread
// meanwhile; tests and the device check use it to decide exactly when a
// layer's KV "is written". Close opens it and frees it.
type Gate struct {
	mu sync.Mutex
	g  unsafe.Pointer // C memory: the host function reads it
}

// Gate enqueues a closed gate on s.
func (s *Stream) Gate() (*Gate, error) {
	s.mu.Lock()
	sh := s.h
	s.mu.Unlock()
	if sh == nil {
		return nil, fmt.Errorf("cuda: gate on closed stream: %w", ErrInvalidValue)
	}
	unlock, err := use("launch host function", s.dev)
	if err != nil {
		return nil, err
	}
	defer unlock()
	g := rawGateNew()
	if g == nil {
		return nil, fmt.Errorf("cuda: gate: %w", ErrOutOfMemory)
	}
	if err := rawGateLaunch(s.dev, sh, g); err != nil {
		rawGateFree(g)
		return nil, err
	}
	return &Gate{g: g}, nil
}

// Open lets the stream run past the gate; idempotent.
func (g *Gate) Open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.g != nil {
		rawGateOpen(g.g)
	}
}

// gateCloseWait bounds how long Close waits for the host function to return
// after opening the gate.
const gateCloseWait = 30 * time.Second

// Close opens the gate, waits (up to 30 s) until its host function has
// returned, and frees it; idempotent. When the host function never ran
// (the stream failed before it) the memory is kept rather than freed under
// it, and an error wrapping ErrNotReady says so.
func (g *Gate) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.g == nil {
		return nil
	}
	rawGateOpen(g.g)
	deadline := time.Now().Add(gateCloseWait)
	for !rawGateDone(g.g) {
		if time.Now().After(deadline) {
			g.g = nil // leaked on purpose: CUDA may still call the function
			return fmt.Errorf("cuda: gate: its host function did not run within %s of opening (the stream is stuck or failed): %w", gateCloseWait, ErrNotReady)
		}
		time.Sleep(100 * time.Microsecond)
	}
	rawGateFree(g.g)
	g.g = nil
	return nil
}
