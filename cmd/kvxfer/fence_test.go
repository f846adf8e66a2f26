package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/workload"
)

// The fencing issue's cases at the CLI level: real `kvxfer prefill` and
// `kvxfer decode` processes, no --verify and no --checksum (the production
// setting). The test checks the received bytes itself: the decode prints a
// SHA-256 of each room's KV (--digest) and the test compares it with the
// digest of the room's pattern on a local buffer of the same layout.

// expectedDigest is the digest of room's test pattern over tokens tokens of
// llama-3.1-8b with 16-token pages, as a decode that received it whole
// reports it.
func expectedDigest(t *testing.T, room uint64, tokens int) string {
	t.Helper()
	m, err := workload.LookupModel("llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	n := (tokens + 15) / 16
	l, err := workload.NewLayout(m, workload.LayoutOptions{PageSize: 16, TPSize: 1, PPSize: 1, NumPages: n})
	if err != nil {
		t.Fatal(err)
	}
	b, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "expected", Device: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	pages := make([]int32, n)
	for i := range pages {
		pages[i] = int32(i)
	}
	if err := workload.FillPattern(b, room, pages, 0); err != nil {
		t.Fatal(err)
	}
	d, err := b.Digest(pages)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// wchar returns the bytes process pid wrote through write system calls
// (sockets included), from /proc/PID/io.
func wchar(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/io")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no wchar in /proc/%d/io", pid)
	return 0
}

// agree fails the test unless the prefill's and the decode's result lines
// for a room report the same outcome.
func agree(t *testing.T, room uint64, pre, dec replyLine) {
	t.Helper()
	if pre.OK != dec.OK {
		t.Fatalf("room %d: outcomes differ: prefill ok=%v (%s), decode ok=%v (%s)", room, pre.OK, pre.Error, dec.OK, dec.Error)
	}
}

// Case 1: a stale writer must not reach the next room. Prefill P1 (its own
// bootstrap) is stopped with SIGSTOP while it serves room A: over tcp in the
// middle of writing it (once it wrote a few MiB, as /proc/PID/io shows); over
// shm, whose copies /proc/PID/io does not count, just before A's TRANSFER
// reaches it. The decode fails A at its waiting timeout and, with a pool that
// holds one room, gives A's pages to room B from prefill P2 only once P1's
// data path is fenced. P1 is continued while B is being consumed (--hold):
// its writes resume, but nothing of A lands in B, B's bytes are P2's, and
// both sides agree on A (failed) and B (ok).
func TestCLIStaleWriterFenced(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) { testCLIStaleWriterFenced(t, tr) })
	}
}

