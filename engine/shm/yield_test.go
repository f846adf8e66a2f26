package shm

import (
	"context"
	"runtime"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestLargeCopyYields (about 2.5 s under -race): a large batch must leave
// the processor to other goroutines between its 1 MiB pieces. With
// GOMAXPROCS 1 and the copy on the submitting goroutine, an observer
// goroutine that only runs when the copy yields must see the batch half done
// at three quarters or more of its piece boundaries (without the yield: 1 of
// 32, or about 12 under -race, whose instrumentation adds preemption points).
// Without the yield the copy (runtime.memmove, not preemptible) holds the
// only P for the whole batch: a process's control loop, heartbeats and
// timers starve and peers declare it hung (issue 18, liveness under load).
func TestLargeCopyYields(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	const pieces = 32
	const size = pieces * chunkBytes
	p := newPair(t, size, transport.Options{Streams: 1}) // copied on the submitting goroutine
	src, dst := p.src.Bytes(), p.dst.Bytes()
	last := func(k int) int { return (k+1)*chunkBytes - 1 } // src[last(k)] != 0 for this pattern
	if src[last(0)] == 0 {
		t.Fatal("source pattern has a zero at the piece ends; pick another probe byte")
	}
	copied := func() int {
		n := 0
		for k := 0; k < pieces; k++ {
			if dst[last(k)] != 0 {
				n++
			}
		}
		return n
	}
	start := make(chan struct{})
	stop := make(chan struct{})
	seen := make(chan int)
	go func() {
		<-start
		distinct, prev := 0, -1
		for {
			select {
			case <-stop:
				seen <- distinct
				return
			default:
			}
			if n := copied(); n > 0 && n < pieces && n != prev {
				distinct, prev = distinct+1, n
			}
			runtime.Gosched()
		}
	}()
	close(start)
	runtime.Gosched() // let the observer reach its loop
	id, err := p.seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: p.src.Addr(), Remote: p.dDesc.ID, Length: size}}})
	if err != nil {
		t.Fatal(err)
	}
	if st := waitOK(t, p.seg, id); st.State != transport.BatchCompleted {
		t.Fatalf("batch %+v, want completed", st)
	}
	close(stop)
	distinct := <-seen
	t.Logf("observer ran at %d distinct points inside a %d-piece copy", distinct, pieces)
	if distinct < pieces*3/4 {
		t.Fatalf("the observer goroutine saw the copy half done at only %d of %d piece boundaries: the copy does not yield the processor between pieces", distinct, pieces)
	}
}

// TestCopyPlan: which batches Submit copies on the caller's goroutine, on
// how many goroutines of their own the others, and which copies yield
// between units. A 4 MiB batch (vLLM's sender pool: 16 × 256 KiB per call)
// is copied by its caller without yielding; a batch from parallelMin is
// split, and its workers yield; an inline copy of inlineYieldMin or more
// (one copy thread, or a raised parallelMin) yields as before.
func TestCopyPlan(t *testing.T) {
	def := &shmTransport{copyThreads: 2, parallelMin: defaultParallelMin}
	one := &shmTransport{copyThreads: 1, parallelMin: defaultParallelMin}
	big := &shmTransport{copyThreads: 4, parallelMin: 64 << 20}
	for _, c := range []struct {
		name    string
		t       *shmTransport
		total   uint64
		units   int
		workers int
		yield   bool
	}{
		{"64 KiB", def, 64 << 10, 1, 0, false},
		{"4 MiB sync call", def, 4 << 20, 4, 0, false},
		{"just under parallelMin", def, defaultParallelMin - 1, 8, 0, false},
		{"parallelMin", def, defaultParallelMin, 8, 2, true},
		{"1 GiB", def, 1 << 30, 1024, 2, true},
		{"large, one unit", def, 1 << 30, 1, 0, true},
		{"one copy thread, 4 MiB", one, 4 << 20, 4, 0, false},
		{"one copy thread, 32 MiB", one, 32 << 20, 32, 0, true},
		{"raised parallelMin, 16 MiB", big, 16 << 20, 16, 0, true},
		{"threads capped by units", big, 64 << 20, 3, 3, true},
	} {
		w, y := c.t.copyPlan(c.total, c.units)
		if w != c.workers || y != c.yield {
			t.Errorf("%s: copyPlan(%d bytes, %d units) = %d workers, yield %v; want %d, %v", c.name, c.total, c.units, w, y, c.workers, c.yield)
		}
	}
}
