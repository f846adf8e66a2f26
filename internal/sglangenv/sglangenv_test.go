package sglangenv

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

func TestApply(t *testing.T) {
	for _, tc := range []struct {
		name     string
		env      map[string]string
		in, want engine.ManagerConfig
		wantErr  string
	}{
		{name: "nothing set: engine defaults", in: engine.ManagerConfig{Role: engine.RoleDecode}, want: engine.ManagerConfig{Role: engine.RoleDecode}},
		{name: "timeouts", env: map[string]string{BootstrapTimeout: "0.3", WaitingTimeout: "7.5"},
			want: engine.ManagerConfig{BootstrapTimeout: 300 * time.Millisecond, WaitingTimeout: 7500 * time.Millisecond}},
		{name: "explicit wins", env: map[string]string{WaitingTimeout: "9", HeartbeatInterval: "9", HeartbeatMaxFailure: "7"},
			in:   engine.ManagerConfig{Role: engine.RoleDecode, WaitingTimeout: time.Second, BootstrapHeartbeatInterval: time.Second, BootstrapHeartbeatMaxFailure: 4},
			want: engine.ManagerConfig{Role: engine.RoleDecode, WaitingTimeout: time.Second, BootstrapHeartbeatInterval: time.Second, BootstrapHeartbeatMaxFailure: 4}},
		{name: "heartbeat interval", env: map[string]string{HeartbeatInterval: "7.5"}, in: engine.ManagerConfig{Role: engine.RoleDecode},
			want: engine.ManagerConfig{Role: engine.RoleDecode, BootstrapHeartbeatInterval: 7500 * time.Millisecond}},
		{name: "heartbeat interval floored at 2 s", env: map[string]string{HeartbeatInterval: "0.5"}, in: engine.ManagerConfig{Role: engine.RoleDecode},
			want: engine.ManagerConfig{Role: engine.RoleDecode, BootstrapHeartbeatInterval: 2 * time.Second}},
		{name: "max failure floored at 1", env: map[string]string{HeartbeatMaxFailure: "0"}, in: engine.ManagerConfig{Role: engine.RoleDecode},
			want: engine.ManagerConfig{Role: engine.RoleDecode, BootstrapHeartbeatMaxFailure: 1}},
		{name: "heartbeat ignored on a prefill", env: map[string]string{HeartbeatInterval: "7", HeartbeatMaxFailure: "5"},
			want: engine.ManagerConfig{}},
		{name: "bad interval", env: map[string]string{HeartbeatInterval: "soon"}, in: engine.ManagerConfig{Role: engine.RoleDecode}, wantErr: HeartbeatInterval},
		{name: "bad max failure", env: map[string]string{HeartbeatMaxFailure: "two"}, in: engine.ManagerConfig{Role: engine.RoleDecode}, wantErr: HeartbeatMaxFailure},
		{name: "bad timeout", env: map[string]string{WaitingTimeout: "soon"}, wantErr: WaitingTimeout},
		{name: "negative timeout", env: map[string]string{BootstrapTimeout: "-1"}, wantErr: BootstrapTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.in
			err := Apply(func(n string) string { return tc.env[n] }, &cfg)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.BootstrapTimeout != tc.want.BootstrapTimeout || cfg.WaitingTimeout != tc.want.WaitingTimeout ||
				cfg.BootstrapHeartbeatInterval != tc.want.BootstrapHeartbeatInterval || cfg.BootstrapHeartbeatMaxFailure != tc.want.BootstrapHeartbeatMaxFailure {
				t.Fatalf("got %+v\nwant %+v", cfg, tc.want)
			}
		})
	}
}
