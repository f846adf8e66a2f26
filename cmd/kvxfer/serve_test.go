package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Item 1 of issue 26 and item 2 of issue 22 at the process level: a rank
// stopped by SIGTERM drains (every request line it read gets its result
// line, the rooms in flight finish), says why it stops when stdin closes,
// and serves requests from a unix socket or an HTTP endpoint (--serve)
// with no stdin at all.

// TestRoleSIGTERMDrainsInFlight: a decode gets SIGTERM 3 ms after its
// request line (the room is still in flight: the prefill lands its writes
// 300 ms late). The room completes on both sides, the decode writes its
// result line and exits 0. The decode is stopped (SIGSTOP) while the line
// is written and the signal sent, so the line still waits in its stdin
// pipe when the signal is handled, as on a loaded machine: a line written
// before the signal is served, not refused.
func TestRoleSIGTERMDrainsInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--inject-write-delay", "300ms")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--digest", "--log-level", "info")...)
	p.ready()
	d.ready()
	p.send(requestLine{Room: 31, Tokens: 512})
	if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // stopped before the line is written
	d.send(requestLine{Room: 31, Tokens: 512})
	time.Sleep(3 * time.Millisecond)
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	dr := d.result(time.Minute)
	pr := p.result(time.Minute)
	agree(t, 31, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 31, 512) {
		t.Fatalf("decode result %+v: want the room transferred whole although SIGTERM came 3 ms after its line\n%s", dr, d.stderr.String())
	}
	if err := d.wait(time.Minute); err != nil {
		t.Fatalf("decode exit after a drained SIGTERM: %v (want 0)\n%s", err, d.stderr.String())
	}
	if !strings.Contains(d.stderr.String(), "draining") {
		t.Errorf("decode stderr does not say it drains:\n%s", d.stderr.String())
	}
}

// TestRoleSIGTERMAnswersEveryLine: request lines sit in the rank's stdin
// pipe when SIGTERM arrives (the rank is stopped while they are written
// and the signal is sent, then continued). Every one of them gets a result
// line, in every round; none is dropped.
func TestRoleSIGTERMAnswersEveryLine(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const lines = 20
	for round := range 6 {
		d := startProc(t, fmt.Sprintf("decode round %d", round), nil, "decode", "--pool-mb", "16", "--transport", "tcp",
			"--log-level", "info", "--bootstrap", "127.0.0.1:1", "--bootstrap-timeout", "1s", "--waiting-timeout", "1s")
		d.ready()
		if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // stopped before the lines are written
		for i := range lines {
			d.send(requestLine{Room: uint64(100 + i), Tokens: 16})
		}
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		_ = d.cmd.Process.Signal(syscall.SIGCONT)
		got := map[uint64]replyLine{}
		for range lines {
			r, ok := <-d.lines
			if !ok {
				t.Fatalf("round %d: %d of %d request lines got a result line before the rank exited (%v)\n%s",
					round, len(got), lines, d.err, d.stderr.String())
			}
			if r.Room == nil || r.OK || r.Error == "" {
				t.Fatalf("round %d: result %+v: want a failed room with its reason", round, r)
			}
			got[*r.Room] = r
		}
		if len(got) != lines {
			t.Fatalf("round %d: results for %d distinct rooms, want %d", round, len(got), lines)
		}
		_ = d.wait(time.Minute)
	}
}

// TestRoleDrainTimeoutAndSecondSignal: a room that cannot finish (its
// bootstrap server is not there, and the bootstrap timeout is a minute)
// is cancelled when --drain-timeout passes, or at once by a second SIGTERM;
// either way its result line names why, and the rank exits.
func TestRoleDrainTimeoutAndSecondSignal(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, c := range []struct {
		name, drain, want string
		second            bool
	}{
		{"drain timeout", "300ms", "--drain-timeout 300ms", false},
		{"second signal", "10m", "a second stop signal", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := startProc(t, "decode", nil, "decode", "--pool-mb", "16", "--transport", "tcp", "--log-level", "warn",
				"--bootstrap", "127.0.0.1:1", "--bootstrap-timeout", "60s", "--waiting-timeout", "60s", "--drain-timeout", c.drain)
			d.ready()
			d.send(requestLine{Room: 7, Tokens: 16})
			time.Sleep(200 * time.Millisecond) // read before the signal: served
			_ = d.cmd.Process.Signal(syscall.SIGTERM)
			if c.second {
				time.Sleep(200 * time.Millisecond)
				_ = d.cmd.Process.Signal(syscall.SIGTERM)
			}
			r := d.result(30 * time.Second)
			if r.OK || !strings.Contains(r.Error, c.want) {
				t.Fatalf("result %+v: want the room cancelled naming %q", r, c.want)
			}
			if err := d.wait(30 * time.Second); exitCode(err) != 1 {
				t.Fatalf("exit %v: want status 1 (a request failed)", err)
			}
		})
	}
}

