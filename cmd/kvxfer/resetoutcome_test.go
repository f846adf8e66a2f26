package main

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
)

// TestResetOutcomeLevels: a reset fault that finds nothing to reset is an
// ordinary outcome, logged at Info saying nothing was reset (before:
// level=ERROR msg="chaos: ctlreset" err=<nil> reset=0); a failed ss -K
// stays an error naming its cause; a reset counts as the fault itself.
func TestResetOutcomeLevels(t *testing.T) {
	cases := []struct {
		name      string
		ports     []string
		n         int
		err       error
		kind      string
		reset     bool
		level     string
		wantInLog string
	}{
		{"nothing on the ports", []string{"4000"}, 0, nil, "ctlreset (nothing to reset)", false, "level=INFO", "nothing was reset"},
		{"no port", nil, 0, errors.New("no port to reset"), "ctlreset (nothing to reset)", false, "level=INFO", "nothing was reset"},
		{"ss failed", []string{"4000"}, 0, errors.New("ss -K (needs root and CONFIG_INET_DIAG_DESTROY): exit status 1"), "ctlreset (failed)", false, "level=ERROR", "needs root"},
		{"reset two", []string{"4000", "4001"}, 2, nil, "ctlreset", true, "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var buf bytes.Buffer
			log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
			kind, reset := resetOutcome(log, "ctlreset", c.ports, c.n, c.err)
			if kind != c.kind || reset != c.reset {
				t.Errorf("resetOutcome = %q, %v; want %q, %v", kind, reset, c.kind, c.reset)
			}
			out := buf.String()
			if c.level == "" {
				if out != "" {
					t.Errorf("a reset logged %q, want nothing", out)
				}
				return
			}
			if !strings.Contains(out, c.level) || !strings.Contains(out, c.wantInLog) || strings.Contains(out, "err=<nil>") {
				t.Errorf("logged %q, want %s naming %q (and no err=<nil>)", out, c.level, c.wantInLog)
			}
		})
	}
}
