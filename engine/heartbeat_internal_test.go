package engine

import (
	"testing"
	"time"
)

func TestBootstrapHeartbeatSettings(t *testing.T) {
	for _, tc := range []struct {
		name     string
		interval time.Duration
		maxFail  int
		wantInt  time.Duration
		wantFail int
	}{
		{name: "defaults", wantInt: 5 * time.Second, wantFail: 2},
		{name: "explicit short interval kept", interval: 100 * time.Millisecond, maxFail: 3, wantInt: 100 * time.Millisecond, wantFail: 3},
		{name: "negative interval disables", interval: -1, wantInt: -1, wantFail: 2},
		{name: "negative max failure is 1", maxFail: -4, wantInt: 5 * time.Second, wantFail: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gi, gf := bootstrapHeartbeatSettings(tc.interval, tc.maxFail)
			if gi != tc.wantInt || gf != tc.wantFail {
				t.Fatalf("got %s, %d; want %s, %d", gi, gf, tc.wantInt, tc.wantFail)
			}
		})
	}
}
