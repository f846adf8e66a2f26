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
