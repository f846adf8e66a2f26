package rdma

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestNamedSegmentOverRDMA opens a TransferEngine's segment by name over
// rdma: the receiver prepares QPs for the sender in the segment RPC
// DESCRIBE, the sender's handshake reply goes back in ACCEPT, then writes
// land at the receiver's virtual addresses, including memory registered
// after the open (descriptor refresh + AddRegions with the new rkeys).
func TestNamedSegmentOverRDMA(t *testing.T) {
	requireRDMA(t)
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout())
	defer cancel()
	newTE := func() *segengine.TransferEngine {
		te, err := segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{Transport: newT(t, 0, transport.RDMAOptions{})})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { te.Close() })
		return te
	}
	recv, send := newTE(), newTE()
	dst, src := alloc(t, 1<<20), alloc(t, 1<<20)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i * 13)
	}
	if _, err := recv.RegisterMemory(dst.Memory()); err != nil {
		t.Fatal(err)
	}
	if _, err := send.RegisterMemory(src.Memory()); err != nil {
		t.Fatal(err)
	}
	seg, err := send.OpenSegment(ctx, recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	write := func(local uintptr, peer uint64, n uint64) error {
		id, err := seg.SubmitPeerWrites(ctx, []segengine.PeerWrite{{Local: local, PeerAddr: peer, Length: n}})
		if err != nil {
			return err
		}
		st, err := seg.Wait(ctx, id)
		if err != nil {
			return err
		}
		if st.State != transport.BatchCompleted {
			return st.Err
		}
		return nil
	}
	if err := write(src.Addr()+4096, uint64(dst.Addr())+8192, 256<<10); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.Bytes()[8192:8192+256<<10], src.Bytes()[4096:4096+256<<10]) {
		t.Fatal("bytes differ after the write by peer address")
	}
	late := alloc(t, 1<<16)
	if _, err := recv.RegisterMemory(late.Memory()); err != nil {
		t.Fatal(err)
	}
	if err := write(src.Addr(), uint64(late.Addr())+64, 4096); err != nil {
		t.Fatalf("write to memory registered after the open: %v", err)
	}
	if !bytes.Equal(late.Bytes()[64:64+4096], src.Bytes()[:4096]) {
		t.Fatal("late region: bytes differ")
	}
	if err := write(src.Addr(), uint64(dst.Addr())+1<<20-8, 16); !errors.Is(err, transport.ErrOutOfBounds) {
		t.Fatalf("write past the region: %v", err)
	}
}
