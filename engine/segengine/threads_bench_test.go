package segengine_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// BenchmarkThreads: vLLM's sender pool one level below Python: 10
// goroutines sharing one engine, each writing 16 blocks of 256 KiB per
// batch (SubmitEntries, then Wait), against one goroutine writing 160
// blocks per batch: the same total depth and the same 40 MiB per round,
// over tcp and shm. python/bench.py's threads row is the same shape
// through ctypes; the two together tell the engine's share of its ratio
// from the Python side's.
//
//	go test -run '^$' -bench Threads -benchtime 20x -count 3 ./engine/segengine
func BenchmarkThreads(b *testing.B) {
	for _, tr := range []string{"tcp", "shm"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		for _, threads := range []int{1, 10} {
			b.Run(fmt.Sprintf("%s/threads=%d", tr, threads), func(b *testing.B) { benchThreads(b, tr, threads) })
		}
	}
}

func benchThreads(b *testing.B, tr string, threads int) {
	const depth, block = 160, 256 << 10
	recv := newTE(b, tr)
	send := newTE(b, tr)
	dst, _ := regBuf(b, recv, "dst", depth*block)
	src, _ := regBuf(b, send, "src", depth*block)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		b.Fatal(err)
	}
	defer seg.Close()
	per := depth / threads
	batches := make([]segengine.Entries, threads)
	for t := range batches {
		e := segengine.Entries{Region: segengine.PeerAddressRegion}
		for k := t * per; k < (t+1)*per; k++ {
			e.Local = append(e.Local, uint64(src.Addr())+uint64(k*block))
			e.Remote = append(e.Remote, uint64(dst.Addr())+uint64(k*block))
			e.Length = append(e.Length, block)
		}
		batches[t] = e
	}
	round := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		errs := make([]error, threads)
		var wg sync.WaitGroup
		for t := range batches {
			wg.Add(1)
			go func() {
				defer wg.Done()
				id, err := seg.SubmitEntries(ctx, transport.OpWrite, batches[t])
				if err != nil {
					errs[t] = err
					return
				}
				defer seg.Release(id)
				if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
					errs[t] = fmt.Errorf("batch %v: %v", st.State, st.Err)
				}
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	}
	if err := round(); err != nil { // first touch, untimed
		b.Fatal(err)
	}
	b.SetBytes(depth * block)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := round(); err != nil {
			b.Fatal(err)
		}
	}
}
