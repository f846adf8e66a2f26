package main

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
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
		// Checked before the KV pool: a pool larger than the host is
		// refused only after the names (and a pool that fits is not
		// allocated for a run that cannot start).
		{[]string{"decode", "--transport", "foo", "--pool-mb", "1073741824"}, `--transport: engine: transport list "foo": unknown transport "foo"`},
		{[]string{"prefill", "--transport", "tcp,foo", "--pool-mb", "1073741824", "--bootstrap", "127.0.0.1:1"}, `--transport: engine: transport list "tcp,foo": unknown transport "foo"`},
	} {
		code, stderr := runCLI(t, append(c.args, "--log-level", "error")...)
		if code != 1 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "tcp") || strings.Contains(stderr, "import its package") {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 with %q and the valid transports, no Go import advice", c.args, code, stderr, c.want)
		}
	}
}

// TestDecodeLookupAfterPrefillStopped: a decode whose prefill rank stopped
// (it left the directory) retries its lookup until the bootstrap timeout,
// as SGLang does (503 "not fully registered" is not final: a prefill may
// register again), and its log and room error print the directory as a
// clickable http:// URL and say that a prefill rank has not started or
// has stopped.
func TestDecodeLookupAfterPrefillStopped(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--bootstrap-timeout", "2s")...)
	p.ready()
	d.ready()
	if err := p.exit(time.Minute); err != nil {
		t.Fatalf("prefill exit: %v\n%s", err, p.stderr.String())
	}
	d.send(requestLine{Room: 2, Tokens: 16})
	dr := d.result(time.Minute)
	for _, want := range []string{"parallel info from http://" + b + ":", "GET http://" + b + "/route: HTTP 503", "a prefill rank has not started, or has stopped"} {
		if dr.OK || !strings.Contains(dr.Error, want) {
			t.Fatalf("decode's room after its prefill stopped: %+v\nwant an error containing %q\n%s", dr.Result, want, d.stderr.String())
		}
	}
	if want := `lookup="topology http://` + b + `"`; !strings.Contains(d.stderr.String(), want) {
		t.Fatalf("decode's retry log lacks %s:\n%s", want, d.stderr.String())
	}
}

// TestChaosHealWording: a fault kind none of whose faults healed reads
// "never healed (n)", not "median 0 ms"; a mix names both parts.
func TestChaosHealWording(t *testing.T) {
	for _, c := range []struct {
		h    chaosHeal
		want string
	}{
		{chaosHeal{N: 4, MedianMS: 198, MaxMS: 310}, "4 faults, median 198 ms, max 310 ms"},
		{chaosHeal{N: 2, Unhealed: 2}, "2 faults, never healed (2) before the end"},
		{chaosHeal{N: 5, MedianMS: 3300, MaxMS: 4100, Unhealed: 2}, "5 faults: 3 healed, median 3300 ms, max 4100 ms; never healed (2) before the end"},
	} {
		if got := c.h.String(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.h, got, c.want)
		}
	}
	var out bytes.Buffer
	printChaos(&out, chaosReport{Heal: map[string]chaosHeal{"kill": {N: 1, Unhealed: 1}}}, false)
	if s := out.String(); !strings.Contains(s, "heal after kill (fault → next ok room on that prefill): 1 fault, never healed (1)") || strings.Contains(s, "median 0 ms") {
		t.Fatalf("chaos report:\n%s\nwant the kill line to say never healed, with no median", s)
	}
}
