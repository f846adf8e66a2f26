package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// proc is this test binary run as one `kvxfer` command (KVXFER_TEST_AS_CLI)
// in its own process: stdin to write request lines, stdout lines parsed as
// replyLine, stderr kept for failure messages.
type proc struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdin  interface{ Close() error }
	w      *json.Encoder
	lines  chan replyLine
	stderr *lockedBuffer
	done   chan struct{}
	err    error // cmd.Wait's result, valid once done is closed
}

// startProc starts `kvxfer args...` with env added to this process's
// environment. The process is killed when the test ends if still running.
func startProc(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), "KVXFER_TEST_AS_CLI=1"), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, name: name, cmd: cmd, stdin: stdin, w: json.NewEncoder(stdin), lines: make(chan replyLine, 1024),
		stderr: &lockedBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var r replyLine
			if json.Unmarshal(sc.Bytes(), &r) == nil {
				p.lines <- r
			}
		}
		close(p.lines)
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// ready waits for the ready line and returns it; it fails the test when the
// process exits or stays silent for a minute.
func (p *proc) ready() replyLine {
	p.t.Helper()
	select {
	case r, ok := <-p.lines:
		if ok && r.Event == readyEvent {
			return r
		}
		<-p.done
		p.t.Fatalf("%s: no ready line (exit %v)\n%s", p.name, p.err, p.stderr.String())
	case <-time.After(time.Minute):
		p.t.Fatalf("%s: not ready within a minute\n%s", p.name, p.stderr.String())
	}
	return replyLine{}
}

// send writes one request line.
func (p *proc) send(q requestLine) {
	p.t.Helper()
	if err := p.w.Encode(q); err != nil {
		p.t.Fatalf("%s: write request: %v\n%s", p.name, err, p.stderr.String())
	}
}

// result waits (up to limit) for the next result line.
func (p *proc) result(limit time.Duration) replyLine {
	p.t.Helper()
	select {
	case r, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("%s exited (%v) before a result\n%s", p.name, p.err, p.stderr.String())
		}
		return r
	case <-time.After(limit):
		p.t.Fatalf("%s: no result within %s\n%s", p.name, limit, p.stderr.String())
	}
	return replyLine{}
}

// exit closes stdin (a clean shutdown for a rank) and waits for the exit.
func (p *proc) exit(limit time.Duration) error {
	p.t.Helper()
	_ = p.stdin.Close()
	select {
	case <-p.done:
		return p.err
	case <-time.After(limit):
		p.t.Fatalf("%s did not exit within %s after stdin closed\n%s", p.name, limit, p.stderr.String())
	}
	return nil
}

// wait waits (up to limit) for the process to exit on its own.
func (p *proc) wait(limit time.Duration) error {
	p.t.Helper()
	select {
	case <-p.done:
		return p.err
	case <-time.After(limit):
		p.t.Fatalf("%s still running after %s\n%s", p.name, limit, p.stderr.String())
	}
	return nil
}

// waitStderr waits until p's stderr contains want (a log line saying the
// process reached a state), failing the test after limit.
func (p *proc) waitStderr(want string, limit time.Duration) {
	p.t.Helper()
	deadline := time.Now().Add(limit)
	for !strings.Contains(p.stderr.String(), want) {
		if time.Now().After(deadline) {
			p.t.Fatalf("%s: stderr lacks %q after %s\n%s", p.name, want, limit, p.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill9 sends SIGKILL and waits for the exit.
func (p *proc) kill9() {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// freePort returns a TCP port that was free on host a moment ago.
func freePort(t *testing.T, host string) int {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startBootstrapProc runs `kvxfer bootstrap` on host:port (port from
// freePort when 0) and waits until it answers /health.
func startBootstrapProc(t *testing.T, host string, port int, env ...string) (*proc, string) {
	t.Helper()
	if port == 0 {
		port = freePort(t, host)
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	p := startProc(t, "bootstrap "+addr, env, "bootstrap", "--host", host, "--port", strconv.Itoa(port), "--log-level", "warn")
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Health(ctx)
		cancel()
		if err == nil {
			return p, addr
		}
		select {
		case <-p.done:
			t.Fatalf("kvxfer bootstrap on %s exited: %v\n%s", addr, p.err, p.stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvxfer bootstrap on %s not answering: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pollTable polls addr's GET /v1/table until cond holds (returning the time
// it took) or limit passes (failing the test with the last table).
func pollTable(t *testing.T, addr string, limit time.Duration, what string, cond func(*bootstrap.TableSnapshot) bool) time.Duration {
	t.Helper()
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var last *bootstrap.TableSnapshot
	var lastErr error
	for time.Since(start) < limit {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		tab, err := c.Table(ctx)
		cancel()
		if err == nil && cond(tab) {
			return time.Since(start)
		}
		last, lastErr = tab, err
		time.Sleep(20 * time.Millisecond)
	}
	b, _ := json.Marshal(last)
	t.Fatalf("%s: not within %s; last table %s (err %v)", what, limit, b, lastErr)
	return 0
}

// exitCode returns the exit status of err from exec (0 for nil, -1 when it
// is not an exit).
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// roleArgs are the common flags of a small prefill/decode rank for tests.
func roleArgs(role, bootstrapAddr, host string, extra ...string) []string {
	a := []string{role, "--model", "llama-3.1-8b", "--pool-mb", "64", "--transport", "tcp", "--log-level", "warn",
		"--bootstrap", bootstrapAddr, "--host", host, "--bootstrap-timeout", "20s", "--waiting-timeout", "20s"}
	return append(a, extra...)
}
