package rdma_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
)

// startBootstrap starts a bootstrap directory on a free loopback port for
// the test's lifetime and returns its host:port.
func startBootstrap(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		t.Fatalf("bootstrap server: %v", err)
	case <-time.After(20 * time.Second):
		cancel()
		t.Fatal("bootstrap server did not start")
	}
	t.Cleanup(func() { cancel(); <-done })
	return srv.Addr()
}
