package transporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// READ cases (transport.OpRead). They mirror the WRITE cases: the "sender"
// is the node that submits the read batch and the bytes flow from the
// receiver's registered region (the remote side, e.dst) into the sender's
// registered memory (e.src). Each case checks the local image (what every
// completed read must have copied, and that nothing else of the local
// memory changed) and that the remote region is unchanged (a read writes
// nothing there). A transport without transport.CapRead must refuse a read
// batch with an error wrapping transport.ErrReadUnsupported; the other read
// cases are then skipped.

// readCases are the READ cases Run runs after the WRITE cases.
func (s *suite) readCases() []struct {
	name string
	fn   func(*testing.T)
} {
	return []struct {
		name string
		fn   func(*testing.T)
	}{
		{"ReadUnsupportedRefused", s.readUnsupported},
		{"ReadSizes", s.readSizes},
		{"ReadScattered", s.readScattered},
		{"ReadStrided", s.readStrided},
		{"ReadRefusedBySender", s.readRefusedSender},
		{"ReadRefusedByReceiver", s.readRefusedReceiver},
		{"ReadDeregisteredRegion", s.readDeregistered},
		{"ReadAndWriteConcurrent", s.readWriteConcurrent},
		{"ReadCancel", s.readCancel},
		{"ReadFencedEpoch", s.readFencedEpoch},
		{"ReadPeerClosesMidBatch", s.readPeerCloses},
		{"ReadPeerKilled", s.readPeerKilled},
		{"ReadLarge", s.readLarge},
	}
}

// readEnv is newEnv for a read case: it skips the case when the sender has
// no CapRead (ReadUnsupportedRefused checks the refusal) and snapshots the
// local memory as the expected local image.
func (s *suite) readEnv(t *testing.T, localBytes, remoteBytes int) *env {
	t.Helper()
	e := s.newEnv(t, localBytes, remoteBytes)
	if !e.s.Capabilities().Has(transport.CapRead) {
		t.Skipf("%s has no transport.CapRead (ReadUnsupportedRefused checks that it refuses reads)", e.s.Name())
	}
	e.local = bytes.Clone(e.src.Bytes())
	return e
}

// read builds a contiguous read of n bytes from remote offset ro into local
// offset lo.
func (e *env) read(lo, ro, n int) transport.WriteRequest {
	return transport.WriteRequest{Local: e.src.Addr() + uintptr(lo), Remote: e.dstDesc.ID, RemoteOffset: uint64(ro), Length: uint64(n)}
}

// readBatch wraps reqs in a read batch.
func readBatch(reqs ...transport.WriteRequest) *transport.TransferBatch {
	return &transport.TransferBatch{Op: transport.OpRead, Requests: reqs}
}

// expectRead records the effect of read req on the expected local image:
// the remote bytes as the expected remote image holds them.
func (e *env) expectRead(req transport.WriteRequest) {
	img := e.expected
	for _, x := range e.extra {
		if x.desc.ID == req.Remote {
			img = x.expected
		}
	}
	lo := int(req.Local - e.src.Addr())
	for i := 0; i < int(req.Blocks()); i++ {
		l := lo + i*int(req.LocalStride)
		r := guard + int(req.RemoteOffset) + i*int(req.RemoteStride)
		copy(e.local[l:l+int(req.Length)], img[r:r+int(req.Length)])
	}
}

// verifyRead checks the local memory against the expected local image and
// the remote regions against theirs (a read changes nothing there).
func (e *env) verifyRead() {
	e.t.Helper()
	got := e.src.Bytes()
	if !bytes.Equal(got, e.local) {
		for i := range got {
			if got[i] != e.local[i] {
				e.t.Fatalf("local byte %d (read destination memory) = %#02x, want %#02x", i, got[i], e.local[i])
			}
		}
	}
	e.verify()
}

