package main

import (
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine"
)

// TestGatedReaderBoundary: the stop signal's boundary is what the source
// held when it came, read or not. A line written before mark is served
// (afterStop false) even when the reading goroutine had not read it yet,
// as on a loaded machine (CI failed TestRoleSIGTERMDrainsInFlight this
// way); a line written after mark is refused; a mark that interrupts a
// Read in flight loses no byte.
func TestGatedReaderBoundary(t *testing.T) {
	for _, c := range []struct {
		name string
		// startFirst starts the reading goroutine (blocked in Read) before
		// the line is written and mark is called.
		startFirst bool
	}{
		{"line unread at the signal", false},
		{"read in flight at the signal", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var fds [2]int
			if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			// A non-blocking pipe read through os.File has deadlines, as
			// stdinReader's duplicate of fd 0.
			src, wf := os.NewFile(uintptr(fds[0]), "pipe"), os.NewFile(uintptr(fds[1]), "pipe")
			defer wf.Close()
			defer src.Close()
			pending := func() (int, error) { return unix.IoctlGetInt(fds[0], unix.TIOCINQ) }
			g := newGatedReader(src, pending, src.SetReadDeadline)
			lines := make(chan inputLine, 4)
			start := func() { go g.run(engine.RoleDecode, func(in inputLine) { lines <- in }) }
			if c.startFirst {
				start()
				waitInRead(t, g)
			}
			if _, err := wf.WriteString("{\"room\":1,\"tokens\":8}\n"); err != nil {
				t.Fatal(err)
			}
			if c.startFirst {
				// Let the blocked Read take the line before the mark half
				// the time; either way nothing may be lost.
				time.Sleep(time.Millisecond)
			}
			g.mark()
			if !c.startFirst {
				start()
			}
			if _, err := wf.WriteString("{\"room\":2,\"tokens\":8}\n"); err != nil {
				t.Fatal(err)
			}
			for _, want := range []struct {
				room      uint64
				afterStop bool
			}{{1, false}, {2, true}} {
				select {
				case in := <-lines:
					if in.q.Room != want.room || in.afterStop != want.afterStop || !in.gated {
						t.Fatalf("line %+v: want room %d afterStop %v", in, want.room, want.afterStop)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("room %d's line never handed on", want.room)
				}
			}
		})
	}
}

// waitInRead returns once g's reading goroutine waits in Read.
func waitInRead(t *testing.T, g *gatedReader) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		g.mu.Lock()
		in := g.inRead
		g.mu.Unlock()
		if in {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the reading goroutine never entered Read")
}
