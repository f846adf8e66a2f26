//go:build cgo

package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// TestKVConfigAuthToken: a prefill KV manager created through the C ABI's
// path (newKV, as kvx_kv_create) registers with a directory that requires a
// token when kvx_kv_config.bootstrap_auth_token carries it, or the
// environment does; without either the error says the directory requires a
// token and names the variable.
func TestKVConfigAuthToken(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := server.New(server.Options{Host: "127.0.0.1", AuthToken: "tok", Logger: slog.New(slog.DiscardHandler)})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	tr, err := engine.OpenTransport("tcp", engine.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	e := &engineObj{role: 0, bootstrapAddr: srv.Addr(), tr: tr, trs: []engine.Transport{tr}}
	kc := func(token string) kvConfig {
		return kvConfig{modelName: "llama-3.1-8b", layout: workload.LayoutOptions{PageSize: 16, NumPages: 4},
			bootstrapTimeout: 3 * time.Second, waitingTimeout: 3 * time.Second, authToken: token}
	}
	t.Setenv("KVXFER_BOOTSTRAP_AUTH_TOKEN", "")
	t.Setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "")
	if _, err := newKV(e, kc("")); err == nil || !strings.Contains(err.Error(), "the directory requires a token") ||
		!strings.Contains(err.Error(), "KVXFER_BOOTSTRAP_AUTH_TOKEN") {
		t.Fatalf("without a token: %v, want the token hint", err)
	}
	k, err := newKV(e, kc("tok"))
	if err != nil {
		t.Fatalf("with bootstrap_auth_token: %v", err)
	}
	if err := k.close(); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "tok")
	k, err = newKV(e, kc(""))
	if err != nil {
		t.Fatalf("with SGLang's environment variable: %v", err)
	}
	if err := k.close(); err != nil {
		t.Fatal(err)
	}
	if n := srv.Snapshot().Registered; n != 0 {
		t.Fatalf("%d ranks left registered after close: the deregistration did not carry the token", n)
	}
}