// TestRoleStdinClosedSaysSo: a rank started with stdin closed (</dev/null:
// nohup, systemd, docker run without -i) says that it stops because stdin
// closed and how to run it as a service, instead of exiting in silence.
func TestRoleStdinClosedSaysSo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "decode", "--pool-mb", "16", "--transport", "tcp", "--bootstrap", "127.0.0.1:1")
	cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1")
	cmd.Stdin = nil // /dev/null
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("exit %v (want 0: no request failed)\n%s", err, stderr.String())
	}
	if !bytes.Contains(out, []byte(`"event":"ready"`)) {
		t.Errorf("stdout %q: no ready line", out)
	}
	for _, want := range []string{"stdin closed", "--serve"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
		}
	}
}

// serveRank starts a role with --serve spec and returns it and its ready
// line (whose "serve" names the bound address).
func serveRank(t *testing.T, name, role, b, spec string, extra ...string) (*proc, replyLine) {
	t.Helper()
	p := startProc(t, name, nil, roleArgs(role, b, "127.0.0.1", append([]string{"--serve", spec, "--log-level", "info"}, extra...)...)...)
	r := p.ready()
	if r.Serve == "" {
		t.Fatalf("%s: ready line %+v has no serve address", name, r)
	}
	return p, r
}

// unixClient is one connection to a rank's --serve unix socket.
type unixClient struct {
	t     *testing.T
	conn  *net.UnixConn
	lines chan replyLine
}

func dialServe(t *testing.T, path string) *unixClient {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	u := &unixClient{t: t, conn: c.(*net.UnixConn), lines: make(chan replyLine, 64)}
	go func() {
		defer close(u.lines)
		sc := bufio.NewScanner(c)
		for sc.Scan() {
			var r replyLine
			if json.Unmarshal(sc.Bytes(), &r) == nil {
				u.lines <- r
			}
		}
	}()
	return u
}

func (u *unixClient) send(q requestLine) {
	u.t.Helper()
	b, _ := json.Marshal(q)
	if _, err := u.conn.Write(append(b, '\n')); err != nil {
		u.t.Fatal(err)
	}
}

func (u *unixClient) next(limit time.Duration) (replyLine, bool) {
	select {
	case r, ok := <-u.lines:
		return r, ok
	case <-time.After(limit):
		u.t.Fatalf("no line from the socket within %s", limit)
	}
	return replyLine{}, false
}

