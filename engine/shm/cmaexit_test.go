package shm

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestCMAPeerExitedSaysWhoAndWhatToDo: a cma READ from a peer process that
// exited fails with ErrPeerLost naming that peer as the process the READ
// copies from (before: "receiver pid N exited during the batch
// (process_vm_readv: no such process)", which reads like a fault of the
// reading process, the one receiving the bytes) and saying what to do;
// likewise the WRITE, and a batch after the peer is gone.
func TestCMAPeerExitedSaysWhoAndWhatToDo(t *testing.T) {
	skipWithoutCMA(t)
	info, kill := remoteReceiverEnv(t, 1<<20, childCMAEnv+"=1")
	snd, err := NewCMA(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	anon, err := anonMemory(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := snd.RegisterMemory(anon); err != nil {
		t.Fatal(err)
	}
	seg, err := snd.OpenSegment(context.Background(), info)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	run := func(op transport.Op) error {
		b := &transport.TransferBatch{Op: op, Requests: []transport.WriteRequest{{Local: anon.Addr, Remote: info.Regions[0].ID, Length: 4096}}}
		id, err := seg.Submit(context.Background(), b)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		st, err := seg.Wait(ctx, id)
		if err != nil {
			return err
		}
		return st.Err
	}
	check := func(what string, err error, want ...string) {
		t.Helper()
		if !errors.Is(err, transport.ErrPeerLost) {
			t.Fatalf("%s: %v, want ErrPeerLost", what, err)
		}
		for _, w := range append(want, "open the segment again once the") {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", what, err, w)
			}
		}
	}
	if err := run(transport.OpRead); err != nil {
		t.Fatalf("READ from the live peer: %v", err)
	}
	// The kernel's answer for a pid whose process exited, while the
	// transport still thinks the peer is alive (the exit between its
	// checks and the copy).
	old := processVMReadv
	processVMReadv = func(int, []unix.Iovec, []unix.RemoteIovec, uint) (int, error) { return 0, unix.ESRCH }
	err = run(transport.OpRead)
	processVMReadv = old
	check("READ, ESRCH", err, "the peer process (pid ", "whose memory this READ copies from exited during the batch", "process_vm_readv", "this process is fine")
	oldW := processVMWritev
	processVMWritev = func(int, []unix.Iovec, []unix.RemoteIovec, uint) (int, error) { return 0, unix.ESRCH }
	err = run(transport.OpWrite)
	processVMWritev = oldW
	check("WRITE, ESRCH", err, "the receiver process (pid ", "this WRITE copies into exited during the batch", "process_vm_writev")

	// The peer really exits: the next READ fails the same way, at
	// Submit or when the batch ends.
	kill()
	deadline := time.Now().Add(30 * time.Second)
	for err = run(transport.OpRead); err == nil && time.Now().Before(deadline); err = run(transport.OpRead) {
		time.Sleep(10 * time.Millisecond) // the pidfd watcher has not seen the exit yet
	}
	check("READ after the peer exited", err, "the peer process (pid ", "whose memory this READ copies from exited")
}
