//go:build cgo

package main

import (
	"context"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
)

// bootstrapObj is one kvx_bootstrap_t: an embedded bootstrap server serving
// from a goroutine until stop.
type bootstrapObj struct {
	srv    *server.Server
	cancel context.CancelFunc
	done   chan error
}

// startBootstrap starts a server on host:port and returns once it listens
// (or failed to).
func startBootstrap(host string, port int) (*bootstrapObj, error) {
	if host == "" {
		host = "127.0.0.1"
	}
	srv := server.New(server.Options{Host: host, Port: port})
	ctx, cancel := context.WithCancel(context.Background())
	b := &bootstrapObj{srv: srv, cancel: cancel, done: make(chan error, 1)}
	go func() { b.done <- srv.Start(ctx) }()
	t := time.NewTimer(opTimeout)
	defer t.Stop()
	select {
	case <-srv.Ready():
		return b, nil
	case err := <-b.done:
		cancel()
		return nil, failWrap(stBootstrap, err, "kvx_bootstrap_start: %s port %d", host, port)
	case <-t.C:
		cancel()
		return nil, fail(stTimeout, "kvx_bootstrap_start: %s port %d not listening after %v", host, port, opTimeout)
	}
}

// stop shuts the server down gracefully and waits for it.
func (b *bootstrapObj) stop() error {
	b.cancel()
	if err := <-b.done; err != nil {
		return failWrap(stBootstrap, err, "kvx_bootstrap_stop")
	}
	return nil
}