func (s *suite) readUnsupported(t *testing.T) {
	snd, rcv := s.newPair(t)
	caps, name := snd.Capabilities(), snd.Name()
	snd.Close()
	rcv.Close()
	if caps.Has(transport.CapRead) {
		t.Skipf("%s has transport.CapRead: the read cases below apply", name)
	}
	e := s.newEnv(t, 1<<16, 1<<16)
	before := bytes.Clone(e.src.Bytes())
	_, err := e.seg.Submit(e.ctx, readBatch(transport.WriteRequest{Local: e.src.Addr(), Remote: e.dstDesc.ID, Length: 4096}))
	if !errors.Is(err, transport.ErrReadUnsupported) {
		t.Fatalf("read batch on a transport without CapRead: Submit = %v, want an error wrapping ErrReadUnsupported", err)
	}
	if !bytes.Equal(e.src.Bytes(), before) {
		t.Fatalf("a refused read changed local memory")
	}
	e.verify()
}

func (s *suite) readSizes(t *testing.T) {
	const mib = 1 << 20
	e := s.readEnv(t, 12*mib, 12*mib)
	rng := rand.New(rand.NewPCG(21, 22))
	for _, n := range []int{1, 2, 7, 63, 4096, 4097, 65536 + 3, mib, mib + 1, 4*mib + 1, 9*mib + 13, 12 * mib} {
		lo := rng.IntN(12*mib - n + 1)
		ro := rng.IntN(12*mib - n + 1)
		t.Run(fmt.Sprintf("bytes=%d", n), func(t *testing.T) {
			e.t = t
			e.run(e.seg, readBatch(e.read(lo, ro, n)))
			e.verifyRead()
		})
	}
	e.t = t
	// Edges of the region (first and last byte) and several requests.
	e.run(e.seg, readBatch(e.read(5, 0, 1), e.read(9, 12*mib-1, 1), e.read(4096, 8*mib, 64<<10), e.read(mib, 3, 3*mib)))
	e.verifyRead()
}

// readScattered reads the KV shape of a fragmented pool: many small reads
// (1 B .. 64 KiB, mostly 4 KiB pages) from random places of two remote
// regions into disjoint local slots in random order, plus a large and a
// strided read, then 2048 scattered 4 KiB pages.
func (s *suite) readScattered(t *testing.T) {
	const mib, slot = 1 << 20, 64 << 10
	e := s.readEnv(t, 16*mib, 8*mib)
	x := e.addRegion(12 * mib)
	rng := rand.New(rand.NewPCG(23, 24))
	sizes := []int{1, 7, 512, 4096, 4096, 4096, 4096, 4099, 16 << 10, 32 << 10, slot - 1, slot}
	var b transport.TransferBatch
	b.Op = transport.OpRead
	// Local slots [0, 12 MiB) for the small reads, disjoint; [12, 16) MiB
	// for the large and strided ones.
	for _, ls := range rng.Perm(12 * mib / slot) {
		n := sizes[rng.IntN(len(sizes))]
		id, limit := e.dstDesc.ID, 8*mib
		if rng.IntN(2) == 0 {
			id, limit = x.desc.ID, 12*mib
		}
		b.Requests = append(b.Requests, transport.WriteRequest{Local: e.src.Addr() + uintptr(ls*slot+rng.IntN(slot-n+1)),
			Remote: id, RemoteOffset: uint64(rng.IntN(limit - n + 1)), Length: uint64(n)})
	}
	for _, r := range []transport.WriteRequest{
		{Local: e.src.Addr() + 12*mib + 3, Remote: x.desc.ID, RemoteOffset: 8 * mib, Length: mib + 5},
		{Local: e.src.Addr() + 13*mib + 999, Remote: x.desc.ID, RemoteOffset: 10 * mib, Length: 256, Count: 64, LocalStride: 512, RemoteStride: 1024},
		{Local: e.src.Addr() + 14*mib + 77, Remote: e.dstDesc.ID, RemoteOffset: 11, Length: 256<<10 + 1},
	} {
		i := rng.IntN(len(b.Requests) + 1)
		b.Requests = append(b.Requests[:i], append([]transport.WriteRequest{r}, b.Requests[i:]...)...)
	}
	seg := e.open(e.dstDesc, x.desc)
	defer seg.Close()
	e.run(seg, &b)
	e.verifyRead()

	t.Run("2048-pages", func(t *testing.T) {
		e.t = t
		pages := readBatch()
		for _, p := range rng.Perm(8 * mib / 4096) {
			pages.Requests = append(pages.Requests, e.read(p*4096, rng.IntN(8*mib/4096)*4096, 4096))
		}
		pages.Requests = pages.Requests[:2048]
		e.run(e.seg, pages)
		e.verifyRead()
	})
}

