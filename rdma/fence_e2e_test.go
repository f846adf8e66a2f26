package rdma_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/rdma"
	"github.com/kvxfer/kvxfer/workload"
)

// TestFencingOverRDMA is the fencing issue's stale-writer case over rdma
// (make test-rdma): the producer of room A stalls in the middle of the
// transfer (its writes held, its control messages lost, as a process stopped
// with SIGSTOP); the decode fails A at its waiting timeout, and after the
// fence timeout moves the producer's QPs to the error state and destroys
// them before it hands A's pages back. The test then reuses the pages and
// lets the producer post its held writes: they cannot land (the NIC has no
// QP to execute them), and the next room on the pair succeeds on new QPs (a
// new epoch), its bytes checked by the test.
func TestFencingOverRDMA(t *testing.T) {
	rdma.RequireRDMA(t)
	model := workload.ModelConfig{Name: "tiny-gqa", NumLayers: 4, NumKVHeads: 4, HeadDim: 16, DtypeBytes: 2}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	addr := startBootstrap(t)

	type rank struct {
		m    *engine.Manager
		pool *workload.KVBuffers
	}
	drop := faulty.DropControl()
	var ft *faulty.Transport
	newRank := func(role engine.Role) *rank {
		l, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 64})
		if err != nil {
			t.Fatal(err)
		}
		pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "rdma-fence", Device: -1, Aux: workload.DefaultAux, AuxRows: 16})
		if err != nil {
			t.Fatal(err)
		}
		opts := transport.DefaultOptions()
		// A vanished responder QP fails the sender's writes in about a
		// second (or at the 3 s stall backstop on a silent rxe).
		qpTimeout, retry := uint8(14), uint8(3)
		opts.RDMA = transport.RDMAOptions{QPTimeout: &qpTimeout, RetryCount: &retry, StallTimeout: 3 * time.Second}
		inner, err := transport.OpenTransport("rdma", opts)
		if err != nil {
			t.Fatal(err)
		}
		tr := inner
		cfg := engine.ManagerConfig{Role: role, KV: pool.Args(), BootstrapAddr: addr,
			BootstrapTimeout: 30 * time.Second, WaitingTimeout: 2 * time.Second, FenceTimeout: 500 * time.Millisecond, PeerTimeout: time.Minute}
		if role == engine.RolePrefill {
			ft = faulty.Wrap(inner)
			tr = ft
			cfg.ControlFault = drop.Filter
		} else {
			cfg.BootstrapAddr = ""
		}
		cfg.Transports = []transport.Transport{tr}
		m, err := engine.NewManager(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close(); tr.Close(); pool.Close() })
		return &rank{m: m, pool: pool}
	}
	pre := newRank(engine.RolePrefill)
	dec := newRank(engine.RoleDecode)

	const pages = 8
	fill := func(pg []int32, v byte) {
		for i := range dec.pool.Args().KVBuffers {
			item := dec.pool.Buffer(i).ItemLen
			b := dec.pool.Bytes(i)
			for _, p := range pg {
				for j := uint64(p) * item; j < uint64(p+1)*item; j++ {
					b[j] = v
				}
			}
		}
	}
	same := func(pg []int32, v byte) error {
		for i := range dec.pool.Args().KVBuffers {
			item := dec.pool.Buffer(i).ItemLen
			b := dec.pool.Bytes(i)
			for _, p := range pg {
				for j := uint64(p) * item; j < uint64(p+1)*item; j++ {
					if b[j] != v {
						return fmt.Errorf("buffer %d page %d byte %d is %#x, want %#x: a late write landed", i, p, j-uint64(p)*item, b[j], v)
					}
				}
			}
		}
		return nil
	}
	// room opens both sides of a room and waits until the sender may send.
	room := func(id uint64) (*engine.Sender, *engine.Receiver, []int32, []int32) {
		dst, err := dec.pool.Alloc(pages)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dec.pool.Free(dst) })
		fill(dst, 0xAA)
		r, err := dec.m.NewReceiver(addr, id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		if err := r.Init(dst); err != nil {
			t.Fatal(err)
		}
		s, err := pre.m.NewSender(id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("room %d: sender %s %v", id, st, s.Failure())
		}
		src, err := pre.pool.Alloc(pages)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pre.pool.Free(src) })
		_ = workload.FillPattern(pre.pool, id, src, 0)
		return s, r, src, dst
	}

	sa, ra, srcA, dstA := room(1)
	if err := sa.Send(srcA[:4], false); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); sa.BytesSent() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first chunk never landed")
		}
	}
	ft.Stall()
	drop.DropFor(5 * time.Second)
	if err := sa.Send(srcA[4:], true); err != nil {
		t.Fatal(err)
	}
	if st := ra.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("decode room A: %s, want Failed at its waiting timeout", st)
	}
	t0 := time.Now()
	ra.Close() // returns once the producer's QPs are fenced
	t.Logf("room A failed on the decode (%v); pages handed back %s later", ra.Failure(), time.Since(t0).Round(time.Millisecond))
	fill(dstA, 0x55)
	ft.Resume()
	if st := sa.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("prefill room A: %s, want Failed", st)
	}
	time.Sleep(2 * time.Second)
	if err := same(dstA, 0x55); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // the control-channel drop ends
	sb, rb, srcB, dstB := room(2)
	if err := sb.Send(srcB, true); err != nil {
		t.Fatal(err)
	}
	rb.Wait(ctx, engine.KVSuccess)
	sb.Wait(ctx, engine.KVSuccess)
	if rb.Poll() != engine.KVSuccess || sb.Poll() != engine.KVSuccess {
		t.Fatalf("room B on new QPs: prefill %s %v, decode %s %v", sb.Poll(), sb.Failure(), rb.Poll(), rb.Failure())
	}
	if err := workload.VerifyPattern(dec.pool, 2, dstB, 0); err != nil {
		t.Fatal(err)
	}
}
