package shm

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// stuckCopy makes the segment's sender slot look like a copy unit is in
// progress on the current phase (as a sender stopped by SIGSTOP in the
// middle of a memcpy leaves it) and returns the function that ends it.
func stuckCopy(t *testing.T, seg transport.Segment) func() {
	t.Helper()
	s := seg.(*segment)
	ph := atomic.LoadUint64(&s.slot[sPhase]) & 1
	atomic.AddUint64(&s.slot[sCount0+ph], 1)
	return func() { atomic.AddUint64(&s.slot[sCount0+ph], ^uint64(0)) }
}

// A fence waits for a copy unit in progress: it fails (naming the pid) while
// the unit runs, and succeeds once it ended; a later write of the fenced
// segment is refused with ErrFenced.
func TestFenceWaitsForCopyInProgress(t *testing.T) {
	p := newPair(t, 1<<20, transport.DefaultOptions())
	rcv := p.rcv.(*shmTransport)
	epoch := transport.NewEpoch()
	if err := rcv.AdmitEpoch("snd", epoch); err != nil {
		t.Fatal(err)
	}
	ep, _ := p.rcv.Endpoint(context.Background(), "snd")
	seg, err := p.snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{p.dDesc}, Epoch: epoch})
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	end := stuckCopy(t, seg)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err = rcv.FenceEpoch(ctx, "snd", epoch)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "pid") {
		t.Fatalf("fence with a copy in progress: %v, want the deadline, naming the sender's pid", err)
	}
	end()
	if err := rcv.FenceEpoch(context.Background(), "snd", epoch); err != nil {
		t.Fatalf("fence once the copy ended: %v", err)
	}
	_, err = seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: 4096}}})
	if !errors.Is(err, transport.ErrFenced) || !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("submit on the fenced segment: %v, want ErrFenced and ErrPeerLost", err)
	}
}

// DeregisterMemory waits for a copy in progress (bounded) and names the
// sender; a sender that exited does not hold it.
func TestDeregisterWaitsForCopyInProgress(t *testing.T) {
	p := newPair(t, 1<<20, transport.DefaultOptions())
	end := stuckCopy(t, p.seg)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- p.rcv.DeregisterMemory(p.dDesc.ID) }()
	select {
	case err := <-done:
		t.Fatalf("DeregisterMemory returned %v after %s with a copy in progress", err, time.Since(start))
	case <-time.After(300 * time.Millisecond):
	}
	end()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("DeregisterMemory after the copy ended: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("DeregisterMemory did not return after the copy ended")
	}
	// A slot whose sender exited does not hold a deregistration: make the
	// slot name a process that has exited.
	q := newPair(t, 1<<20, transport.DefaultOptions())
	stuckCopy(t, q.seg)
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	s := q.seg.(*segment)
	atomic.StoreUint64(&s.slot[sPID], uint64(cmd.Process.Pid))
	t0 := time.Now()
	if err := q.rcv.DeregisterMemory(q.dDesc.ID); err != nil {
		t.Fatalf("DeregisterMemory with the stuck sender gone (pid %d): %v", cmd.Process.Pid, err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("DeregisterMemory took %s although the sender had exited", d)
	}
}

// A segment opened with an epoch the receiver never admitted, or fenced, is
// refused at OpenSegment; epoch 0 is never checked.
func TestOpenSegmentEpochAdmission(t *testing.T) {
	p := newPair(t, 1<<16, transport.DefaultOptions())
	rcv := p.rcv.(*shmTransport)
	ep, _ := p.rcv.Endpoint(context.Background(), "snd")
	open := func(epoch uint64) error {
		seg, err := p.snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{p.dDesc}, Epoch: epoch})
		if err == nil {
			seg.Close()
		}
		return err
	}
	never := transport.NewEpoch()
	if err := open(never); !errors.Is(err, transport.ErrFenced) || !strings.Contains(err.Error(), strconv.FormatUint(never, 10)) {
		t.Fatalf("epoch never admitted: %v, want ErrFenced naming it", err)
	}
	e := transport.NewEpoch()
	if err := rcv.AdmitEpoch("snd", e); err != nil {
		t.Fatal(err)
	}
	if err := open(e); err != nil {
		t.Fatalf("admitted epoch: %v", err)
	}
	if err := rcv.FenceEpoch(context.Background(), "snd", e); err != nil {
		t.Fatal(err)
	}
	if err := open(e); !errors.Is(err, transport.ErrFenced) {
		t.Fatalf("fenced epoch: %v, want ErrFenced", err)
	}
	if err := open(0); err != nil {
		t.Fatalf("epoch 0: %v", err)
	}
	// Sender slots are given back at Close: many opens do not run out.
	for i := 0; i < 2*sendSlots; i++ {
		if err := open(0); err != nil {
			t.Fatalf("open %d: %v (slots not given back?)", i, err)
		}
	}
}
