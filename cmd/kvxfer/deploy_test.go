package main

import (
	"bufio"
	"bytes"
	"debug/elf"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// The deployment recipes under deploy/ checked against the real binary:
// the systemd units' ExecStart lines (with their example environment files)
// start ranks that serve a room over their sockets and drain on the unit's
// KillSignal; systemd-analyze verify finds nothing (where it exists); the
// container image's runtime stage installs every library the binary links
// and its CMD starts a rank.

const deployDir = "../../deploy"

// unitFile is the keys of a systemd unit (last value wins, as systemd reads
// them) with its section names.
type unitFile map[string]string

func readUnit(t *testing.T, name string) unitFile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, "systemd", name))
	if err != nil {
		t.Fatal(err)
	}
	u := unitFile{}
	section := ""
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: line %q is not key=value", name, line)
			}
			u[section+"."+k] = v
		}
	}
	return u
}

// readEnvFile returns an EnvironmentFile's assignments (comments skipped).
func readEnvFile(t *testing.T, name string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, "systemd", name))
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		k, v, _ := strings.Cut(line, "=")
		env[k] = v
	}
	return env
}

// execArgs expands a unit's ExecStart as systemd does for the specifiers and
// variables the units use (%i, %t, $VAR split into words, ${VAR} as one)
// and returns its argv without the binary, which must be
// /usr/local/bin/kvxfer.
func execArgs(t *testing.T, u unitFile, instance, runtimeDir string, env map[string]string) []string {
	t.Helper()
	line := strings.NewReplacer("%i", instance, "%t", runtimeDir).Replace(u["Service.ExecStart"])
	var argv []string
	for _, w := range strings.Fields(line) {
		switch {
		case strings.HasPrefix(w, "${"):
			argv = append(argv, env[strings.Trim(w, "${}")])
		case strings.HasPrefix(w, "$"):
			argv = append(argv, strings.Fields(env[w[1:]])...)
		default:
			argv = append(argv, w)
		}
	}
	if len(argv) < 2 || argv[0] != "/usr/local/bin/kvxfer" {
		t.Fatalf("ExecStart %q: want /usr/local/bin/kvxfer COMMAND ...", line)
	}
	return argv[1:]
}

// flagValue returns the last value of --name in argv ("" when absent).
func flagValue(argv []string, name string) string {
	v := ""
	for i, a := range argv {
		if a == "--"+name && i+1 < len(argv) {
			v = argv[i+1]
		} else if s, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			v = s
		}
	}
	return v
}

