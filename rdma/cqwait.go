package rdma

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/ibverbs"
)

// cqNotifier turns the events of one completion channel into wake-ups of a
// segment's pump through Go's netpoller: its goroutine parks until the
// channel's fd is readable (no OS thread blocks, nothing polls), consumes
// and acknowledges every pending event, and signals out (capacity 1, never
// blocks). The pump arms its CQs (ReqNotify) before it waits.
type cqNotifier struct {
	ch      *ibverbs.CompChannel
	f       *os.File // a dup of ch.FD(), registered with the netpoller
	out     chan<- struct{}
	err     error // why the loop stopped early (read by the pump after done)
	done    chan struct{}
	closing atomic.Bool
}

// newCQNotifier starts watching ch. Errors: the fd cannot be duplicated or
// registered with the netpoller.
func newCQNotifier(ch *ibverbs.CompChannel, out chan<- struct{}) (*cqNotifier, error) {
	fd := ch.FD()
	if fd < 0 {
		return nil, fmt.Errorf("completion channel is closed")
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup completion channel fd %d: %w", fd, err)
	}
	// The dup shares the open file description, so it is non-blocking
	// like the original and os.NewFile registers it with the netpoller.
	f := os.NewFile(uintptr(dup), "rdma-completion-channel")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("completion channel fd: %w", err)
	}
	n := &cqNotifier{ch: ch, f: f, out: out, done: make(chan struct{})}
	go n.loop(rc)
	return n, nil
}

func (n *cqNotifier) loop(rc syscall.RawConn) {
	defer close(n.done)
	var gerr error
	got := false
	drain := func(uintptr) bool {
		for {
			ok, err := n.ch.TryGet()
			if err != nil {
				gerr = err
				return true
			}
			if !ok {
				return got // nothing (more) pending: wait unless we got some
			}
			got = true
		}
	}
	for {
		got, gerr = false, nil
		if err := rc.Read(drain); err != nil {
			if !n.closing.Load() {
				n.err = err
			}
			return
		}
		if gerr != nil {
			if !errors.Is(gerr, ibverbs.ErrClosed) {
				n.err = gerr
			}
			return
		}
		select {
		case n.out <- struct{}{}:
		default:
		}
	}
}

// close stops the goroutine and releases the dup; the channel itself stays
// open (destroy its CQs, then Close it). Idempotent.
func (n *cqNotifier) close() {
	n.closing.Store(true)
	n.f.Close()
	<-n.done
}
