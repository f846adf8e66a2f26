package rdma_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/rdma"
	"github.com/kvxfer/kvxfer/workload"
)

// TestKVTransferOverRDMA runs the engine's prefill Sender and decode Receiver
// over the rdma transport only: 2 prefill TP ranks -> 1 decode rank, a
// 4-layer GQA model as per-layer K/V buffers (each its own registration, on
// the decode split into MRs of at most max_mr_size = 8 KiB), the decode pages
// fragmented, an aux row; the receiver verifies the room-tagged metadata
// record and the test verifies every KV and aux byte.
func TestKVTransferOverRDMA(t *testing.T) {
	rdma.RequireRDMA(t)
	model := workload.ModelConfig{Name: "tiny-gqa", NumLayers: 4, NumKVHeads: 4, HeadDim: 16, DtypeBytes: 2}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	addr := startBootstrap(t)

	type rank struct {
		m    *engine.Manager
		pool *workload.KVBuffers
	}
	newRank := func(role engine.Role, tp, tpRank int) *rank {
		l, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: 4, TPSize: tp, TPRank: tpRank, PPSize: 1, NumPages: 64})
		if err != nil {
			t.Fatal(err)
		}
		pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "rdma-e2e", Device: -1, Aux: workload.DefaultAux, AuxRows: 16})
		if err != nil {
			t.Fatal(err)
		}
		opts := transport.DefaultOptions()
		if role == engine.RoleDecode {
			opts.RDMA.MaxMRSize = 8192 // 32 KiB buffers: 4 MRs each
		}
		tr, err := transport.OpenTransport("rdma", opts)
		if err != nil {
			t.Fatal(err)
		}
		cfg := engine.ManagerConfig{Role: role, KV: pool.Args(), Transports: []transport.Transport{tr}, BootstrapAddr: addr,
			BootstrapTimeout: 30 * time.Second, WaitingTimeout: 60 * time.Second}
		if role == engine.RoleDecode {
			cfg.BootstrapAddr = ""
		}
		m, err := engine.NewManager(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close(); tr.Close(); pool.Close() })
		return &rank{m: m, pool: pool}
	}
	pre := []*rank{newRank(engine.RolePrefill, 2, 0), newRank(engine.RolePrefill, 2, 1)}
	dec := newRank(engine.RoleDecode, 1, 0)
	if got := pre[0].m.TransportNames(); len(got) != 1 || got[0] != "rdma" {
		t.Fatalf("prefill transports = %v", got)
	}

	const room, pages = 4242, 6
	all, err := dec.pool.Alloc(2 * pages)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(all)
	var dpages []int32
	for i := 0; i < len(all); i += 2 {
		dpages = append(dpages, all[i])
	}
	r, err := dec.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.SendMetadata(dpages, 2, nil, 0); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(pre))
	for _, p := range pre {
		s, err := p.m.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
				errs <- errors.Join(errors.New("sender not WaitingForInput: "+st.String()), s.Failure())
				return
			}
			src, err := p.pool.Alloc(s.DstPages())
			if err != nil {
				errs <- err
				return
			}
			defer p.pool.Free(src)
			_ = workload.FillPattern(p.pool, room, src, 0)
			_ = workload.FillAux(p.pool, room, 1)
			if err := s.Init(len(src), 1); err != nil {
				errs <- err
				return
			}
			if err := s.Send(src, true); err != nil {
				errs <- err
				return
			}
			if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
				errs <- errors.Join(errors.New("sender ended "+st.String()), s.Failure())
			}
		}()
	}
	r.Wait(ctx, engine.KVSuccess)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if st := r.Poll(); st != engine.KVSuccess {
		t.Fatalf("receiver state %s: %v", st, r.Failure())
	}
	if err := workload.VerifyPattern(dec.pool, room, dpages, 0); err != nil {
		t.Fatal(err)
	}
	if err := workload.VerifyAux(dec.pool, room, 2); err != nil {
		t.Fatal(err)
	}
}