// TestSystemdUnitsServe runs the prefill and decode units' ExecStart (their
// example env files' flags, a free bootstrap port and a small pool for this
// machine) as real processes, transfers a room over the units' sockets and
// stops them with the unit's KillSignal within its TimeoutStopSec; the
// bootstrap unit serves /health with its example env (on a free port).
func TestSystemdUnitsServe(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	runtime := t.TempDir()
	// The bootstrap unit, as systemd starts it (its env file's host and
	// port moved to loopback and a free port).
	bu := readUnit(t, "kvxfer-bootstrap.service")
	benv := readEnvFile(t, "bootstrap.env.example")
	bargs := execArgs(t, bu, "", runtime, benv)
	port := freePort(t, "127.0.0.1")
	benv["KVXFER_BOOTSTRAP_HOST"], benv["KVXFER_BOOTSTRAP_PORT"] = "127.0.0.1", strconv.Itoa(port)
	var envList []string
	for k, v := range benv {
		envList = append(envList, k+"="+v)
	}
	bp := startProc(t, "bootstrap unit", envList, bargs...)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	pollTable(t, addr, time.Minute, "bootstrap unit answering", func(*bootstrap.TableSnapshot) bool { return true })
	// Loopback stands in for the example addresses; the pool fits here.
	local := []string{"--bootstrap", addr, "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--metrics-addr", "127.0.0.1:0",
		"--pool-mb", "64", "--transport", "tcp", "--log-level", "info"}
	var ranks []*proc
	var socks []string
	for _, role := range []string{"prefill", "decode"} {
		u := readUnit(t, "kvxfer-"+role+"@.service")
		if u["Service.KillSignal"] != "SIGTERM" || u["Service.StandardInput"] != "" {
			t.Fatalf("%s unit: KillSignal %q (want SIGTERM, which drains), StandardInput %q (want the default, null)", role, u["Service.KillSignal"], u["Service.StandardInput"])
		}
		argv := execArgs(t, u, "tp0", runtime, readEnvFile(t, role+"-tp0.env.example"))
		drain, err := time.ParseDuration(flagValue(argv, "drain-timeout"))
		if err != nil {
			t.Fatalf("%s unit: --drain-timeout: %v", role, err)
		}
		stop, err := time.ParseDuration(u["Service.TimeoutStopSec"])
		if err != nil || stop < drain+10*time.Second {
			t.Fatalf("%s unit: TimeoutStopSec %q must exceed --drain-timeout %s by the close (10 s)", role, u["Service.TimeoutStopSec"], drain)
		}
		spec, err := parseServe(flagValue(argv, "serve"))
		if err != nil || spec.unix == "" {
			t.Fatalf("%s unit: --serve %q: want a unix socket (%v)", role, flagValue(argv, "serve"), err)
		}
		// systemd creates RuntimeDirectory= under %t before ExecStart.
		rd := filepath.Join(runtime, strings.ReplaceAll(u["Service.RuntimeDirectory"], "%i", "tp0"))
		if filepath.Dir(spec.unix) != rd {
			t.Fatalf("%s unit: socket %s is not in its RuntimeDirectory %s", role, spec.unix, rd)
		}
		if err := os.MkdirAll(rd, 0o750); err != nil {
			t.Fatal(err)
		}
		p := startProc(t, role+" unit", nil, append(argv, local...)...)
		if r := p.ready(); r.Serve != "unix:"+spec.unix {
			t.Fatalf("%s unit: ready line serves %q, want unix:%s", role, r.Serve, spec.unix)
		}
		_ = p.stdin.Close() // StandardInput=null: no stdin at all
		ranks, socks = append(ranks, p), append(socks, spec.unix)
	}
	var conns []*unixClient
	for _, s := range socks {
		c := dialServe(t, s)
		if r, _ := c.next(time.Minute); r.Event != readyEvent {
			t.Fatalf("%s: first line %+v, want the ready line", s, r)
		}
		c.send(requestLine{Room: 61, Tokens: 200})
		conns = append(conns, c)
	}
	for i, c := range conns {
		if r, _ := c.next(time.Minute); !r.OK {
			t.Fatalf("%s: room 61 %+v\n%s", socks[i], r, ranks[i].stderr.String())
		}
	}
	for _, p := range append(ranks, bp) {
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := p.wait(40 * time.Second); err != nil {
			t.Fatalf("%s: exit %v after SIGTERM, want 0 (systemd would mark the unit failed)\n%s", p.name, err, p.stderr.String())
		}
	}
}

// TestSystemdAnalyzeVerify runs systemd-analyze verify on the units (the
// templates instantiated, the binary path pointed at this test binary):
// it must report nothing.
func TestSystemdAnalyzeVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (Debian: systemd)")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var units []string
	for src, dst := range map[string]string{"kvxfer-decode@.service": "kvxfer-decode@tp0.service",
		"kvxfer-prefill@.service": "kvxfer-prefill@tp0.service", "kvxfer-bootstrap.service": "kvxfer-bootstrap.service"} {
		b, err := os.ReadFile(filepath.Join(deployDir, "systemd", src))
		if err != nil {
			t.Fatal(err)
		}
		b = bytes.ReplaceAll(b, []byte("/usr/local/bin/kvxfer"), []byte(exe))
		p := filepath.Join(dir, dst)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		units = append(units, p)
	}
	out, err := exec.Command(sa, append([]string{"verify", "--man=no"}, units...)...).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// containerfile is what the test reads of deploy/Containerfile: the last
// stage's apt-get packages and its ENTRYPOINT and CMD (exec form).
type containerfile struct {
	runPackages     []string
	entrypoint, cmd []string
}

