package agent_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/engine/agent"
	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// BenchmarkRead: one prepared READ of scattered blocks (every other block
// of every region, so nothing merges) posted and polled to DONE with a
// notification, against the segment engine's Read of the same blocks: the
// agent's own cost (control-channel notification, state, merging) beside
// the transfer.
func BenchmarkRead(b *testing.B) {
	for _, tn := range []string{"tcp", "shm"} {
		for _, notif := range []bool{false, true} {
			b.Run(fmt.Sprintf("transport=%s/notif=%v", tn, notif), func(b *testing.B) {
				ctx := context.Background()
				p := newAgent(b, "p", openTransport(b, tn))
				d := newAgent(b, "d", openTransport(b, tn))
				pkv, dkv := newKV(b, p, pattern), newKV(b, d, nil)
				if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
					b.Fatal(err)
				}
				l, _ := d.PrepDlist(ctx, "", transport.MemoryHost, dkv.descs())
				r, _ := d.PrepDlist(ctx, "p", transport.MemoryHost, pkv.descs())
				var blocks []int
				for i := 0; i < numBlocks; i += 2 {
					blocks = append(blocks, i)
				}
				var msg []byte
				if notif {
					msg = []byte("req:1")
				}
				x, err := d.MakeXfer(agent.OpRead, l, descIDs(blocks), r, descIDs(blocks), msg)
				if err != nil {
					b.Fatal(err)
				}
				b.SetBytes(int64(numRegions * len(blocks) * blockLen))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := d.Post(x, nil); err != nil {
						b.Fatal(err)
					}
					if st, err := d.Wait(ctx, x); st != agent.XferDone {
						b.Fatal(st, err)
					}
					if notif {
						p.GetNotifs()
					}
				}
			})
		}
		b.Run(fmt.Sprintf("transport=%s/segengine", tn), func(b *testing.B) {
			ctx := context.Background()
			mk := func(fill bool) (*segengine.TransferEngine, *kv) {
				te, err := segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{Transport: openTransport(b, tn)})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { te.Close() })
				k := &kv{}
				for reg := 0; reg < numRegions; reg++ {
					hb, err := transport.AllocHost("seg", numBlocks*blockLen)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { hb.Close() })
					if _, err := te.RegisterMemory(hb.Memory()); err != nil {
						b.Fatal(err)
					}
					k.bufs = append(k.bufs, hb)
				}
				return te, k
			}
			pte, pkv := mk(true)
			dte, dkv := mk(false)
			seg, err := dte.OpenSegment(ctx, pte.Name())
			if err != nil {
				b.Fatal(err)
			}
			var reads []segengine.PeerRead
			for reg := 0; reg < numRegions; reg++ {
				for i := 0; i < numBlocks; i += 2 {
					reads = append(reads, segengine.PeerRead{Local: dkv.bufs[reg].Addr() + uintptr(i*blockLen), PeerAddr: uint64(pkv.bufs[reg].Addr()) + uint64(i*blockLen), Length: blockLen})
				}
			}
			b.SetBytes(int64(len(reads) * blockLen))
			b.ReportAllocs()
			for b.Loop() {
				if err := seg.Read(ctx, reads); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