// TestRoleServeUnixSocket: a prefill and a decode with --serve unix:PATH and
// no stdin: each connection gets the ready line, then one result line per
// request line; SIGTERM with a room in flight drains it (ok on both sides),
// answers a line sent after the signal with a refusal, removes the socket
// and exits 0.
func TestRoleServeUnixSocket(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, b := startBootstrapProc(t, "127.0.0.1", 0)
	dir := t.TempDir()
	p, _ := serveRank(t, "prefill", "prefill", b, "unix:"+filepath.Join(dir, "prefill.sock"), "--inject-write-delay", "500ms")
	dsock := filepath.Join(dir, "decode.sock")
	d, _ := serveRank(t, "decode", "decode", b, "unix:"+dsock, "--digest")
	_ = p.stdin.Close() // no stdin: the serving rank must not stop on its EOF
	_ = d.stdin.Close()
	pc, dc := dialServe(t, filepath.Join(dir, "prefill.sock")), dialServe(t, dsock)
	for _, c := range []*unixClient{pc, dc} {
		if r, _ := c.next(time.Minute); r.Event != readyEvent {
			t.Fatalf("first socket line %+v: want the ready line", r)
		}
	}
	pc.send(requestLine{Room: 41, Tokens: 256})
	dc.send(requestLine{Room: 41, Tokens: 256})
	pr, _ := pc.next(time.Minute)
	dr, _ := dc.next(time.Minute)
	agree(t, 41, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 41, 256) || dr.Line != 1 {
		t.Fatalf("decode over the socket: %+v", dr)
	}
	// A client that half-closes after its lines gets every result, then EOF.
	hc := dialServe(t, dsock)
	hc.send(requestLine{Room: 44}) // tokens 0: an error result
	if err := hc.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	var hl []replyLine
	for {
		r, ok := hc.next(time.Minute)
		if !ok {
			break
		}
		hl = append(hl, r)
	}
	if len(hl) != 2 || hl[0].Event != readyEvent || hl[1].OK || !strings.Contains(hl[1].Error, `"tokens" 0`) {
		t.Fatalf("half-closed connection got %+v: want the ready line and one error result, then EOF", hl)
	}
	// A room in flight when SIGTERM arrives (writes land 500 ms late).
	pc.send(requestLine{Room: 42, Tokens: 256})
	dc.send(requestLine{Room: 42, Tokens: 256})
	time.Sleep(100 * time.Millisecond)
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	d.waitStderr("draining: no new requests", time.Minute) // the rank saw the signal
	dc.send(requestLine{Room: 43, Tokens: 16})             // after the signal: refused
	got := map[uint64]replyLine{}
	for range 2 {
		r, ok := dc.next(time.Minute)
		if !ok || r.Room == nil {
			t.Fatalf("decode socket closed with %d of 2 results (%+v)\n%s", len(got), r, d.stderr.String())
		}
		got[*r.Room] = r
	}
	if r := got[42]; !r.OK || r.Digest != expectedDigest(t, 42, 256) {
		t.Fatalf("room 42 in flight at SIGTERM: %+v, want drained to Success", r)
	}
	if r := got[43]; r.OK || !strings.Contains(r.Error, "draining") {
		t.Fatalf("room 43 sent after SIGTERM: %+v, want a refusal naming the drain", r)
	}
	if r, _ := pc.next(time.Minute); r.Room == nil || *r.Room != 42 || !r.OK {
		t.Fatalf("prefill room 42: %+v", r)
	}
	if _, ok := dc.next(time.Minute); ok {
		t.Fatal("decode socket still open after the drain")
	}
	if err := d.wait(time.Minute); err != nil {
		t.Fatalf("decode exit %v, want 0 after a drain\n%s", err, d.stderr.String())
	}
	if _, err := os.Stat(dsock); !os.IsNotExist(err) {
		t.Fatalf("socket %s left behind (%v)", dsock, err)
	}
}

// TestRoleServeHTTP: a decode with --serve http://127.0.0.1:0 takes request
// lines as a POST body and answers with one result line each (NDJSON);
// /v1/ready is the ready line, 503 once draining; a bad line gets its
// error result as on stdin.
func TestRoleServeHTTP(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, b := startBootstrapProc(t, "127.0.0.1", 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, "127.0.0.1")...)
	p.ready()
	d, ready := serveRank(t, "decode", "decode", b, "http://127.0.0.1:0", "--digest")
	base := ready.Serve
	resp, err := http.Get(base + "/v1/ready")
	if err != nil {
		t.Fatal(err)
	}
	var rl replyLine
	_ = json.NewDecoder(resp.Body).Decode(&rl)
	resp.Body.Close()
	if resp.StatusCode != 200 || rl.Event != readyEvent || rl.Endpoint != ready.Endpoint {
		t.Fatalf("GET /v1/ready: %d %+v", resp.StatusCode, rl)
	}
	p.send(requestLine{Room: 51, Tokens: 128})
	body := `{"room":51,"tokens":128}` + "\n" + `{"room":52}` + "\n"
	resp, err = http.Post(base+"/v1/requests", "application/x-ndjson", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var rs []replyLine
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var r replyLine
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("response line %q: %v", sc.Text(), err)
		}
		rs = append(rs, r)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || len(rs) != 2 {
		t.Fatalf("POST /v1/requests: status %d, %d result lines (want 2): %+v", resp.StatusCode, len(rs), rs)
	}
	for _, r := range rs {
		switch r.Line {
		case 1:
			if !r.OK || r.Digest != expectedDigest(t, 51, 128) {
				t.Fatalf("room 51 over HTTP: %+v", r)
			}
		case 2:
			if r.OK || !strings.Contains(r.Error, `missing "tokens"`) {
				t.Fatalf("line 2 (no tokens): %+v", r)
			}
		default:
			t.Fatalf("result for line %d: %+v", r.Line, r)
		}
	}
	if pr := p.result(time.Minute); !pr.OK {
		t.Fatalf("prefill room 51: %+v", pr)
	}
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := d.wait(time.Minute); err != nil {
		t.Fatalf("decode exit %v after SIGTERM, want 0\n%s", err, d.stderr.String())
	}
	if _, err := http.Get(base + "/v1/ready"); err == nil {
		t.Fatalf("%s still answers after the rank exited", base)
	}
}

