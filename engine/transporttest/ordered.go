package transporttest

import (
	"bytes"
	"encoding/binary"
	"runtime"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// orderedLast checks TransferBatch.LastAfterAll (transport.CapOrderedLast):
// a transport without the capability refuses such a batch before moving
// anything; one with it refuses a last request that is not one aligned
// 8-byte block, and otherwise writes the last request only after every
// other byte of the batch landed: a goroutine watching the 8-byte word in
// the receiver's memory checks, the moment it sees the new value, that
// every page of the batch already holds its new bytes (rounds of 48 MiB
// in 1 MiB requests over fresh patterns, so a word written early is seen
// before the pages behind it). A canceled batch that ends Canceled never
// writes its last request.
func (s *suite) orderedLast(t *testing.T) {
	const mib = 1 << 20
	const pages = 48
	e := s.newEnv(t, (pages+1)*mib, (pages+1)*mib)
	word := (pages+1)*mib - 8 // remote offset of the word: after the pages
	batch := func() *transport.TransferBatch {
		b := &transport.TransferBatch{LastAfterAll: true}
		for i := 0; i < pages; i++ {
			b.Requests = append(b.Requests, e.write(i*mib, i*mib, mib))
		}
		b.Requests = append(b.Requests, e.write(pages*mib, word, 8))
		return b
	}
	if !e.s.Capabilities().Has(transport.CapOrderedLast) {
		id, err := e.seg.Submit(e.ctx, batch())
		if err == nil {
			e.wait(e.seg, id)
			t.Fatalf("%s has no CapOrderedLast but accepted a LastAfterAll batch (its last write would not be ordered)", e.s.Name())
		}
		t.Logf("refused as expected: %v", err)
		e.verify()
		return
	}
	for _, bad := range []transport.WriteRequest{e.write(pages*mib, word, 16), e.write(pages*mib, word-4, 8),
		{Local: e.src.Addr() + uintptr(pages*mib), Remote: e.dstDesc.ID, RemoteOffset: uint64(word - 8), Length: 8, Count: 2, LocalStride: 8, RemoteStride: 8}} {
		b := batch()
		b.Requests[len(b.Requests)-1] = bad
		if id, err := e.seg.Submit(e.ctx, b); err == nil {
			e.wait(e.seg, id)
			t.Fatalf("LastAfterAll batch whose last request is %d×%d bytes at offset %d accepted; want it refused (one aligned 8-byte block)", bad.Blocks(), bad.Length, bad.RemoteOffset)
		}
	}
	e.verify() // nothing moved
	dst := e.dst
	wordPtr := (*uint64)(unsafe.Pointer(&dst[word]))
	for round := uint64(0); round < 6; round++ {
		fillRandom(e.src.Bytes(), 100+round)
		want := binary.NativeEndian.Uint64(e.src.Bytes()[pages*mib:])
		if atomic.LoadUint64(wordPtr) == want {
			t.Fatalf("round %d: the word already holds the new value", round)
		}
		src := e.src.Bytes()[:pages*mib]
		seen := make(chan bool, 1)
		stop, exited := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(exited)
			for {
				select {
				case <-stop:
					seen <- true // never saw it early: fine
					return
				default:
				}
				if atomic.LoadUint64(wordPtr) == want {
					seen <- bytes.Equal(dst[:pages*mib], src)
					return
				}
				runtime.Gosched()
			}
		}()
		func() {
			// Stopped on every way out (a failed run too): the memory it
			// reads is unmapped by the cleanups.
			defer func() { close(stop); <-exited }()
			e.run(e.seg, batch())
		}()
		if !<-seen {
			t.Fatalf("round %d: the last write landed before every page of its batch had (a reader of the commit word would see a partial batch)", round)
		}
		e.verify()
	}
	// Canceled at once: if it ends Canceled, the word was not written.
	fillRandom(e.src.Bytes(), 200)
	before := atomic.LoadUint64(wordPtr)
	id, err := e.seg.Submit(e.ctx, batch())
	if err != nil {
		t.Fatal(err)
	}
	if err := e.seg.Cancel(id); err != nil {
		t.Fatal(err)
	}
	st := e.wait(e.seg, id)
	e.seg.Release(id)
	switch got := atomic.LoadUint64(wordPtr); st.State {
	case transport.BatchCanceled:
		if got != before {
			t.Fatalf("batch canceled after %d bytes, but its last write landed", st.BytesDone)
		}
	case transport.BatchCompleted:
		if got == before {
			t.Fatal("batch completed, but its last write did not land")
		}
	default:
		t.Fatalf("canceled batch ended %v (%v), want canceled or completed", st.State, st.Err)
	}
}
