package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestOutputFileCheckedBeforeTheRun: `kvxfer demo --json`, `kvxfer
// chaos --json` and `kvxfer bench --json/--plot` naming a file that cannot be written (its directory is
// missing, or it is a directory) fail at once, before any rank or soak runs,
// naming the flag, the path and what to do, instead of running to the end
// and losing the report. A writable path is left as it was (no file created).
func TestOutputFileCheckedBeforeTheRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	dir := t.TempDir()
	missing := filepath.Join(dir, "nodir", "out.json")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"demo", "--requests", "1", "--pool-mb", "16", "--bench=false", "--transport", "tcp", "--json", missing},
			"--json " + missing + ": directory " + filepath.Dir(missing) + " does not exist"},
		{[]string{"demo", "--requests", "1", "--pool-mb", "16", "--bench=false", "--transport", "tcp", "--json", dir},
			"--json " + dir + ": is a directory"},
		{[]string{"chaos", "--rooms", "2", "--transports", "tcp", "--json", missing},
			"--json " + missing + ": directory " + filepath.Dir(missing) + " does not exist"},
		{[]string{"bench", "--transports", "tcp", "--sizes", "4K", "--depths", "1", "--reps", "1", "--kv-model", "", "--json", missing},
			"--json " + missing + ": directory " + filepath.Dir(missing) + " does not exist"},
		{[]string{"bench", "--transports", "tcp", "--sizes", "4K", "--depths", "1", "--reps", "1", "--kv-model", "", "--plot", filepath.Join(dir, "nodir", "p.png")},
			"--plot " + filepath.Join(dir, "nodir", "p.png") + ": directory"},
	} {
		start := time.Now()
		code, stderr := runCLI(t, append(c.args, "--log-level", "error")...)
		took := time.Since(start)
		if code != 1 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "nothing was run") {
			t.Errorf("%v: exit %d after %s, stderr %q; want exit 1 with %q before the run", c.args, code, took, stderr, c.want)
		}
		// Nothing ran: no rank's or soak's output, no bootstrap server.
		for _, ran := range []string{"[prefill", "[decode", "bootstrap server listening", "chaos over", "bench:"} {
			if strings.Contains(stderr, ran) {
				t.Errorf("%v: stderr shows the run started (%q) before the --json check:\n%s", c.args, ran, stderr)
			}
		}
	}
	// A writable path passes the check and is not left behind by it.
	ok := filepath.Join(dir, "out.json")
	if err := checkOutputFile("--json", ok); err != nil {
		t.Fatalf("writable %s: %v", ok, err)
	}
	if _, err := os.Stat(ok); !os.IsNotExist(err) {
		t.Fatalf("the check left %s behind (stat: %v)", ok, err)
	}
	if err := os.WriteFile(ok, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkOutputFile("--json", ok); err != nil {
		t.Fatalf("existing writable %s: %v", ok, err)
	}
	if b, _ := os.ReadFile(ok); string(b) != "keep" {
		t.Fatalf("the check changed an existing file: %q", b)
	}
}
