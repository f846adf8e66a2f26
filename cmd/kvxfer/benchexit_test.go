package main

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/hostmem"
)

// TestBenchExitStatusCountsFailedCases: `kvxfer bench` exits 1 when every
// case failed and when only some did, its last line saying how many of how
// many and why the first failed; 0 when every case ran. The failing case is
// a 5 GiB region whose mmap fails under a 4 GiB address-space limit (the
// host-memory pre-check off, so the case itself fails), as a scripted run
// on a host short of memory would. A bad KVXFER_SHM_STREAM_MIN is refused
// before any case runs, naming the variable (the engine no longer reads it).
func TestBenchExitStatusCountsFailedCases(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"bench", "--transports", "tcp", "--depths", "1", "--ops", "write", "--reps", "1", "--warmup", "0",
		"--rep-time", "10ms", "--no-memcpy", "--kv-model", "", "--quiet", "--log-level", "error"}
	cases := []struct {
		name string
		args []string
		env  string
		code int
		last []string
		// out must be in the whole output (the failed case's reason
		// under the table), notOut must not.
		out, notOut []string
	}{
		{"all", []string{"--sizes", "5G", "--max-region", "5G"}, "", 1,
			[]string{"bench: all 1 cases failed, no figures", "tcp 5G×1", "each case's reason is under the table"},
			// bench has no pool: the hint names what sized the region.
			[]string{"cannot allocate memory", "a destination region of 5G each", "lower --max-region", "--sizes", "--depths"}, []string{"pool"}},
		{"some", []string{"--sizes", "4K,5G", "--max-region", "5G"}, "", 1,
			[]string{"bench: 1 of 2 cases failed", "tcp 5G×1", "other cases' figures"}, nil, nil},
		{"none", []string{"--sizes", "4K"}, "", 0, []string{"bench: 1 cases, 0 peer runs"}, nil, nil},
		{"bad-env", []string{"--sizes", "4K"}, "KVXFER_SHM_STREAM_MIN=4M", 1,
			[]string{`env KVXFER_SHM_STREAM_MIN="4M": want a byte count`, `"off"`, "unset it for the default"}, nil, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			args := append(append([]string{}, base...), c.args...)
			cmd := exec.Command("sh", append([]string{"-c", `ulimit -v 4194304 && exec "$0" "$@"`, exe}, args...)...)
			cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1", hostmem.SkipEnv+"=1")
			if c.env != "" {
				cmd.Env = append(cmd.Env, c.env)
			}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			code := exitCode(cmd.Run())
			lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
			last := lines[len(lines)-1]
			if code != c.code {
				t.Fatalf("%v: exit %d, want %d; stderr:\n%s\nstdout:\n%s", args, code, c.code, stderr.String(), stdout.String())
			}
			for _, w := range c.last {
				if !strings.Contains(last, w) {
					t.Errorf("%v: last line %q lacks %q; stderr:\n%s", args, last, w, stderr.String())
				}
			}
			all := stdout.String() + stderr.String()
			for _, w := range c.out {
				if !strings.Contains(all, w) {
					t.Errorf("%v: output lacks %q:\n%s", args, w, all)
				}
			}
			for _, w := range c.notOut {
				if strings.Contains(all, w) {
					t.Errorf("%v: output has %q (bench has no such thing):\n%s", args, w, all)
				}
			}
			if strings.Contains(stderr.String(), "panic") {
				t.Fatalf("%v: crashed:\n%s", args, stderr.String())
			}
		})
	}
}
