package main

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// runCLI runs `kvxfer args...` (this test binary as the CLI) to its end and
// returns its exit status and stderr.
func runCLI(t *testing.T, args ...string) (int, string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	return exitCode(err), stderr.String()
}

// TestUnknownTransportNamesTheFlag: a transport name this binary lacks is
// refused naming the flag and the valid transports, with no advice meant
// for Go programs (import a package).
func TestUnknownTransportNamesTheFlag(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "--transports", "foo"}, `--transports "foo": "foo" is not a transport; want a comma-separated list of`},
		{[]string{"bench", "--transports", "tcp,foo"}, `"foo" is not a transport`},
		{[]string{"bench", "--transports", " , "}, "names no transport"},
		{[]string{"chaos", "--transports", "foo", "--rooms", "1"}, `--transports "foo": "foo" is not a transport`},
		{[]string{"prefill", "--transport", "foo", "--bootstrap", "127.0.0.1:1"}, `--transport: engine: transport list "foo": unknown transport "foo"`},
		{[]string{"decode", "--transport", "foo"}, `--transport: engine: transport list "foo": unknown transport "foo"`},
	} {
		code, stderr := runCLI(t, append(c.args, "--log-level", "error")...)
		if code != 1 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "tcp") || strings.Contains(stderr, "import its package") {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 with %q and the valid transports, no Go import advice", c.args, code, stderr, c.want)
		}
	}
}