// TestRoleServeHTTPDrainTimeoutAnswers: over HTTP, a room cancelled by
// --drain-timeout still gets its result line naming why, both for a body
// the client finished and for one it keeps open (its read is interrupted,
// not its response cut), and the rank exits 0.
func TestRoleServeHTTPDrainTimeoutAnswers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("body open %v", open), func(t *testing.T) {
			// No bootstrap server: the room waits until it is cancelled.
			d, ready := serveRank(t, "decode", "decode", "127.0.0.1:1", "http://127.0.0.1:0", "--drain-timeout", "300ms")
			pr, pw := io.Pipe()
			defer pw.Close()
			type answer struct {
				lines []replyLine
				err   error
			}
			got := make(chan answer, 1)
			go func() {
				resp, err := http.Post(ready.Serve+"/v1/requests", "application/x-ndjson", pr)
				if err != nil {
					got <- answer{err: err}
					return
				}
				defer resp.Body.Close()
				var a answer
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					var r replyLine
					if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
						a.err = fmt.Errorf("line %q: %v", sc.Text(), err)
						break
					}
					a.lines = append(a.lines, r)
				}
				if a.err == nil {
					a.err = sc.Err()
				}
				got <- a
			}()
			if _, err := io.WriteString(pw, `{"room":7,"tokens":16}`+"\n"); err != nil {
				t.Fatal(err)
			}
			if !open {
				pw.Close()
			}
			time.Sleep(300 * time.Millisecond) // read before the signal: served
			if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			var a answer
			select {
			case a = <-got:
			case <-time.After(time.Minute):
				t.Fatalf("no response a minute after SIGTERM\n%s", d.stderr.String())
			}
			if a.err != nil || len(a.lines) != 1 || a.lines[0].OK || !strings.Contains(a.lines[0].Error, "--drain-timeout 300ms") {
				t.Fatalf("response %+v (err %v): want one result line cancelled naming --drain-timeout 300ms\n%s", a.lines, a.err, d.stderr.String())
			}
			if err := d.wait(time.Minute); err != nil {
				t.Fatalf("decode exit %v, want 0\n%s", err, d.stderr.String())
			}
		})
	}
}

// TestRoleStartFailureExitsCleanly: a rank whose start fails part-way (a
// transport this host lacks; a --metrics-addr in use, after the manager
// started; a --serve socket path in a missing directory) undoes what it
// started and exits 1 with the reason, never a panic.
func TestRoleStartFailureExitsCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cases := [][]string{
		{"--metrics-addr", busy.Addr().String()},
		{"--serve", "unix:" + filepath.Join(t.TempDir(), "no-such-dir", "rank.sock")},
		{"--transport", "rdma"}, // fails where rdma is missing; starts (and stops at stdin's end) where it is not
	}
	for _, extra := range cases {
		args := append([]string{"decode", "--pool-mb", "16", "--bootstrap", "127.0.0.1:1", "--log-level", "error"}, extra...)
		if extra[0] != "--transport" {
			args = append(args, "--transport", "tcp")
		}
		cmd := exec.Command(exe, args...)
		cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		if strings.Contains(stderr.String(), "panic") || strings.Contains(stderr.String(), "goroutine ") {
			t.Fatalf("%v: the rank panicked:\n%s", extra, stderr.String())
		}
		if extra[0] == "--transport" && err == nil {
			continue // this host has RDMA: the rank started and stopped at stdin's end
		}
		if exitCode(err) != 1 || !strings.Contains(stderr.String(), "kvxfer: ") {
			t.Errorf("%v: exit %v, want 1 with the reason:\n%s", extra, err, stderr.String())
		}
	}
}
