package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// rssBytes is the resident set size of process pid (VmRSS), 0 when unknown.
func rssBytes(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// TestSIGINTDuringStartupStopsAtOnce: Ctrl-C while a rank is still
// allocating and prefaulting its KV pool stops it within a buffer's
// allocation (not after the whole pool), exits with status 130 and says it
// was stopped during start-up by the signal, instead of exiting 1 with a
// "registration deadline exceeded … is the bootstrap server running?" error
// about a directory that is fine.
func TestSIGINTDuringStartupStopsAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	args := roleArgs("prefill", b, host)
	for i, a := range args {
		if a == "--pool-mb" {
			args[i+1] = "3072" // 96 per-layer buffers of 32 MiB, prefaulted: seconds of start-up
		}
	}
	p := startProc(t, "prefill", nil, append(args, "--prefault")...)
	pid := p.cmd.Process.Pid
	deadline := time.Now().Add(30 * time.Second)
	// The binary alone is ~100 MiB resident (race detector): past 320 MiB
	// the pool is being allocated, and the signal handler is in place.
	for rssBytes(pid) < 320<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("prefill's KV pool not being allocated after 30 s (RSS %d)\n%s", rssBytes(pid), p.stderr.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if rss := rssBytes(pid); rss > 5<<29 {
		t.Skipf("start-up too far along when seen (RSS %d MiB of a 3 GiB pool) to stop it mid-allocation", rss>>20)
	}
	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("prefill still starting 20 s after SIGINT\n%s", p.stderr.String())
	}
	took := time.Since(sent)
	stderr := p.stderr.String()
	if strings.Contains(stderr, `"event":"ready"`) || strings.Contains(stderr, "rank serving requests") {
		t.Skipf("start-up finished before the signal landed:\n%s", stderr)
	}
	if code := exitCode(p.err); code != 130 || !strings.Contains(stderr, "prefill rank stopped during start-up by a stop signal") ||
		strings.Contains(stderr, "registration deadline exceeded") || strings.Contains(stderr, "is the prefill's bootstrap server running") {
		t.Fatalf("SIGINT during start-up: exit %d after %s, stderr:\n%s\nwant exit 130 saying the rank was stopped during start-up, no bootstrap advice", code, took, stderr)
	}
	if took > 10*time.Second {
		t.Fatalf("SIGINT during start-up: exit after %s; want it within a buffer's allocation, not the whole pool's", took)
	}
	t.Logf("SIGINT during start-up: exit 130 after %s", took)
}
