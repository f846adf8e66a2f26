package main

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// newBootstrapTestCmd returns a command with the bootstrap flags, so that
// Changed() reflects only the args given.
func newBootstrapTestCmd(t *testing.T, args ...string) (*cobra.Command, *bootstrapFlags) {
	t.Helper()
	f := &bootstrapFlags{port: 8998, entryTTL: 120 * time.Second}
	cmd := &cobra.Command{Use: "bootstrap"}
	cmd.Flags().IntVar(&f.port, "port", 8998, "")
	cmd.Flags().DurationVar(&f.entryTTL, "entry-ttl", 120*time.Second, "")
	cmd.Flags().StringVar(&f.authToken, "auth-token", "", "")
	if err := cmd.Flags().Parse(args); err != nil {
		t.Fatal(err)
	}
	return cmd, f
}

func TestApplyBootstrapEnv(t *testing.T) {
	cases := []struct {
		name  string
		args  []string
		env   map[string]string
		port  int
		ttl   time.Duration
		token string
		err   string
	}{
		{"defaults", nil, nil, 8998, 120 * time.Second, "", ""},
		{"kvxfer env", nil, map[string]string{"KVXFER_BOOTSTRAP_PORT": "9000", "KVXFER_BOOTSTRAP_ENTRY_TTL": "30s", "KVXFER_BOOTSTRAP_AUTH_TOKEN": "a"}, 9000, 30 * time.Second, "a", ""},
		{"sglang env names", nil, map[string]string{"SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": "2.5", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN": "b"}, 8998, 2500 * time.Millisecond, "b", ""},
		{"flags win", []string{"--port", "1234", "--entry-ttl", "5s"}, map[string]string{"KVXFER_BOOTSTRAP_PORT": "9000", "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": "7"}, 1234, 5 * time.Second, "", ""},
		{"bad port env", nil, map[string]string{"KVXFER_BOOTSTRAP_PORT": "http"}, 0, 0, "", "KVXFER_BOOTSTRAP_PORT"},
		{"bad sglang ttl", nil, map[string]string{"SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": "-1"}, 0, 0, "", "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL"},
		{"bad ttl flag", []string{"--entry-ttl", "0s"}, nil, 0, 0, "", "--entry-ttl"},
		{"bad port flag", []string{"--port", "70000"}, nil, 0, 0, "", "--port"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cmd, f := newBootstrapTestCmd(t, tc.args...)
			err := applyBootstrapEnv(cmd, f, func(k string) string { return tc.env[k] })
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want one naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f.port != tc.port || f.entryTTL != tc.ttl || f.authToken != tc.token {
				t.Fatalf("got port %d ttl %s token %q, want %d %s %q", f.port, f.entryTTL, f.authToken, tc.port, tc.ttl, tc.token)
			}
		})
	}
}

// TestBootstrapCommandServes runs `kvxfer bootstrap --host 127.0.0.1 --port P`
// in process, waits for /health, checks SGLang's 503 and a registration, and
// stops it through the context (as SIGTERM would).
func TestBootstrapCommandServes(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_, port, _ := net.SplitHostPort(addr)
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	rootCmd.SetArgs([]string{"bootstrap", "--host", "127.0.0.1", "--port", port, "--log-level", "warn"})
	t.Cleanup(func() { rootCmd.SetArgs(nil) })
	go func() { done <- rootCmd.ExecuteContext(ctx) }()
	c, err := bootstrap.NewClient(addr, bootstrap.WithRegisterTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for c.Health(ctx) != nil {
		select {
		case err := <-done:
			t.Fatalf("kvxfer bootstrap exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("kvxfer bootstrap not answering /health after 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := c.ServerInfo(ctx); !errors.Is(err, bootstrap.ErrNotReady) {
		t.Fatalf("ServerInfo on an empty directory: %v, want ErrNotReady", err)
	}
	dtype := "auto"
	if err := c.Register(ctx, bootstrap.RegisterRequest{AttnTPSize: 1, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
		RankIP: "127.0.0.1", RankPort: 5555, PageSize: 1, KVCacheDtype: &dtype}); err != nil {
		t.Fatal(err)
	}
	if info, err := c.ServerInfo(ctx); err != nil || info.AttnTPSize != 1 {
		t.Fatalf("ServerInfo = %+v, %v", info, err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("kvxfer bootstrap returned %v after shutdown", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("kvxfer bootstrap did not stop within 10 s")
	}
}

// TestBootstrapBadHost: `kvxfer bootstrap --host 999.1.1.1` says the host is
// unusable and what to pass, without the port-in-use hint.
func TestBootstrapBadHost(t *testing.T) {
	for _, host := range []string{"999.1.1.1", "192.0.2.1"} {
		cmd, f := newBootstrapTestCmd(t, "--port", "0")
		f.host, f.compat = host, bootstrap.CompatSGLang0094505
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := runBootstrap(ctx, cmd, *f)
		cancel()
		if err == nil {
			t.Fatalf("--host %s: server started", host)
		}
		msg := err.Error()
		if !strings.Contains(msg, host) || !strings.Contains(msg, "127.0.0.1") || !strings.Contains(msg, "0.0.0.0") || strings.Contains(msg, "another bootstrap server") {
			t.Errorf("--host %s: %q, want the host named with the hosts that work and no port hint", host, msg)
		}
	}
}