func testCLIStaleWriterFenced(t *testing.T, transport string) {
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	const tokens = 512 // 64 MiB of llama-3.1-8b KV: the decode's whole pool
	_, b1 := startBootstrapProc(t, host, 0)
	_, b2 := startBootstrapProc(t, host, 0)
	tr := []string{"--transport", transport}
	p1 := startProc(t, "prefill P1", nil, append(roleArgs("prefill", b1, host, "--pool-mb", "80", "--chunk-pages", "1"), tr...)...)
	p2 := startProc(t, "prefill P2", nil, append(roleArgs("prefill", b2, host, "--pool-mb", "80"), tr...)...)
	d := startProc(t, "decode", nil, append(roleArgs("decode", b1, host, "--pool-mb", "64", "--waiting-timeout", "3s", "--peer-timeout", "30s",
		"--fence-timeout", "2s", "--digest", "--hold", "4s"), tr...)...)
	p1.ready()
	p2.ready()
	d.ready()
	// A warm-up room registers the decode with P1 (its data path is open).
	p1.send(requestLine{Room: 100, Tokens: 16})
	d.send(requestLine{Room: 100, Tokens: 16})
	if pr, dr := p1.result(time.Minute), d.result(time.Minute); !pr.OK || !dr.OK {
		t.Fatalf("warm-up room: prefill %+v, decode %+v", pr, dr)
	}
	const roomA, roomB = 101, 102
	p1.send(requestLine{Room: roomA, Tokens: tokens})
	p2.send(requestLine{Room: roomB, Tokens: tokens})
	time.Sleep(500 * time.Millisecond) // P1 has filled A's pages and waits for TRANSFER
	stop := func() {
		if err := p1.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	if transport == "tcp" {
		base := wchar(t, p1.cmd.Process.Pid)
		d.send(requestLine{Room: roomA, Tokens: tokens, Bootstrap: b1})
		for deadline := time.Now().Add(time.Minute); wchar(t, p1.cmd.Process.Pid) < base+8<<20; time.Sleep(100 * time.Microsecond) {
			if time.Now().After(deadline) {
				t.Fatal("P1 did not start writing room A within a minute")
			}
		}
		stop()
		t.Logf("P1 stopped after writing %d MiB (of %d) since room A's TRANSFER", (wchar(t, p1.cmd.Process.Pid)-base)>>20, tokens*128>>10)
	} else {
		stop()
		d.send(requestLine{Room: roomA, Tokens: tokens, Bootstrap: b1})
	}
	stopped := true
	defer func() {
		if stopped {
			_ = p1.cmd.Process.Signal(syscall.SIGCONT)
		}
	}()
	da := d.result(time.Minute)
	if da.OK {
		t.Fatalf("room A succeeded on the decode although its producer was stopped: %+v", da)
	}
	t.Logf("decode failed room A: %s", da.Error)
	d.send(requestLine{Room: roomB, Tokens: tokens, Bootstrap: b2})
	time.Sleep(4 * time.Second) // B's pages come back from A once P1 is fenced; B lands
	if err := p1.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	stopped = false
	db := d.result(2 * time.Minute)
	pb := p2.result(time.Minute)
	agree(t, roomB, pb, db)
	if !db.OK {
		t.Fatalf("room B failed: %s", db.Error)
	}
	if want := expectedDigest(t, roomB, tokens); db.Digest != want {
		t.Fatalf("room B's bytes on the decode are not P2's: digest %s, want %s (a stale writer reached them)", db.Digest, want)
	}
	pa := p1.result(time.Minute)
	agree(t, roomA, pa, da)
	if !strings.Contains(pa.Error, "aborted by decode") && !strings.Contains(pa.Error, "fenced") && !strings.Contains(pa.Error, "peer lost") {
		t.Fatalf("prefill P1's room A error %q: want it to name the decode's abort or the fenced data path", pa.Error)
	}
	t.Logf("prefill P1 reports room A: %s", pa.Error)
	// The pair P1/decode serves again (a new data path, new epoch).
	p1.send(requestLine{Room: 103, Tokens: 16})
	d.send(requestLine{Room: 103, Tokens: 16, Bootstrap: b1})
	pr, dr := p1.result(time.Minute), d.result(time.Minute)
	agree(t, 103, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 103, 16) {
		t.Fatalf("room after the fence: decode %+v", dr)
	}
}

// Case 2: the decode fails the room (waiting timeout) while the prefill is
// stopped (SIGSTOP, continued after 1.5 s): the prefill does not write it and
// reports it failed, naming the decode's reason. Case 4: a token count
// mismatch fails the room on both sides, naming both counts.
func TestCLIOneOutcome(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--pool-mb", "160", "--chunk-pages", "1")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--pool-mb", "160", "--waiting-timeout", "300ms", "--digest")...)
	p.ready()
	d.ready()
	// Warm up the pair (registration), then case 2.
	p.send(requestLine{Room: 10, Tokens: 16})
	d.send(requestLine{Room: 10, Tokens: 16})
	if pr, dr := p.result(time.Minute), d.result(time.Minute); !pr.OK || !dr.OK {
		t.Fatalf("warm-up room: prefill %+v, decode %+v", pr, dr)
	}
	p.send(requestLine{Room: 1, Tokens: 1024})
	time.Sleep(300 * time.Millisecond) // its pages are filled
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	d.send(requestLine{Room: 1, Tokens: 1024})
	dr := d.result(time.Minute)
	time.Sleep(time.Second)
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	pr := p.result(time.Minute)
	agree(t, 1, pr, dr)
	if !strings.Contains(pr.Error, "aborted by decode") || !strings.Contains(pr.Error, "300ms") {
		t.Fatalf("prefill error %q: want aborted by decode with its waiting-timeout reason", pr.Error)
	}
	// Case 4: 1 token vs 16 (same page count), and 17 vs 32.
	for i, c := range []struct{ p, d int }{{1, 16}, {17, 32}} {
		room := uint64(2 + i)
		p.send(requestLine{Room: room, Tokens: c.p})
		d.send(requestLine{Room: room, Tokens: c.d})
		pr, dr := p.result(time.Minute), d.result(time.Minute)
		agree(t, room, pr, dr)
		for _, e := range []string{pr.Error, dr.Error} {
			if !strings.Contains(e, "token count mismatch") {
				t.Fatalf("room %d (%d vs %d tokens): %q, want a token count mismatch naming both", room, c.p, c.d, e)
			}
		}
	}
	// A clean room on the same pair, bytes checked here.
	p.send(requestLine{Room: 9, Tokens: 48})
	d.send(requestLine{Room: 9, Tokens: 48})
	pr, dr = p.result(time.Minute), d.result(time.Minute)
	agree(t, 9, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 9, 48) {
		t.Fatalf("clean room: prefill %+v decode %+v", pr, dr)
	}
}

func TestCLIDtypeRefusalReachesPrefill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--kv-cache-dtype", "fp8_e4m3", "--bootstrap-timeout", "60s")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host)...)
	p.ready()
	d.ready()
	p.send(requestLine{Room: 5, Tokens: 16})
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	d.send(requestLine{Room: 5, Tokens: 16})
	dr := d.result(time.Minute)
	pr := p.result(30 * time.Second) // its bootstrap timeout is 60 s
	agree(t, 5, pr, dr)
	if !strings.Contains(pr.Error, "kv_cache_dtype") || !strings.Contains(pr.Error, "aborted by decode") {
		t.Fatalf("prefill error %q: want aborted by decode, naming kv_cache_dtype", pr.Error)
	}
	t.Logf("prefill failed %s after the decode's line: %s", time.Since(start).Round(time.Millisecond), pr.Error)
}
