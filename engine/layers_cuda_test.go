package engine_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/testenv"
	"github.com/kvxfer/kvxfer/workload"
)

// checkLayerwiseCUDA is the stream-ordered layer-wise room on a CUDA
// device (the fake library or a real GPU): the prefill's KV lives in device
// memory; its "forward pass" is a stream held by a gate (a kernel of
// unknown length), then per layer the copies that write that layer's KV
// and an event recorded after them, handed to SendLayers at once. The
// caller never blocks; nothing of the room moves while the gate is closed
// however long one waits; once it opens, every layer goes out after its
// event and the decode receives every byte (checked by the test, no
// VerifyKV, no checksum).
func checkLayerwiseCUDA(t *testing.T) {
	t.Helper()
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, onDevice: true})
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	lr := startDecodes(t, addr, []*rank{d}, 88, 6, 0)
	s, err := p.m.NewSender(lr.room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
	n, err := s.InitTokens(lr.tokens, lr.aux)
	if err != nil {
		t.Fatal(err)
	}
	src, err := p.pool.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	if err := workload.FillAux(p.pool, lr.room, lr.aux); err != nil {
		t.Fatal(err)
	}
	// The KV the forward pass will produce: the pattern, computed into a
	// host twin of the pool and staged in pinned memory for the copies.
	lay := p.pool.Layout()
	twin, err := workload.NewKVBuffers(lay, workload.BufferOptions{Name: "twin", Device: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer twin.Close()
	if err := workload.FillPattern(twin, lr.room, src, 0); err != nil {
		t.Fatal(err)
	}
	il := lay.ItemLen()
	pinned, err := cuda.AllocMapped(0, il*uint64(len(src)*lay.NumBuffers()))
	if err != nil {
		t.Fatal(err)
	}
	defer pinned.Close()
	stream, err := cuda.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	gate, err := stream.Gate()
	if err != nil {
		t.Fatal(err)
	}
	defer gate.Close()
	var evs []*cuda.Event
	defer func() {
		for _, e := range evs {
			e.Close()
		}
	}()
	off := uint64(0)
	for l := lay.StartLayer; l < lay.EndLayer; l++ {
		for kv := 0; kv < lay.KVs(); kv++ {
			i, _ := lay.BufferIndex(l, kv)
			for _, pg := range src {
				copy(pinned.Bytes()[off:off+il], twin.Bytes(i)[uint64(pg)*il:])
				if err := stream.MemcpyAsync(p.pool.Buffer(i).Addr+uintptr(uint64(pg)*il), pinned.Host()+uintptr(off), il, cuda.HostToDevice); err != nil {
					t.Fatal(err)
				}
				off += il
			}
		}
		ev, err := cuda.NewEvent(0)
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
		if err := stream.Record(ev); err != nil {
			t.Fatal(err)
		}
		if err := s.SendLayers(src, l, l, ev.Handle()); err != nil {
			t.Fatal(err)
		}
	}
	fctx, fcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err = s.Flush(fctx)
	fcancel()
	if !errors.Is(err, context.DeadlineExceeded) || s.BytesSent() != 0 || lr.recvs[0].Poll() != engine.KVTransferring {
		t.Fatalf("behind the closed gate: Flush %v, %d bytes sent, decode %s; want nothing moved", err, s.BytesSent(), lr.recvs[0].Poll())
	}
	gate.Open()
	lr.verifyDecodes(t, ctx, []*rank{d})
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
}

// lwCUDAChild marks the test binary re-run with the fake CUDA libraries
// in its environment.
const lwCUDAChild = "KVXFER_TEST_LAYERWISE_CUDA_CHILD"

// TestLayerwiseCUDAEventFake runs the stream-ordered room on the fake CUDA
// library (host memory behind the CUDA API, real asynchronous streams). The
// tcp transport chooses its device copier when the process starts (from
// the environment naming the CUDA libraries), so the test runs itself again
// with the fake's environment.
func TestLayerwiseCUDAEventFake(t *testing.T) {
	testenv.InFakeCUDAProcess(t, lwCUDAChild, "TestLayerwiseCUDAEventFake", checkLayerwiseCUDA)
}

// TestLayerwiseCUDAEventGPU is the same on a real GPU (scripts/gpu-check.sh
// runs it with KVXFER_REQUIRE_GPU=1).
func TestLayerwiseCUDAEventGPU(t *testing.T) {
	testenv.RequireGPU(t)
	checkLayerwiseCUDA(t)
}
