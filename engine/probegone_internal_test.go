package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/kvxfer/kvxfer/internal/testenv"
)

// TestProbeGone: the reset-healing probe's dial (connectionDropped) takes a
// peer for gone only when nothing listens, there is no route, or the dial
// timed out; a reset or abort of the probe's own connection (an `ss -K` of
// the peer's connections kills it too) leaves the peer the reconnect wait.
// The chaos soak found a live decode's Success room failed on the prefill
// alone because a reset probe was taken for a dead process.
func TestProbeGone(t *testing.T) {
	dialErr := func(errno syscall.Errno) error {
		return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", errno)}
	}
	for _, c := range []struct {
		name string
		err  error
		gone bool
	}{
		{"refused", dialErr(syscall.ECONNREFUSED), true},
		{"host unreachable", dialErr(syscall.EHOSTUNREACH), true},
		{"network unreachable", dialErr(syscall.ENETUNREACH), true},
		{"connect timed out", dialErr(syscall.ETIMEDOUT), true},
		{"dial deadline", &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{"context deadline", fmt.Errorf("dial: %w", context.DeadlineExceeded), true},
		{"reset by peer", dialErr(syscall.ECONNRESET), false},
		{"aborted", dialErr(syscall.ECONNABORTED), false},
		{"broken pipe", dialErr(syscall.EPIPE), false},
		{"other", errors.New("something else"), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := probeGone(c.err); got != c.gone {
				t.Errorf("probeGone(%v) = %v, want %v", c.err, got, c.gone)
			}
		})
	}
}

// TestDialProbeGoneRefused: a real dial of a port nothing listens on is
// refused and means gone.
func TestDialProbeGoneRefused(t *testing.T) {
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.DeadPort(t)) // bound, never listening: refused
	why, gone := dialProbeGone("tcp://" + addr)
	if !gone || why == "" {
		t.Errorf("dial of closed port %s: why %q gone %v, want a reason and gone", addr, why, gone)
	}
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	if why, gone := dialProbeGone("tcp://" + ln2.Addr().String()); gone || why != "" {
		t.Errorf("dial of a listener: why %q gone %v, want neither", why, gone)
	}
}
