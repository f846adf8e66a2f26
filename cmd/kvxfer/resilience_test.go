package main

import (
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The resilience issue's operational cases (issue 18) at the CLI level: real
// `kvxfer prefill` and `kvxfer decode` processes, no --verify and no
// --checksum; the decode's --digest is compared with the room's pattern and
// both sides must report the same outcome for every room.

// resultsByRoom reads n result lines of p, keyed by room.
func resultsByRoom(t *testing.T, p *proc, n int, limit time.Duration) map[uint64]replyLine {
	t.Helper()
	out := map[uint64]replyLine{}
	deadline := time.Now().Add(limit)
	for len(out) < n {
		r := p.result(time.Until(deadline))
		if r.Room == nil {
			t.Fatalf("%s: result without a room: %+v", p.name, r)
		}
		out[*r.Room] = r
	}
	return out
}

// Case 6: a decode with one metadata ring slot and 6 rooms in flight at once
// queues the rooms for the slot (within their waiting timeout) instead of
// failing all but one; every room lands whole and both sides agree.
func TestCLIRingBackpressure(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--ring-slots", "1", "--digest")...)
	p.ready()
	d.ready()
	const rooms = 6
	for i := range uint64(rooms) {
		p.send(requestLine{Room: 60 + i, Tokens: 16})
	}
	for i := range uint64(rooms) {
		d.send(requestLine{Room: 60 + i, Tokens: 16})
	}
	dr := resultsByRoom(t, d, rooms, 2*time.Minute)
	pr := resultsByRoom(t, p, rooms, time.Minute)
	for i := range uint64(rooms) {
		room := 60 + i
		agree(t, room, pr[room], dr[room])
		if !dr[room].OK {
			t.Fatalf("room %d failed with one ring slot: %s", room, dr[room].Error)
		}
		if want := expectedDigest(t, room, 16); dr[room].Digest != want {
			t.Fatalf("room %d: digest %s, want %s", room, dr[room].Digest, want)
		}
	}
}

// Case 5: the prefill fails a room at once (its pool cannot hold the
// request) before the decode asks for it; the decode, given the room 300 ms
// later, is answered with the prefill's reason when its TRANSFER arrives,
// not at its waiting timeout (20 s here).
func TestCLIEarlyPrefillFailure(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--pool-mb", "32")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--pool-mb", "160")...)
	p.ready()
	d.ready()
	p.send(requestLine{Room: 50, Tokens: 1024}) // 128 MiB of KV: 64 pages, the pool holds 16
	pr := p.result(time.Minute)
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	d.send(requestLine{Room: 50, Tokens: 1024})
	dr := d.result(time.Minute)
	took := time.Since(start)
	agree(t, 50, pr, dr)
	if !strings.Contains(dr.Error, "raise --pool-mb") || !strings.Contains(dr.Error, "before this TRANSFER arrived") {
		t.Fatalf("decode error %q: want the prefill's early failure (raise --pool-mb)", dr.Error)
	}
	if took > 10*time.Second {
		t.Fatalf("decode failed %s after its request: it waited (most of) its 20 s waiting timeout", took)
	}
	t.Logf("decode failed %s after its request line: %s", took.Round(time.Millisecond), dr.Error)
	// The pair serves the next room.
	p.send(requestLine{Room: 51, Tokens: 16})
	d.send(requestLine{Room: 51, Tokens: 16})
	if pr, dr := p.result(time.Minute), d.result(time.Minute); !pr.OK || !dr.OK {
		t.Fatalf("room after the early failure: prefill %+v, decode %+v", pr, dr)
	}
}

// resetDataConns resets (ss -K) every established TCP connection to or from
// a data listening port of process pid (its listening ports other than the
// control port), as an operator or a middlebox would; both processes stay up
// and the control channel is untouched. It returns how many sockets were
// reset, and skips the test where ss -K cannot (not root, or a kernel without
// CONFIG_INET_DIAG_DESTROY).
func resetDataConns(t *testing.T, pid int, controlEndpoint string) int {
	t.Helper()
	if _, err := exec.LookPath("ss"); err != nil {
		t.Skip("ss (iproute2) not installed: cannot reset connections")
	}
	u, err := url.Parse(controlEndpoint)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ss", "-Hltnp").Output()
	if err != nil {
		t.Fatalf("ss -ltnp: %v", err)
	}
	var ports []string
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.Contains(line, "pid="+strconv.Itoa(pid)+",") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		port := f[3][strings.LastIndex(f[3], ":")+1:]
		if port != u.Port() && !slices.Contains(ports, port) {
			ports = append(ports, port)
		}
	}
	if len(ports) == 0 {
		t.Fatalf("no data listening port of pid %d in:\n%s", pid, out)
	}
	n := 0
	for _, port := range ports {
		out, err := exec.Command("ss", "-HK", "state", "established", "( sport = :"+port+" or dport = :"+port+" )").CombinedOutput()
		if err != nil {
			t.Skipf("ss -K cannot reset sockets here (%v: %s): needs root and CONFIG_INET_DIAG_DESTROY", err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.TrimSpace(line) != "" && !strings.Contains(line, "RTNETLINK") {
				n++ // one line per socket reset
			}
		}
	}
	return n
}

