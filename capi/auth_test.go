//go:build cgo

package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// directoryAndEngine starts a bootstrap directory (requiring token when not
// empty) and a prefill engine object with a tcp transport pointing at it, as
// kvx_engine_create would make; the test's cleanup stops both.
func directoryAndEngine(t *testing.T, token string) (*server.Server, *engineObj) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := server.New(server.Options{Host: "127.0.0.1", AuthToken: token, Logger: slog.New(slog.DiscardHandler)})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); <-done })
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return srv, &engineObj{role: 0, bootstrapAddr: srv.Addr(), tr: tr, trs: []transport.Transport{tr}}
}

// TestKVConfigAuthToken: a prefill KV manager created through the C ABI's
// path (newKV, as kvx_kv_create) registers with a directory that requires a
// token when kvx_kv_config.bootstrap_auth_token carries it, or the
// environment does; without either the error says the directory requires a
// token and names the variable.
func TestKVConfigAuthToken(t *testing.T) {
	srv, e := directoryAndEngine(t, "tok")
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

// TestControlSettings: kvx_kv_config.control_auth / max_peers win over the
// environment (KVXFER_CONTROL_AUTH, KVXFER_MAX_PEERS), which fills in what
// the caller left 0; with neither, control authentication is on exactly
// when the rank has a bootstrap token (issue 22 case 4); bad values are
// refused naming the field or variable.
func TestControlSettings(t *testing.T) {
	for _, tc := range []struct {
		name      string
		auth, max uint32
		env       map[string]string
		wantAuth  bool
		wantMax   int
		err       string
	}{
		{name: "defaults"},
		{name: "token: on by default", env: map[string]string{"KVXFER_BOOTSTRAP_AUTH_TOKEN": "t"}, wantAuth: true},
		{name: "SGLang token: on by default", env: map[string]string{"SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN": "t"}, wantAuth: true},
		{name: "token, env off", env: map[string]string{"KVXFER_BOOTSTRAP_AUTH_TOKEN": "t", "KVXFER_CONTROL_AUTH": "0"}},
		{name: "token, field off", auth: controlAuthOff, env: map[string]string{"KVXFER_BOOTSTRAP_AUTH_TOKEN": "t"}},
		{name: "env on", env: map[string]string{"KVXFER_CONTROL_AUTH": "1", "KVXFER_MAX_PEERS": "16"}, wantAuth: true, wantMax: 16},
		{name: "env off", env: map[string]string{"KVXFER_CONTROL_AUTH": "0"}},
		{name: "field on", auth: controlAuthOn, max: 8, wantAuth: true, wantMax: 8},
		{name: "field on beats env off", auth: controlAuthOn, env: map[string]string{"KVXFER_CONTROL_AUTH": "0"}, wantAuth: true},
		{name: "field off beats env on", auth: controlAuthOff, env: map[string]string{"KVXFER_CONTROL_AUTH": "1"}},
		{name: "field max beats env", max: 4, env: map[string]string{"KVXFER_MAX_PEERS": "16"}, wantMax: 4},
		{name: "bad field", auth: 3, err: "cfg->control_auth is 3"},
		{name: "bad env auth", env: map[string]string{"KVXFER_CONTROL_AUTH": "yes"}, err: `KVXFER_CONTROL_AUTH="yes"`},
		{name: "bad env max", env: map[string]string{"KVXFER_MAX_PEERS": "0"}, err: `KVXFER_MAX_PEERS="0"`},
		{name: "huge field max", max: 1<<20 + 1, err: "cfg->max_peers is 1048577"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := func(k string) string { return tc.env[k] }
			auth, maxPeers, err := controlSettings(kvConfig{controlAuth: tc.auth, maxPeers: tc.max}, env)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one naming %q", err, tc.err)
				}
				return
			}
			if err != nil || auth != tc.wantAuth || maxPeers != tc.wantMax {
				t.Fatalf("got auth %v max %d err %v, want %v %d", auth, maxPeers, err, tc.wantAuth, tc.wantMax)
			}
		})
	}
}

// TestKVConfigDeclarations: kvx_kv_config.decode_allocation_policy,
// dsv41_spec_layout and prefill_http_port reach the prefill rank's
// registration (the directory's topology answer carries them), and a value
// SGLang does not take fails kvx_kv_create's path naming the C field.
func TestKVConfigDeclarations(t *testing.T) {
	srv, e := directoryAndEngine(t, "")
	kc := func(policy, layout string, port uint32) kvConfig {
		return kvConfig{modelName: "llama-3.1-8b", layout: workload.LayoutOptions{PageSize: 16, NumPages: 4},
			bootstrapTimeout: 3 * time.Second, waitingTimeout: 3 * time.Second, allocPolicy: policy, specLayout: layout, httpPort: port}
	}
	for _, tc := range []struct {
		policy, layout string
		port           uint32
		want           string
	}{
		{"eager", "", 0, "cfg->decode_allocation_policy"},
		{"", "[1, 2]", 0, "cfg->dsv41_spec_layout"},
		{"", "", 70000, "cfg->prefill_http_port 70000"},
	} {
		if _, err := newKV(e, kc(tc.policy, tc.layout, tc.port)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("policy %q layout %q port %d: %v, want an error naming %s", tc.policy, tc.layout, tc.port, err, tc.want)
		}
	}
	k, err := newKV(e, kc("prefill_complete", `{"block_size": 64}`, 30000))
	if err != nil {
		t.Fatal(err)
	}
	defer k.close()
	top := srv.Snapshot().Topology
	if top == nil || top.AllocationPolicy() != "prefill_complete" || string(top.DSV41SpecLayout) != `{"block_size":64}` ||
		top.PrefillHTTPPort == nil || *top.PrefillHTTPPort != 30000 {
		t.Fatalf("topology %+v", top)
	}
}
