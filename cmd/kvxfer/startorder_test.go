package main

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// TestSecondPrefillBusyListenerLeavesEntry: a second prefill for a live
// rank's coordinates whose --metrics-addr (or --serve address) is taken
// fails naming that address, and the directory's entry for the rank (GET
// /route) still names the first prefill: the listeners are bound before the
// rank registers, so a rank that cannot start never replaces a live one.
func TestSecondPrefillBusyListenerLeavesEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	first := startProc(t, "prefill 1", nil, roleArgs("prefill", addr, "127.0.0.1", "--metrics-addr", "127.0.0.1:0")...)
	rd := first.ready()
	bc, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	route := func(t *testing.T) *bootstrap.PrefillRankInfo {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ri, err := bc.RankInfo(ctx, 0, 0, 0, 0)
		if err != nil {
			t.Fatalf("GET /route for tp0/pp0: %v", err)
		}
		return ri
	}
	before := route(t)
	if before.InstanceID != rd.Instance {
		t.Fatalf("GET /route before: %+v, want the first prefill's instance %s", before, rd.Instance)
	}
	cases := []struct {
		name  string
		extra []string
		want  string
	}{
		{"metrics-addr taken", []string{"--metrics-addr", rd.Metrics}, rd.Metrics},
		{"serve taken", []string{"--serve", "http://" + busy.Addr().String()}, busy.Addr().String()},
		{"serve unix dir missing", []string{"--serve", "unix:" + filepath.Join(t.TempDir(), "no-such-dir", "rank.sock")}, "no-such-dir"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			second := startProc(t, "prefill 2", nil, roleArgs("prefill", addr, "127.0.0.1", c.extra...)...)
			err := second.wait(time.Minute)
			if exitCode(err) != 1 || !strings.Contains(second.stderr.String(), c.want) {
				t.Fatalf("second prefill: exit %v, want 1 with a message naming %s:\n%s", err, c.want, second.stderr.String())
			}
			after := route(t)
			if *after != *before {
				t.Fatalf("GET /route after the second prefill failed: %+v, want the first prefill's entry unchanged %+v\n%s", after, before, second.stderr.String())
			}
		})
	}
	if err := first.exit(time.Minute); err != nil {
		t.Fatalf("first prefill exit: %v\n%s", err, first.stderr.String())
	}
}
