package shm

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMapPeerFDNamesEMFILE: a process out of file descriptors is told so,
// with its RLIMIT_NOFILE and what to raise (before: "receiver gone, other
// user, or other pid namespace", which sent the operator after the peer).
func TestMapPeerFDNamesEMFILE(t *testing.T) {
	fd, err := unix.MemfdCreate("kvxfer-emfile", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skip("memfd_create:", err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 4096); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	// The highest descriptor in use bounds what the process holds now: a
	// soft limit at it leaves no descriptor for the open.
	top := 0
	for _, e := range ents {
		var n int
		for _, c := range e.Name() {
			n = n*10 + int(c-'0')
		}
		top = max(top, n)
	}
	lim := unix.Rlimit{Cur: uint64(top + 1), Max: old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Skip("setrlimit:", err)
	}
	// Fill every free descriptor below the limit, so the next open fails.
	var fill []int
	for {
		f, err := unix.Dup(fd)
		if err != nil {
			break
		}
		fill = append(fill, f)
	}
	_, err = mapPeerFD(os.Getpid(), fd, uint64(st.Dev), st.Ino, 0, 4096, false)
	for _, f := range fill {
		unix.Close(f)
	}
	if rerr := unix.Setrlimit(unix.RLIMIT_NOFILE, &old); rerr != nil {
		t.Fatal(rerr)
	}
	if err == nil {
		t.Fatal("mapPeerFD succeeded with no descriptor left")
	}
	if msg := err.Error(); !strings.Contains(msg, "EMFILE") || !strings.Contains(msg, "RLIMIT_NOFILE") || !strings.Contains(msg, "ulimit -n") || strings.Contains(msg, "pid namespace") {
		t.Fatalf("error %q: want EMFILE named with the limit and ulimit -n, not the receiver blamed", msg)
	}
}