func (s *suite) readStrided(t *testing.T) {
	e := s.readEnv(t, 1<<20, 1<<20)
	cases := []transport.WriteRequest{
		// TP-mismatch head slicing read back: blocks spread on the remote
		// side, packed locally.
		{Local: e.src.Addr() + 100, RemoteOffset: 0, Length: 256, Count: 16, LocalStride: 256, RemoteStride: 1024},
		// Spread on both sides, odd sizes.
		{Local: e.src.Addr() + 7, RemoteOffset: 65536 + 3, Length: 129, Count: 33, LocalStride: 300, RemoteStride: 129},
		// Many blocks (one descriptor).
		{Local: e.src.Addr() + 200000, RemoteOffset: 0, Length: 128, Count: 2048, LocalStride: 256, RemoteStride: 384},
		// Count 1 behaves as contiguous.
		{Local: e.src.Addr() + 11, RemoteOffset: 1<<20 - 4096, Length: 4096, Count: 1, LocalStride: 99999, RemoteStride: 99999},
	}
	for i, r := range cases {
		r.Remote = e.dstDesc.ID
		t.Run(fmt.Sprintf("case%d/count=%d/len=%d", i, r.Count, r.Length), func(t *testing.T) {
			e.t = t
			e.run(e.seg, readBatch(r))
			e.verifyRead()
		})
	}
}

func (s *suite) readRefusedSender(t *testing.T) {
	e := s.readEnv(t, 1<<20, 1<<20)
	n := int(e.dstDesc.Length)
	bad := []transport.WriteRequest{
		e.read(0, n-10, 11),      // one byte past the end
		e.read(0, n, 1),          // starts at the end
		e.read(0, 1<<62, 4096),   // far away
		e.read(0, n-4096, 1<<20), // long
		{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: uint64(n) - 2048, Length: 512, Count: 8, LocalStride: 512, RemoteStride: 1024},
	}
	for i, r := range bad {
		t.Run(fmt.Sprintf("remote-case%d", i), func(t *testing.T) {
			e.t = t
			e.refused(e.seg, readBatch(e.read(4096, 0, 4096), r), transport.ErrOutOfBounds)
		})
	}
	t.Run("local-outside-registered", func(t *testing.T) {
		e.t = t
		e.refused(e.seg, readBatch(e.read(1<<20-100, 0, 200)), transport.ErrOutOfBounds)
	})
	t.Run("unknown-region", func(t *testing.T) {
		e.t = t
		r := e.read(0, 0, 16)
		r.Remote = e.dstDesc.ID + 1000
		e.refused(e.seg, readBatch(r), transport.ErrUnknownRegion)
	})
	t.Run("still-usable", func(t *testing.T) {
		e.t = t
		e.run(e.seg, readBatch(e.read(0, 0, 4096)))
		e.verifyRead()
	})
}

// readRefusedReceiver forges a SegmentInfo (a longer region, a region the
// receiver does not have): only the receiving side can refuse those reads.
// Nothing may be returned, and the segment keeps working.
func (s *suite) readRefusedReceiver(t *testing.T) {
	e := s.readEnv(t, 1<<20, 1<<20)
	n := int(e.dstDesc.Length)
	forged := e.dstDesc
	forged.Length += 1 << 20
	fake := e.dstDesc
	fake.ID = e.dstDesc.ID + 1000
	seg := e.open(forged, fake)
	defer seg.Close()
	unknown := e.read(0, 0, 4096)
	unknown.Remote = fake.ID
	bad := []transport.WriteRequest{
		e.read(0, n-10, 11),
		e.read(0, n, guard),
		e.read(0, n-(1<<19), 1<<20), // half in, half out: nothing may be returned
		{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: uint64(n) - 2048, Length: 512, Count: 8, LocalStride: 512, RemoteStride: 1024},
		unknown,
	}
	for i, r := range bad {
		t.Run(fmt.Sprintf("case%d", i), func(t *testing.T) {
			e.t = t
			e.refused(seg, readBatch(r), transport.ErrOutOfBounds, transport.ErrUnknownRegion)
			e.run(seg, readBatch(e.read(i*4096, i*4096, 4096)))
			e.verifyRead()
		})
	}
}

