package engine

import (
	"strings"
	"testing"
	"time"
)

func TestBootstrapHeartbeatSettings(t *testing.T) {
	for _, tc := range []struct {
		name            string
		interval        time.Duration
		maxFail         int
		envInt, envFail string
		wantInt         time.Duration
		wantFail        int
		wantErr         string
	}{
		{name: "defaults", wantInt: 5 * time.Second, wantFail: 2},
		{name: "explicit short interval kept", interval: 100 * time.Millisecond, maxFail: 3, wantInt: 100 * time.Millisecond, wantFail: 3},
		{name: "explicit wins over env", interval: time.Second, maxFail: 4, envInt: "9", envFail: "7", wantInt: time.Second, wantFail: 4},
		{name: "env interval", envInt: "7.5", wantInt: 7500 * time.Millisecond, wantFail: 2},
		{name: "env interval floored at 2 s", envInt: "0.5", wantInt: 2 * time.Second, wantFail: 2},
		{name: "env max failure", envFail: "5", wantInt: 5 * time.Second, wantFail: 5},
		{name: "env max failure floored at 1", envFail: "0", wantInt: 5 * time.Second, wantFail: 1},
		{name: "negative interval disables", interval: -1, wantInt: -1, wantFail: 2},
		{name: "bad env interval", envInt: "soon", wantErr: "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"},
		{name: "bad env max failure", envFail: "two", wantErr: "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", tc.envInt)
			t.Setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", tc.envFail)
			gi, gf, err := bootstrapHeartbeatSettings(tc.interval, tc.maxFail)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil || gi != tc.wantInt || gf != tc.wantFail {
				t.Fatalf("got %s, %d, %v; want %s, %d", gi, gf, err, tc.wantInt, tc.wantFail)
			}
		})
	}
}