// Case 1: the decode's established data connections are reset (ss -K) while
// the pair is idle, and again while the prefill is writing a room (the
// decode stopped for the moment of the reset, so the writes are in flight). A reset
// between rooms heals without a failed room (the next batch dials the
// connections again); the room that was being written when they broke fails
// once, on both sides, and the pair serves the next rooms without a restart.
func TestCLIDataConnectionReset(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if syscall.Geteuid() != 0 {
		t.Skip("ss -K needs root (CAP_NET_ADMIN)")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--pool-mb", "192", "--chunk-pages", "1")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--pool-mb", "192", "--digest")...)
	p.ready()
	ready := d.ready()
	room := func(id uint64, tokens int) (replyLine, replyLine) {
		t.Helper()
		p.send(requestLine{Room: id, Tokens: tokens})
		d.send(requestLine{Room: id, Tokens: tokens})
		dr, pr := d.result(time.Minute), p.result(time.Minute)
		agree(t, id, pr, dr)
		return pr, dr
	}
	ok := func(id uint64, tokens int) time.Time {
		t.Helper()
		_, dr := room(id, tokens)
		if !dr.OK || dr.Digest != expectedDigest(t, id, tokens) {
			t.Fatalf("room %d: %+v", id, dr)
		}
		return time.Now()
	}
	ok(1, 64)
	// Idle: reset, then the next room at once.
	if n := resetDataConns(t, d.cmd.Process.Pid, ready.Endpoint); n == 0 {
		t.Fatal("ss -K reset no connection")
	}
	start := time.Now()
	ok(2, 64)
	t.Logf("idle reset: the next room succeeded %s after the reset", time.Since(start).Round(time.Millisecond))
	// Mid-room: reset once the prefill has written 4 MiB of a 128 MiB room.
	const tokens = 1024
	p.send(requestLine{Room: 3, Tokens: tokens})
	time.Sleep(300 * time.Millisecond) // its pages are filled
	base := wchar(t, p.cmd.Process.Pid)
	d.send(requestLine{Room: 3, Tokens: tokens})
	for deadline := time.Now().Add(time.Minute); wchar(t, p.cmd.Process.Pid) < base+4<<20; time.Sleep(100 * time.Microsecond) {
		if time.Now().After(deadline) {
			t.Fatal("the prefill did not start writing room 3 within a minute")
		}
	}
	// Stop the decode so that the rest of the room's writes wait in the
	// socket buffers, reset, continue (the stop is far below its peers'
	// timeout): the reset lands in the middle of the room.
	if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	n := resetDataConns(t, d.cmd.Process.Pid, ready.Endpoint)
	start = time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	dr, pr := d.result(time.Minute), p.result(time.Minute)
	agree(t, 3, pr, dr)
	switch {
	case n == 0:
		t.Fatal("ss -K reset no connection mid-room")
	case dr.OK && dr.Digest != expectedDigest(t, 3, tokens):
		t.Fatalf("room 3 reported ok with wrong bytes: %+v", dr)
	case dr.OK:
		t.Log("room 3 finished before the reset reached its writes")
	default:
		t.Logf("room 3 failed on both sides %s after the reset: %s", time.Since(start).Round(time.Millisecond), dr.Error)
	}
	// The pair serves again without a restart.
	for id := uint64(4); id < 7; id++ {
		at := ok(id, 64)
		if id == 4 {
			t.Logf("mid-room reset: the next room succeeded %s after the reset", at.Sub(start).Round(time.Millisecond))
		}
	}
}

// --control-auth with the token in the environment: a room lands; a decode
// started with the same flag but another token cannot register with the
// prefill (its frames are dropped) and fails its room naming the token.
func TestCLIControlAuth(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	env := []string{"KVXFER_BOOTSTRAP_AUTH_TOKEN=s3cret", "KVXFER_CONTROL_AUTH=1"}
	p := startProc(t, "prefill", env, roleArgs("prefill", b, host)...)
	d := startProc(t, "decode", env, roleArgs("decode", b, host, "--digest")...)
	other := startProc(t, "decode (another token)", []string{"KVXFER_BOOTSTRAP_AUTH_TOKEN=other", "KVXFER_CONTROL_AUTH=1"},
		roleArgs("decode", b, host, "--bootstrap-timeout", "3s")...)
	p.ready()
	d.ready()
	other.ready()
	p.send(requestLine{Room: 70, Tokens: 16})
	d.send(requestLine{Room: 70, Tokens: 16})
	pr, dr := p.result(time.Minute), d.result(time.Minute)
	agree(t, 70, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 70, 16) {
		t.Fatalf("authenticated room: %+v", dr)
	}
	other.send(requestLine{Room: 71, Tokens: 16})
	if r := other.result(time.Minute); r.OK || !strings.Contains(r.Error, "same token") {
		t.Fatalf("decode with another token: %+v, want a failure naming the token", r)
	}
}