// readDeregistered reads a region, then the receiver deregisters it: the
// next read is refused with a clear error and returns nothing.
func (s *suite) readDeregistered(t *testing.T) {
	e := s.readEnv(t, 1<<16, 1<<16)
	e.run(e.seg, readBatch(e.read(0, 0, 4096)))
	e.verifyRead()
	if err := e.r.DeregisterMemory(e.dstDesc.ID); err != nil {
		t.Fatalf("DeregisterMemory: %v", err)
	}
	e.refused(e.seg, readBatch(e.read(4096, 4096, 4096)), transport.ErrUnknownRegion, transport.ErrOutOfBounds)
}

// readWriteConcurrent runs read and write batches at once on one segment:
// writes from the first local half into the first remote half, reads from
// the second remote half into the second local half.
func (s *suite) readWriteConcurrent(t *testing.T) {
	const workers, batches, cell = 4, 12, 64 << 10
	const half = 4 << 20
	e := s.readEnv(t, 2*half, 2*half)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var writes, reads []transport.WriteRequest
	errs := make(chan error, 2*workers)
	for w := 0; w < 2*workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			reader := w%2 == 1
			for i := 0; i < batches; i++ {
				var b transport.TransferBatch
				// Each worker owns its cells of the half it fills.
				slot := (w / 2) * (half / workers)
				cells := rng.Perm(half / workers / cell)[:1+rng.IntN(6)]
				for _, c := range cells {
					n := 1 + rng.IntN(cell)
					off := slot + c*cell
					if reader {
						b.Op = transport.OpRead
						b.Requests = append(b.Requests, e.read(half+off, half+rng.IntN(half-n), n))
					} else {
						b.Requests = append(b.Requests, e.write(rng.IntN(half-n), off, n))
					}
				}
				id, err := e.seg.Submit(e.ctx, &b)
				if err != nil {
					errs <- fmt.Errorf("worker %d batch %d (%v): Submit: %w", w, i, b.Op, err)
					return
				}
				st, err := e.seg.Wait(e.ctx, id)
				if err != nil || st.State != transport.BatchCompleted {
					errs <- fmt.Errorf("worker %d batch %d (%v): state %v err %v wait %v", w, i, b.Op, st.State, st.Err, err)
					return
				}
				e.seg.Release(id)
				mu.Lock()
				if reader {
					reads = append(reads, b.Requests...)
				} else {
					writes = append(writes, b.Requests...)
				}
				mu.Unlock()
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, r := range writes {
		e.expect(r)
	}
	for _, r := range reads { // their remote half was never written
		e.expectRead(r)
	}
	e.verifyRead()
}

func (s *suite) readCancel(t *testing.T) {
	const mib = 1 << 20
	e := s.readEnv(t, 32*mib, 32*mib)
	b := readBatch()
	for i := 0; i < 32; i++ {
		b.Requests = append(b.Requests, e.read(i*mib, i*mib, mib))
	}
	e.submitCancel(b)
	// A canceled read leaves its local ranges unspecified; read everything
	// again on the same segment and verify.
	again := readBatch()
	for i := 0; i < 32; i++ {
		again.Requests = append(again.Requests, e.read(i*mib, i*mib, mib))
	}
	e.run(e.seg, again)
	e.verifyRead()
}

// readFencedEpoch: a segment of an admitted epoch reads; once the receiver
// fenced the epoch, reads through it (and through a late segment of that
// epoch, or of one never admitted) return nothing; a new epoch reads again.
func (s *suite) readFencedEpoch(t *testing.T) {
	e := s.readEnv(t, 1<<20, 1<<20)
	f, ok := e.r.(transport.Fencer)
	if !ok {
		t.Skipf("%s does not implement transport.Fencer (FencedEpoch reports it)", e.r.Name())
	}
	const n = 64 << 10
	epoch := transport.NewEpoch()
	seg, err := e.openEpoch(epoch, true, e.dstDesc)
	if err != nil {
		t.Fatalf("open a segment with admitted epoch %d: %v", epoch, err)
	}
	defer seg.Close()
	peer := e.fencePeer
	e.run(seg, readBatch(e.read(0, 0, n)))
	e.verifyRead()
	if err := f.FenceEpoch(e.ctx, peer, epoch); err != nil {
		t.Fatalf("FenceEpoch(%d): %v", epoch, err)
	}
	e.cannotMove(seg, readBatch(e.read(n, n, n)), "read through the fenced segment")
	if !e.r.Capabilities().Has(transport.CapHandshake) {
		for _, c := range []struct {
			epoch uint64
			what  string
		}{{epoch, "read through a segment opened with the fenced epoch"}, {transport.NewEpoch(), "read through a segment opened with an epoch never admitted"}} {
			late, err := e.openEpoch(c.epoch, false, e.dstDesc)
			if err != nil {
				if !errors.Is(err, transport.ErrFenced) && !errors.Is(err, transport.ErrPeerLost) {
					t.Fatalf("%s: OpenSegment %v, want it refused with ErrFenced", c.what, err)
				}
				continue
			}
			e.cannotMove(late, readBatch(e.read(2*n, 2*n, n)), c.what)
			late.Close()
		}
	}
	next := transport.NewEpoch()
	seg2, err := e.openEpoch(next, true, e.dstDesc)
	if err != nil {
		t.Fatalf("open a segment with a new admitted epoch %d: %v", next, err)
	}
	defer seg2.Close()
	e.run(seg2, readBatch(e.read(3*n, 3*n, n)))
	e.verifyRead()
}

func (s *suite) readPeerCloses(t *testing.T) {
	const mib = 1 << 20
	e := s.readEnv(t, 8*mib, 8*mib)
	mk := func(int) *transport.TransferBatch {
		b := readBatch()
		for j := 0; j < 8; j++ {
			b.Requests = append(b.Requests, e.read(j*mib, j*mib, mib))
		}
		return b
	}
	stop := func() {
		if s.cfg.Kill != nil {
			s.cfg.Kill(t, e.r)
		} else if err := e.r.Close(); err != nil {
			t.Errorf("receiver Close: %v", err)
		}
	}
	s.streamUntilLost(t, e.ctx, e.seg, mk, stop)
}

func (s *suite) readPeerKilled(t *testing.T) {
	const mib = 1 << 20
	skipWithoutRemotePeer(t, s.cfg)
	snd, rcv := s.newPair(t)
	caps, name := snd.Capabilities(), snd.Name()
	snd.Close()
	rcv.Close()
	if !caps.Has(transport.CapRead) {
		t.Skipf("%s has no transport.CapRead", name)
	}
	ctx, dst, seg, region, kill := s.remoteSegment(t, 19)
	mk := func(int) *transport.TransferBatch {
		b := readBatch()
		for j := 0; j < 8; j++ {
			b.Requests = append(b.Requests, transport.WriteRequest{Local: dst.Addr() + uintptr(j*mib), Remote: region, RemoteOffset: uint64(j * mib), Length: mib})
		}
		return b
	}
	s.streamUntilLost(t, ctx, seg, mk, kill)
}

func (s *suite) readLarge(t *testing.T) {
	if testing.Short() {
		t.Skip("large read skipped under -short")
	}
	n := int(s.cfg.LargeBytes/4) &^ (1<<20 - 1)
	if n <= 0 {
		t.Skip("large read disabled (LargeBytes/4 < 1 MiB)")
	}
	e := s.readEnv(t, n, n)
	half := n / 2 &^ (1<<20 - 1)
	b := readBatch(e.read(0, 0, half))
	for off := half; off < n; off += 1 << 20 {
		b.Requests = append(b.Requests, e.read(off, off, 1<<20))
	}
	id, err := e.seg.Submit(context.Background(), b)
	if err != nil {
		t.Fatal(err)
	}
	st := e.waitProgress(e.seg, id, s.cfg.CaseTimeout)
	if st.State != transport.BatchCompleted || st.BytesDone != uint64(n) {
		t.Fatalf("large read: %v, %d of %d bytes, err %v", st.State, st.BytesDone, n, st.Err)
	}
	e.seg.Release(id)
	if !bytes.Equal(e.src.Bytes()[:n], e.dst) {
		t.Fatalf("large read: local bytes differ from the remote region")
	}
	e.verify()
}
