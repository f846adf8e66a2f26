//go:build cgo

package main

import (
	"context"
	"time"

	"github.com/kvxfer/kvxfer/metadata/httpmeta"
)

// metaServerObj is one kvx_metadata_server_t: an embedded HTTP metadata
// server (Mooncake's /metadata routes) serving from a goroutine until stop.
type metaServerObj struct {
	srv    *httpmeta.Server
	cancel context.CancelFunc
	done   chan error
}

// startMetaServer starts a server on host:port ("" = 127.0.0.1) and
// returns once it listens (or failed to: KVX_ERR_UNAVAILABLE naming why).
func startMetaServer(host string, port int) (*metaServerObj, error) {
	const op = "kvx_metadata_server_start"
	if host == "" {
		host = "127.0.0.1"
	}
	srv := httpmeta.New(httpmeta.Options{Host: host, Port: port})
	ctx, cancel := context.WithCancel(context.Background())
	m := &metaServerObj{srv: srv, cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- srv.Start(ctx) }()
	t := time.NewTimer(opTimeout)
	defer t.Stop()
	select {
	case <-srv.Ready():
		return m, nil
	case err := <-m.done:
		cancel()
		return nil, failWrap(stUnavailable, err, "%s: %s port %d", op, host, port)
	case <-t.C:
		cancel()
		return nil, fail(stTimeout, "%s: %s port %d not listening after %v", op, host, port, opTimeout)
	}
}

// stop shuts the server down and waits for it.
func (m *metaServerObj) stop() error {
	m.cancel()
	if err := <-m.done; err != nil {
		return failWrap(stUnavailable, err, "kvx_metadata_server_stop")
	}
	return nil
}
