package main

import (
	"bytes"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/hostmem"
)

// TestPoolLargerThanHostRefused: a prefill's or decode's --pool-mb, the
// demo's pools and a bench case larger than the memory this host can still
// allocate are refused before anything is allocated, naming the flag, the
// bytes needed, what the host has (MemAvailable) and what to do. The
// commands run under a 4 GiB address-space limit (ulimit -v), so a missing
// check fails on its mmap (another message) instead of running the host
// out of memory.
func TestPoolLargerThanHostRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	l, err := hostmem.Read()
	if err != nil {
		t.Skipf("no host memory figures here: %v", err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	mb := int(2*l.Available()>>20) + 1024
	big := strconv.Itoa(mb)
	region := strconv.Itoa(mb/1024+1) + "G"
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"prefill", []string{"prefill", "--pool-mb", big, "--prefault=false", "--bootstrap", "127.0.0.1:1", "--transport", "tcp"}, "--pool-mb " + big},
		{"decode", []string{"decode", "--pool-mb", big, "--prefault=false", "--transport", "tcp"}, "--pool-mb " + big},
		{"demo", []string{"demo", "--pool-mb", strconv.Itoa(mb/2 + 1), "--requests", "1", "--transport", "tcp"}, "--pool-mb " + strconv.Itoa(mb/2+1) + " for each of the demo's 2 ranks"},
		{"bench", []string{"bench", "--transports", "tcp", "--sizes", region, "--max-region", region, "--depths", "1", "--reps", "1", "--kv-model", ""}, "--sizes " + region},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cmd := exec.Command("sh", append([]string{"-c", `ulimit -v 4194304 && exec "$0" "$@"`, exe}, append(c.args, "--log-level", "error")...)...)
			cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1", hostmem.SkipEnv+"=")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			msg := stderr.String()
			if exitCode(err) != 1 {
				t.Fatalf("%v: exit %v, want 1:\n%s", c.args, err, msg)
			}
			for _, want := range []string{c.want, "of host memory", "MemAvailable in /proc/meminfo", "GiB", hostmem.SkipEnv + "=1"} {
				if !strings.Contains(msg, want) {
					t.Fatalf("%v: stderr lacks %q:\n%s", c.args, want, msg)
				}
			}
			if strings.Contains(msg, "panic") || strings.Contains(msg, "mmap") {
				t.Fatalf("%v: refused late (after allocating) or crashed:\n%s", c.args, msg)
			}
		})
	}
}

// TestPoolMmapFailureNamesPoolMB: a rank whose KV pool passes the
// host-memory pre-check (off here) but whose mmap fails (a 4 GiB
// address-space limit, as a memory cgroup or ulimit would) says which flag
// sizes the pool, not only the mmap error.
func TestPoolMmapFailureNamesPoolMB(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"decode", "--pool-mb", "5120", "--prefault=false", "--transport", "tcp", "--log-level", "error"}
	cmd := exec.Command("sh", append([]string{"-c", `ulimit -v 4194304 && exec "$0" "$@"`, exe}, args...)...)
	cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1", hostmem.SkipEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	msg := stderr.String()
	if exitCode(err) != 1 {
		t.Fatalf("%v: exit %v, want 1:\n%s", args, err, msg)
	}
	for _, want := range []string{"mmap", "--pool-mb 5120: the rank's KV pool in host memory", "use a smaller --pool-mb"} {
		if !strings.Contains(msg, want) {
			t.Fatalf("%v: stderr lacks %q:\n%s", args, want, msg)
		}
	}
}
