// Package testenv holds what the module's tests need from their
// environment, so that each gate and fixture exists once: gates that skip a
// test with the reason when a tool or device is missing (and fail instead
// where the environment promises it: KVXFER_REQUIRE_GPU on the GPU
// machine, KVXFER_REQUIRE_RDMA inside `make test-rdma`), and small loopback
// fixtures. It is imported by _test.go files only.
package testenv

import (
	"net"
	"testing"
)

// SilentListener accepts TCP connections on a free loopback port and never
// answers (a hung peer, or something that is not a kvxfer peer); it and
// its connections are closed when the test ends.
func SilentListener(tb testing.TB) net.Listener {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	return ln
}