func readContainerfile(t *testing.T) containerfile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, "Containerfile"))
	if err != nil {
		t.Fatal(err)
	}
	// Join continuation lines, then walk the instructions.
	text := regexp.MustCompile(`\\\n`).ReplaceAllString(string(b), " ")
	var c containerfile
	stages := 0
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		switch strings.ToUpper(f[0]) {
		case "FROM":
			stages++
			c.runPackages = nil
		case "RUN":
			if i := strings.Index(line, "apt-get install"); i >= 0 {
				for _, w := range strings.Fields(line[i+len("apt-get install"):]) {
					if w == "&&" {
						break
					}
					if !strings.HasPrefix(w, "-") {
						c.runPackages = append(c.runPackages, w)
					}
				}
			}
		case "ENTRYPOINT", "CMD":
			var v []string
			if err := json.Unmarshal([]byte(strings.TrimSpace(line[len(f[0]):])), &v); err != nil {
				t.Fatalf("Containerfile %s: want the exec form (a JSON array): %v", f[0], err)
			}
			if f[0] == "CMD" {
				c.cmd = v
			} else {
				c.entrypoint = v
			}
		}
	}
	if stages < 2 {
		t.Fatalf("Containerfile has %d stage(s), want a build stage and a runtime stage", stages)
	}
	return c
}

// TestContainerfileRuntime: every shared library the binary links comes
// from a package the runtime stage installs (libc from the base image), and
// the image's ENTRYPOINT + CMD start a rank with those flags (the listen
// addresses moved to loopback) that drains on SIGTERM (STOPSIGNAL).
func TestContainerfileRuntime(t *testing.T) {
	c := readContainerfile(t)
	if len(c.entrypoint) != 1 || c.entrypoint[0] != "/usr/local/bin/kvxfer" {
		t.Fatalf("ENTRYPOINT %q: want [\"/usr/local/bin/kvxfer\"]", c.entrypoint)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	libs, err := f.ImportedLibraries()
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("dpkg"); err != nil {
		t.Log("dpkg not found: the libraries' packages are not checked")
	} else {
		for _, lib := range libs {
			pkg := libraryPackage(t, lib)
			if pkg == "libc6" || pkg == "" {
				continue
			}
			found := false
			for _, p := range c.runPackages {
				found = found || p == pkg
			}
			if !found {
				t.Errorf("the binary links %s (package %s), which the runtime stage does not install (it installs %v)", lib, pkg, c.runPackages)
			}
		}
	}
	if testing.Short() {
		return
	}
	if spec, err := parseServe(flagValue(c.cmd, "serve")); err != nil || spec.http == "" {
		t.Fatalf("CMD --serve %q: %v (want http://HOST:PORT)", flagValue(c.cmd, "serve"), err)
	}
	args := append(append([]string{}, c.cmd...), "--serve", "http://127.0.0.1:0", "--host", "127.0.0.1", "--metrics-addr", "127.0.0.1:0",
		"--pool-mb", "16", "--transport", "tcp", "--bootstrap", "127.0.0.1:1")
	p := startProc(t, "image CMD", nil, args...)
	if r := p.ready(); !strings.HasPrefix(r.Serve, "http://127.0.0.1:") {
		t.Fatalf("image CMD: ready line %+v", r)
	}
	_ = p.stdin.Close() // docker run without -i
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if err := p.wait(30 * time.Second); err != nil {
		t.Fatalf("image CMD: exit %v after SIGTERM, want 0\n%s", err, p.stderr.String())
	}
}

// libraryPackage returns the Debian package that ships the shared library
// lib as this machine resolves it ("" when unknown).
func libraryPackage(t *testing.T, lib string) string {
	t.Helper()
	out, err := exec.Command("ldconfig", "-p").Output()
	if err != nil {
		return ""
	}
	var path string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, lib+" ") && strings.Contains(line, "x86-64") {
			if _, p, ok := strings.Cut(line, "=> "); ok {
				path = p
				break
			}
		}
	}
	if path == "" {
		return ""
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		real = path
	}
	for _, p := range []string{path, real, strings.Replace(real, "/lib/", "/usr/lib/", 1)} {
		if out, err := exec.Command("dpkg", "-S", p).Output(); err == nil {
			pkg, _, _ := strings.Cut(string(out), ":")
			return strings.TrimSpace(pkg)
		}
	}
	return ""
}
