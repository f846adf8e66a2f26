//go:build cgo

package main

// The C trampoline: Go cannot call a C function pointer, so the notifier
// hands the pointer to kvx__call_notify (trampoline.c), which calls it and
// marks the thread as "inside a callback" so that re-entrant calls that would
// deadlock (set_notify, engine_destroy) fail with KVX_ERR_BUSY instead.

/*
#define KVX_TYPES_ONLY 1
#include <stdlib.h>
#include "capi.h"
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// event is kvx_event in Go types.
type event struct {
	kind   int32
	status status
	handle uint64
	first  uint32
	count  uint32
	room   uint64
	state  int32
}

const (
	eventKindBatch = 1
	eventKindRoom  = 2
)

func eventBatch(h uint64, p *batchPart) event {
	code := stOK
	if p.st.State != transport.BatchCompleted {
		code = codeOf(p.st.Err)
	}
	return event{kind: eventKindBatch, status: code, handle: h, first: p.first, count: p.count, state: transferState(p.st.State)}
}

// notifier delivers events to one engine's C callback from one goroutine, in
// order. It is safe for concurrent use.
type notifier struct {
	callMu sync.Mutex // held while the callback runs and while it is swapped
	fn     C.kvx_notify_fn
	ud     unsafe.Pointer

	mu      sync.Mutex
	cond    *sync.Cond
	queue   []event
	stopped bool
	done    chan struct{}
}

func newNotifier() *notifier {
	n := &notifier{done: make(chan struct{})}
	n.cond = sync.NewCond(&n.mu)
	go n.run()
	return n
}

// inCallback reports whether the calling C thread is inside a notification
// callback.
func inCallback() bool { return C.kvx__in_notify() != 0 }

// set installs (fn != nil) or removes the callback; when it returns the old
// callback is not running.
func (n *notifier) set(fn C.kvx_notify_fn, ud unsafe.Pointer) {
	n.callMu.Lock()
	n.fn, n.ud = fn, ud
	n.callMu.Unlock()
}

// post queues an event; it never blocks. Events with no callback installed
// at delivery time are dropped.
func (n *notifier) post(ev event) {
	n.mu.Lock()
	if !n.stopped {
		n.queue = append(n.queue, ev)
		n.cond.Signal()
	}
	n.mu.Unlock()
}

// stop delivers nothing more and waits for the dispatcher to exit.
func (n *notifier) stop() {
	n.mu.Lock()
	n.stopped = true
	n.cond.Signal()
	n.mu.Unlock()
	<-n.done
}

func (n *notifier) run() {
	defer close(n.done)
	for {
		n.mu.Lock()
		for len(n.queue) == 0 && !n.stopped {
			n.cond.Wait()
		}
		if n.stopped {
			n.mu.Unlock()
			return
		}
		ev := n.queue[0]
		n.queue = n.queue[1:]
		n.mu.Unlock()
		n.deliver(ev)
	}
}

func (n *notifier) deliver(ev event) {
	n.callMu.Lock()
	defer n.callMu.Unlock()
	if n.fn == nil {
		return
	}
	cev := (*C.kvx_event)(C.calloc(1, C.sizeof_kvx_event))
	defer C.free(unsafe.Pointer(cev))
	cev.kind = C.int32_t(ev.kind)
	cev.status = C.int32_t(ev.status)
	cev.handle = C.uint64_t(ev.handle)
	cev.first = C.uint32_t(ev.first)
	cev.count = C.uint32_t(ev.count)
	cev.room = C.uint64_t(ev.room)
	cev.state = C.int32_t(ev.state)
	C.kvx__call_notify(n.fn, n.ud, cev)
}
