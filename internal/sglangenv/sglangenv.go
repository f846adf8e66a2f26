// Package sglangenv reads SGLang's disaggregation environment variables at
// the edges (the kvxfer CLI with os.Getenv, the C ABI with libc getenv at
// call time) into an engine.ManagerConfig, so the engine itself reads no
// environment. The variables and their meaning are SGLang's
// (disaggregation/utils.py and common/conn.py at commit 0094505):
//
//   - SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: seconds a room may wait for its
//     peers (BootstrapTimeout; default 300);
//   - SGLANG_DISAGGREGATION_WAITING_TIMEOUT: seconds a room may wait for its
//     KV after TRANSFER (WaitingTimeout; default 300);
//   - SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL: seconds between a decode's
//     GET /health checks of each bootstrap server, at least 2
//     (BootstrapHeartbeatInterval; default 5);
//   - SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE: consecutive failed checks
//     that drop a bootstrap server, at least 1 (BootstrapHeartbeatMaxFailure;
//     default 2).
package sglangenv

import (
	"fmt"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// Variable names.
const (
	BootstrapTimeout    = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
	WaitingTimeout      = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
	HeartbeatInterval   = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
	HeartbeatMaxFailure = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
)

// MinHeartbeatInterval is SGLang's floor for HeartbeatInterval.
const MinHeartbeatInterval = 2 * time.Second

// Getenv returns a variable's value, "" when unset: os.Getenv, or the C
// ABI's libc getenv.
type Getenv func(name string) string

// Seconds reads variable name holding seconds (a positive decimal, possibly
// fractional); def when unset. The error names the variable and its value.
func Seconds(getenv Getenv, name string, def time.Duration) (time.Duration, error) {
	v := getenv(name)
	if v == "" {
		return def, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive number of seconds", name, v)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// Apply fills the fields of cfg that the caller left zero from the
// variables above, as SGLang reads them; a field the caller set wins, and
// an unset variable leaves the field zero (the engine's default). Errors
// name the variable and its bad value. The heartbeat variables apply to a
// decode only.
func Apply(getenv Getenv, cfg *engine.ManagerConfig) error {
	var err error
	if cfg.BootstrapTimeout == 0 {
		if cfg.BootstrapTimeout, err = Seconds(getenv, BootstrapTimeout, 0); err != nil {
			return err
		}
	}
	if cfg.WaitingTimeout == 0 {
		if cfg.WaitingTimeout, err = Seconds(getenv, WaitingTimeout, 0); err != nil {
			return err
		}
	}
	if cfg.Role != engine.RoleDecode {
		return nil
	}
	if cfg.BootstrapHeartbeatInterval == 0 {
		d, err := Seconds(getenv, HeartbeatInterval, 0)
		if err != nil {
			return err
		}
		if d > 0 {
			cfg.BootstrapHeartbeatInterval = max(d, MinHeartbeatInterval)
		}
	}
	if cfg.BootstrapHeartbeatMaxFailure == 0 {
		if v := getenv(HeartbeatMaxFailure); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("%s=%q: want an integer count of failed health checks", HeartbeatMaxFailure, v)
			}
			cfg.BootstrapHeartbeatMaxFailure = max(n, 1)
		}
	}
	return nil
}
