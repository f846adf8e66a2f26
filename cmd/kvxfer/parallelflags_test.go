package main

import (
	"strings"
	"testing"
)

// TestRoleParallelFlagsChecked: a TP, PP or (prefill) DP size below 1 is
// refused at start naming the flag, instead of being taken as 1 without a
// word; a rank outside [0, size) is refused naming its flag before the KV
// pool is allocated.
func TestRoleParallelFlagsChecked(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"prefill", "--tp-size", "0"}, "--tp-size 0: must be >= 1"},
		{[]string{"prefill", "--pp-size", "0"}, "--pp-size 0: must be >= 1"},
		{[]string{"prefill", "--dp-size", "0"}, "--dp-size 0: must be >= 1"},
		{[]string{"prefill", "--dp-size", "2", "--dp-rank", "3"}, "--dp-rank 3: must be in [0, --dp-size 2)"},
		{[]string{"decode", "--tp-size", "0"}, "--tp-size 0: must be >= 1"},
		{[]string{"decode", "--tp-size", "2", "--tp-rank", "2"}, "--tp-rank 2: must be in [0, --tp-size 2)"},
		{[]string{"decode", "--pp-size", "2", "--pp-rank", "-1"}, "--pp-rank -1: must be in [0, --pp-size 2)"},
	} {
		code, stderr := runCLI(t, append(c.args, "--pool-mb", "16", "--prefault=false", "--bootstrap", "127.0.0.1:1", "--bootstrap-timeout", "1s", "--log-level", "error")...)
		if code != 1 || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 with %q", c.args, code, stderr, c.want)
		}
	}
}

// TestDemoPoolTooSmallSaysWhatToDo: a demo whose --pool-mb cannot give each
// of --concurrency requests one token says how many tokens the pool holds
// and what to change, not only that it is too small.
func TestDemoPoolTooSmallSaysWhatToDo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	code, stderr := runCLI(t, "demo", "--concurrency", "100000", "--requests", "1", "--log-level", "error")
	for _, want := range []string{"the --pool-mb 2048 of a prefill rank (TP 1, PP 1) of llama-3.1-8b holds 16384 tokens, shared by --concurrency 100000 requests in flight: less than one token per request", "raise --pool-mb or lower --concurrency"} {
		if code != 1 || !strings.Contains(stderr, want) {
			t.Errorf("exit %d, stderr %q; want exit 1 with %q", code, stderr, want)
		}
	}
}
