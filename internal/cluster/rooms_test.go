package cluster

import (
	"context"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine"
)

// TestUnfinishedNamesShutdown: a room cut short by SIGINT/SIGTERM (the
// rank's context cancelled) reports the shutdown, not a timeout that never
// happened; otherwise the state and the bound that was hit.
func TestUnfinishedNamesShutdown(t *testing.T) {
	live := context.Background()
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		ctx       context.Context
		bound     string
		want, not string
	}{
		{gone, " after the bootstrap timeout", "aborted: the rank is shutting down", "bootstrap timeout"},
		{live, " after the bootstrap timeout", "sender still Bootstrapping after the bootstrap timeout", "shutting down"},
	} {
		err := Unfinished(tc.ctx, 7, "sender", engine.KVBootstrapping, tc.bound)
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), tc.not) || !strings.Contains(err.Error(), "room 7") {
			t.Errorf("Unfinished: %v, want %q and not %q", err, tc.want, tc.not)
		}
	}
}
