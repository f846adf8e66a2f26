package main

import (
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
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
