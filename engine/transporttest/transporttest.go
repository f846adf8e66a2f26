// Package transporttest is the conformance suite every kvxfer transport runs
// (tcp, shm, rdma): call Run from a test in the transport's package with a
// function that creates a fresh sender/receiver pair.
//
//	func TestConformance(t *testing.T) {
//		transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
//			return newTransport(t), newTransport(t)
//		}, transporttest.WithLargeBytes(256<<20))
//	}
//
// Each case gets its own pair and closes it (Close must be idempotent). The
// suite allocates all memory with transport.AllocHost and registers sub-ranges
// of it, so it can check that the bytes just before and after a region stay
// untouched when a write is refused.
//
// What the suite requires of a transport, beyond the transport.Transport docs:
//   - a write the sender can see is invalid (unknown region in its
//     SegmentInfo, offset past the RegionDesc, local address outside a
//     registered region) is refused by Submit with an error wrapping
//     transport.ErrUnknownRegion or transport.ErrOutOfBounds;
//   - a write the sender cannot see is invalid (SegmentInfo forged to claim a
//     longer or unknown region, region deregistered on the receiver) is
//     refused by the receiving side: Submit fails or the batch ends
//     BatchFailed, with an error wrapping ErrOutOfBounds or ErrUnknownRegion
//     (either is accepted: RDMA NICs report both as a remote access error);
//     no byte of the receiver's memory changes and the segment stays usable;
//   - its Segments implement transport.RegionAdder: a region the receiver
//     registers after the open is refused (ErrUnknownRegion) until
//     AddRegions names it, then written like any other;
//   - reads (transport.OpRead, read.go): a transport with transport.CapRead
//     passes the same cases for read batches, from the receiver's regions
//     into the sender's registered memory (sizes, scattered pages, strided,
//     refusals by the sender and by the receiving side with nothing
//     returned, a deregistered region, reads and writes at once, cancel, a
//     fenced epoch, the peer closing or killed mid-read, a large read); one
//     without CapRead refuses a read batch with an error wrapping
//     transport.ErrReadUnsupported;
//   - ordered last write (ordered.go): a transport with
//     transport.CapOrderedLast writes a LastAfterAll batch's last request
//     (an 8-byte commit word) only after every other byte of the batch
//     landed, never for a batch that ended canceled, and refuses a last
//     request of another shape; one without it refuses LastAfterAll;
//   - when the receiver closes (or is killed), pending and later batches fail
//     with an error wrapping transport.ErrPeerLost (Submit may return it
//     instead) within PeerLostWithin, never hang;
//   - the receiver implements transport.Fencer (the KV manager fences a
//     producer of a failed room before it reuses the room's pages, and a
//     transport without it would lose that protection silently): a segment
//     opened with an admitted epoch writes; once FenceEpoch returns, nothing more written
//     through it lands (Submit or the batch fails with an error wrapping
//     transport.ErrPeerLost, transport.ErrFenced or transport.ErrUnknownRegion), a
//     new segment with the fenced epoch cannot write either, and a newly
//     admitted epoch writes again. Transports without a handshake also
//     refuse an epoch that was never admitted (with one, the receiver's QPs
//     prepared by Endpoint are the admission). A transport that does not
//     fence fails the suite unless it opts out with WithoutFencing and a
//     reason; the FencedEpoch case is then skipped with that reason.
package transporttest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Config holds the suite's knobs; set them with Options.
type Config struct {
	// LargeBytes is the size of the large-transfer case in bytes (default
	// 1 GiB, rounded down to MiB); <= 0 skips the case. The case is skipped
	// under -short. The suite reads no environment variable: a test that
	// wants one to size the case passes it here.
	LargeBytes int64
	// CaseTimeout bounds each case (default 2 minutes); a Wait still blocked
	// then fails the test instead of hanging.
	CaseTimeout time.Duration
	// PeerLostWithin is how soon after the receiver closes a batch must fail
	// with ErrPeerLost (default 5 s).
	PeerLostWithin time.Duration
	// Kill, when set, stops the receiver abruptly (for example by closing its
	// sockets with RST); the peer-lost case uses it instead of
	// receiver.Close.
	Kill func(t *testing.T, receiver transport.Transport)
	// RemotePeer, when set, starts a receiver in ANOTHER process with one
	// registered region of at least regionBytes bytes and returns what a
	// sender needs to reach it and a function that kills that process
	// (SIGKILL). It enables the "peer killed" case.
	RemotePeer func(t *testing.T, regionBytes int) (info transport.SegmentInfo, kill func())
	// NoFencing, when not empty, says why the transport under test does not
	// implement transport.Fencer; the FencedEpoch case is skipped with it.
	// Empty (the default): a receiver without Fencer fails the suite.
	NoFencing string
}

// Option sets a Config field.
type Option func(*Config)

// WithLargeBytes sets Config.LargeBytes (bytes; <= 0 skips the large case).
func WithLargeBytes(n int64) Option { return func(c *Config) { c.LargeBytes = n } }

// WithCaseTimeout sets Config.CaseTimeout.
func WithCaseTimeout(d time.Duration) Option { return func(c *Config) { c.CaseTimeout = d } }

// WithPeerLostWithin sets Config.PeerLostWithin.
func WithPeerLostWithin(d time.Duration) Option { return func(c *Config) { c.PeerLostWithin = d } }

// WithKill sets Config.Kill.
func WithKill(f func(t *testing.T, receiver transport.Transport)) Option {
	return func(c *Config) { c.Kill = f }
}

// WithRemotePeer sets Config.RemotePeer.
func WithRemotePeer(f func(t *testing.T, regionBytes int) (transport.SegmentInfo, func())) Option {
	return func(c *Config) { c.RemotePeer = f }
}

// WithoutFencing sets Config.NoFencing: the transport does not fence, for
// the reason given (which must not be empty). Only a transport that no KV
// manager uses may pass it: the manager's stale-writer protection needs
// Fencer.
func WithoutFencing(reason string) Option { return func(c *Config) { c.NoFencing = reason } }

// Run runs every conformance case as a subtest of t. newPair must return a
// fresh, unconnected sender and receiver transport each time (the suite
// closes both; Close must be idempotent).
func Run(t *testing.T, newPair func(t *testing.T) (sender, receiver transport.Transport), opts ...Option) {
	cfg := Config{LargeBytes: 1 << 30, CaseTimeout: 2 * time.Minute, PeerLostWithin: 5 * time.Second}
	for _, o := range opts {
		o(&cfg)
	}
	s := &suite{cfg: cfg, newPair: newPair}
	cases := []struct {
		name string
		fn   func(*testing.T)
	}{
		{"RegisterDeregister", s.registerDeregister},
		{"WriteSizes", s.writeSizes},
		{"MultiRequestBatch", s.multiRequestBatch},
		{"ScatteredSmallWrites", s.scattered},
		{"ScatteredRefusedByReceiver", s.scatteredRefused},
		{"Strided", s.strided},
		{"OutOfBoundsRefusedBySender", s.outOfBoundsSender},
		{"OutOfBoundsRefusedByReceiver", s.outOfBoundsReceiver},
		{"UnknownRegion", s.unknownRegion},
		{"DeregisteredRegion", s.deregistered},
		{"RegionsAddedAfterOpen", s.regionsAdded},
		{"ConcurrentBatches", s.concurrent},
		{"PollWaitRelease", s.pollWaitRelease},
		{"Cancel", s.cancel},
		{"CloseIdempotent", s.closeIdempotent},
		{"PeerClosesMidBatch", s.peerCloses},
		{"PeerKilled", s.peerKilled},
		{"FencedEpoch", s.fencedEpoch},
		{"LargeTransfer", s.large},
		{"OrderedLast", s.orderedLast},
	}
	cases = append(cases, s.readCases()...)
	for _, c := range cases {
		t.Run(c.name, c.fn)
	}
}

type suite struct {
	cfg     Config
	newPair func(t *testing.T) (transport.Transport, transport.Transport)
}

// guard is the number of bytes kept unregistered before and after every
// receiver region to detect stray writes.
const guard = 4096

// env is one case's pair, memory and segment.
type env struct {
	t         *testing.T
	ctx       context.Context
	s, r      transport.Transport
	src       *transport.HostBuffer
	dstBuf    *transport.HostBuffer
	dst       []byte // the registered receiver region (inside dstBuf, between guards)
	srcDesc   transport.RegionDesc
	dstDesc   transport.RegionDesc
	seg       transport.Segment
	peerSeq   int
	expected  []byte // what dstBuf must hold (guards included)
	extra     []*extraRegion
	fencePeer string // the peer name of the last segment opened
	local     []byte // read cases: what the sender's memory (src) must hold
}

// newEnv allocates a srcBytes source and a dstBytes receiver region (with
// guards), registers both, fills the source with a random pattern and the
// receiver with another, and opens a segment.
func (s *suite) newEnv(t *testing.T, srcBytes, dstBytes int) *env {
	t.Helper()
	e := &env{t: t}
	var err error
	if e.src, err = transport.AllocHost("transporttest-src", int64(srcBytes)); err != nil {
		t.Fatal(err)
	}
	if e.dstBuf, err = transport.AllocHost("transporttest-dst", int64(dstBytes+2*guard)); err != nil {
		e.src.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { e.src.Close(); e.dstBuf.Close() })
	e.s, e.r = s.newPair(t)
	// Registered after the buffers: runs before they are unmapped.
	t.Cleanup(func() {
		if e.seg != nil {
			if err := e.seg.Close(); err != nil {
				t.Errorf("segment Close: %v", err)
			}
		}
		if err := e.s.Close(); err != nil {
			t.Errorf("sender Close: %v", err)
		}
		if err := e.r.Close(); err != nil {
			t.Errorf("receiver Close: %v", err)
		}
	})
	fillRandom(e.src.Bytes(), 1)
	fillRandom(e.dstBuf.Bytes(), 2)
	e.dst = e.dstBuf.Bytes()[guard : guard+dstBytes]
	e.expected = bytes.Clone(e.dstBuf.Bytes())
	// The case deadline starts after the buffers are filled: faulting in
	// 2 GiB for the large case can take a minute on a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.CaseTimeout)
	t.Cleanup(cancel)
	e.ctx = ctx

	if e.srcDesc, err = e.s.RegisterMemory(e.src.Memory()); err != nil {
		t.Fatalf("sender RegisterMemory(%d bytes): %v", srcBytes, err)
	}
	m := e.dstBuf.Memory()
	m.Addr += guard
	m.FDOffset += guard
	m.Length = uint64(dstBytes)
	if e.dstDesc, err = e.r.RegisterMemory(m); err != nil {
		t.Fatalf("receiver RegisterMemory(%d bytes): %v", dstBytes, err)
	}
	e.seg = e.open(e.dstDesc)
	return e
}

// open opens a segment from sender to receiver advertising regions (which a
// test may forge).
func (e *env) open(regions ...transport.RegionDesc) transport.Segment {
	e.t.Helper()
	seg, err := e.openEpoch(0, false, regions...)
	if err != nil {
		e.t.Fatalf("sender OpenSegment: %v", err)
	}
	return seg
}

// openEpoch opens a segment with SegmentInfo.Epoch = epoch, admitting the
// epoch on the receiver first when admit is set.
func (e *env) openEpoch(epoch uint64, admit bool, regions ...transport.RegionDesc) (transport.Segment, error) {
	e.t.Helper()
	e.peerSeq++
	peer := fmt.Sprintf("transporttest-sender-%d", e.peerSeq)
	ep, err := e.r.Endpoint(e.ctx, peer)
	if err != nil {
		e.t.Fatalf("receiver Endpoint: %v", err)
	}
	if admit {
		if err := e.r.(transport.Fencer).AdmitEpoch(peer, epoch); err != nil {
			e.t.Fatalf("receiver AdmitEpoch(%d): %v", epoch, err)
		}
	}
	seg, err := e.s.OpenSegment(e.ctx, transport.SegmentInfo{Endpoint: ep, Regions: regions, Epoch: epoch})
	if err != nil {
		return nil, err
	}
	if e.s.Capabilities().Has(transport.CapHandshake) {
		acc, ok := e.r.(transport.Acceptor)
		if !ok {
			e.t.Fatalf("%s has CapHandshake but does not implement transport.Acceptor", e.r.Name())
		}
		if err := acc.Accept(e.ctx, peer, seg.HandshakeReply()); err != nil {
			seg.Close()
			return nil, fmt.Errorf("receiver Accept: %w", err)
		}
	}
	e.fencePeer = peer
	return seg, nil
}

// write builds a contiguous request from source offset so to receiver offset do.
func (e *env) write(so, do, n int) transport.WriteRequest {
	return transport.WriteRequest{Local: e.src.Addr() + uintptr(so), Remote: e.dstDesc.ID, RemoteOffset: uint64(do), Length: uint64(n)}
}

// expect records the effect of req on the expected receiver image (of the
// env's region, or of an extra region when req names one).
func (e *env) expect(req transport.WriteRequest) {
	img := e.expected
	for _, x := range e.extra {
		if x.desc.ID == req.Remote {
			img = x.expected
		}
	}
	src := e.src.Bytes()
	so := int(req.Local - e.src.Addr())
	for i := 0; i < int(req.Blocks()); i++ {
		s := so + i*int(req.LocalStride)
		d := guard + int(req.RemoteOffset) + i*int(req.RemoteStride)
		copy(img[d:d+int(req.Length)], src[s:s+int(req.Length)])
	}
}

// extraRegion is a second receiver region (with its own guards).
type extraRegion struct {
	buf      *transport.HostBuffer
	desc     transport.RegionDesc
	expected []byte
}

// addRegion allocates and registers another receiver region of n bytes
// between guards, filled with a random pattern; verify checks it too.
func (e *env) addRegion(n int) *extraRegion {
	e.t.Helper()
	buf, err := transport.AllocHost("transporttest-dst2", int64(n+2*guard))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { buf.Close() })
	fillRandom(buf.Bytes(), uint64(10+len(e.extra)))
	x := &extraRegion{buf: buf, expected: bytes.Clone(buf.Bytes())}
	m := buf.Memory()
	m.Addr += guard
	m.FDOffset += guard
	m.Length = uint64(n)
	if x.desc, err = e.r.RegisterMemory(m); err != nil {
		e.t.Fatalf("receiver RegisterMemory(second region, %d bytes): %v", n, err)
	}
	// Deregistered before the buffer is unmapped (cleanups run last first).
	e.t.Cleanup(func() { e.r.DeregisterMemory(x.desc.ID) })
	e.extra = append(e.extra, x)
	return x
}

// run submits b on seg, waits, requires BatchCompleted with every byte, and
// records its effect: on the expected receiver image for a write, on the
// expected local image for a read (read.go).
func (e *env) run(seg transport.Segment, b *transport.TransferBatch) {
	e.t.Helper()
	id, err := seg.Submit(e.ctx, b)
	if err != nil {
		e.t.Fatalf("Submit %s batch: %v", b.Op, err)
	}
	st := e.wait(seg, id)
	if st.State != transport.BatchCompleted {
		e.t.Fatalf("%s batch %d: state %v, err %v; want completed", b.Op, id, st.State, st.Err)
	}
	if st.BytesDone != b.Bytes() {
		e.t.Errorf("%s batch %d: BytesDone %d, want %d", b.Op, id, st.BytesDone, b.Bytes())
	}
	seg.Release(id)
	for _, r := range b.Requests {
		if b.Op == transport.OpRead {
			e.expectRead(r)
		} else {
			e.expect(r)
		}
	}
}

// wait waits for a terminal state within the case deadline.
func (e *env) wait(seg transport.Segment, id transport.BatchID) transport.BatchStatus {
	e.t.Helper()
	st, err := seg.Wait(e.ctx, id)
	if err != nil {
		e.t.Fatalf("Wait(batch %d): %v (state %v) — the transport hung", id, err, st.State)
	}
	if !st.State.Terminal() {
		e.t.Fatalf("Wait(batch %d) returned non-terminal state %v", id, st.State)
	}
	return st
}

// waitProgress waits for a batch like wait, but bounds the time without
// progress instead of the whole transfer: it fails when BytesDone has not
// grown for stall (the CaseTimeout). A 1 GiB batch on a loaded machine (race detector,
// other test binaries on the cores) is slow, not hung; a transport that
// reports BytesDone only at the end gets CaseTimeout in all, as with wait.
func (e *env) waitProgress(seg transport.Segment, id transport.BatchID, stall time.Duration) transport.BatchStatus {
	e.t.Helper()
	var last uint64
	since := time.Now()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := seg.Wait(ctx, id)
		cancel()
		if err == nil {
			if !st.State.Terminal() {
				e.t.Fatalf("Wait(batch %d) returned non-terminal state %v", id, st.State)
			}
			return st
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			e.t.Fatalf("Wait(batch %d): %v (state %v)", id, err, st.State)
		}
		if cur, _ := seg.Poll(id); cur.BytesDone > last {
			last, since = cur.BytesDone, time.Now()
		} else if time.Since(since) > stall {
			e.t.Fatalf("batch %d: no progress for %v at %d bytes done (state %v) — the transport hung", id, stall, cur.BytesDone, cur.State)
		}
	}
}

// verify compares the receiver buffers (guards included) with the expected
// images.
func (e *env) verify() {
	e.t.Helper()
	verifyImage(e.t, "receiver", e.dstBuf.Bytes(), e.expected)
	for i, x := range e.extra {
		verifyImage(e.t, fmt.Sprintf("receiver extra region %d", i+1), x.buf.Bytes(), x.expected)
	}
}

// verifyImage compares got (a region between guards) with want.
func verifyImage(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	for i := range got {
		if got[i] != want[i] {
			where := "inside the region"
			if i < guard || i >= len(got)-guard {
				where = "OUTSIDE the registered region"
			}
			t.Fatalf("%s byte %d (region offset %d, %s) = %#02x, want %#02x", what, i, i-guard, where, got[i], want[i])
		}
	}
}

// refused submits b and requires it to be refused with an error wrapping one
// of want, either by Submit or as a failed batch; a refused read must also
// have returned nothing (the local image is checked).
func (e *env) refused(seg transport.Segment, b *transport.TransferBatch, want ...error) {
	e.t.Helper()
	err := e.fails(seg, b, "invalid "+b.Op.String())
	for _, w := range want {
		if errors.Is(err, w) {
			e.t.Logf("%s refused as expected: %v", b.Op, err)
			if b.Op == transport.OpRead {
				e.verifyRead()
			}
			return
		}
	}
	e.t.Fatalf("invalid %s refused with %v; want an error wrapping one of %v", b.Op, err, want)
}

// fails submits b and returns its error: Submit's, or the batch's, which
// must end BatchFailed (what names the batch in the failure).
func (e *env) fails(seg transport.Segment, b *transport.TransferBatch, what string) error {
	e.t.Helper()
	id, err := seg.Submit(e.ctx, b)
	if err == nil {
		st := e.wait(seg, id)
		seg.Release(id)
		if st.State != transport.BatchFailed {
			e.t.Fatalf("%s: batch ended %v, want failed (refused)", what, st.State)
		}
		err = st.Err
	}
	return err
}

// cannotWrite requires that a write through seg never lands: Submit or the
// batch fails with an error wrapping ErrPeerLost, ErrFenced or
// ErrUnknownRegion, within the case deadline.
func (e *env) cannotWrite(seg transport.Segment, req transport.WriteRequest, what string) {
	e.t.Helper()
	e.cannotMove(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{req}}, what)
}

// cannotMove is cannotWrite for a batch of either op; a read must also have
// returned nothing.
func (e *env) cannotMove(seg transport.Segment, b *transport.TransferBatch, what string) {
	e.t.Helper()
	err := e.fails(seg, b, what)
	if !errors.Is(err, transport.ErrPeerLost) && !errors.Is(err, transport.ErrFenced) && !errors.Is(err, transport.ErrUnknownRegion) {
		e.t.Fatalf("%s: %v, want an error wrapping ErrPeerLost, ErrFenced or ErrUnknownRegion", what, err)
	}
	e.t.Logf("%s: refused: %v", what, err)
	if b.Op == transport.OpRead {
		e.verifyRead()
	}
}

func (s *suite) fencedEpoch(t *testing.T) {
	e := s.newEnv(t, 1<<20, 1<<20)
	f, ok := e.r.(transport.Fencer)
	switch {
	case !ok && s.cfg.NoFencing != "":
		t.Skipf("%s does not implement transport.Fencer: %s", e.r.Name(), s.cfg.NoFencing)
	case !ok:
		t.Fatalf("%s does not implement transport.Fencer: a KV manager fences a failed room's producers before reusing its pages, and this transport would lose that protection silently (implement AdmitEpoch/FenceEpoch, or run the suite with transporttest.WithoutFencing(reason))", e.r.Name())
	}
	const n = 64 << 10
	epoch := transport.NewEpoch()
	seg, err := e.openEpoch(epoch, true, e.dstDesc)
	if err != nil {
		t.Fatalf("open a segment with admitted epoch %d: %v", epoch, err)
	}
	defer seg.Close()
	peer := e.fencePeer
	e.run(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, n)}})
	if err := f.FenceEpoch(e.ctx, peer, epoch); err != nil {
		t.Fatalf("FenceEpoch(%d): %v", epoch, err)
	}
	e.cannotWrite(seg, e.write(n, n, n), "write through the fenced segment")
	e.verify()
	if err := f.FenceEpoch(e.ctx, peer, epoch); err != nil {
		t.Fatalf("second FenceEpoch(%d): %v, want nil", epoch, err)
	}
	if err := f.FenceEpoch(e.ctx, "nobody", transport.NewEpoch()); err != nil {
		t.Fatalf("FenceEpoch of an epoch never admitted: %v, want nil", err)
	}
	if !e.r.Capabilities().Has(transport.CapHandshake) {
		// A late segment of the fenced epoch, and one of an epoch never
		// admitted, cannot write.
		for _, c := range []struct {
			epoch uint64
			what  string
		}{{epoch, "segment opened with the fenced epoch"}, {transport.NewEpoch(), "segment opened with an epoch never admitted"}} {
			late, err := e.openEpoch(c.epoch, false, e.dstDesc)
			if err != nil {
				if !errors.Is(err, transport.ErrFenced) && !errors.Is(err, transport.ErrPeerLost) {
					t.Fatalf("%s: OpenSegment %v, want it refused with ErrFenced", c.what, err)
				}
				t.Logf("%s: OpenSegment refused: %v", c.what, err)
				continue
			}
			e.cannotWrite(late, e.write(2*n, 2*n, n), c.what)
			late.Close()
		}
		e.verify()
	}
	// A new epoch is a new data path: it writes.
	next := transport.NewEpoch()
	seg2, err := e.openEpoch(next, true, e.dstDesc)
	if err != nil {
		t.Fatalf("open a segment with a new admitted epoch %d: %v", next, err)
	}
	defer seg2.Close()
	e.run(seg2, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(3*n, 3*n, n)}})
	e.verify()
}

func fillRandom(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed*7919))
	var block [1 << 16]byte
	for i := 0; i < len(block); i += 8 {
		binary.LittleEndian.PutUint64(block[i:], r.Uint64())
	}
	for off := 0; off < len(b); off += len(block) {
		n := copy(b[off:], block[:])
		if n >= 8 { // tag each 64 KiB with its index so misplaced blocks show
			binary.LittleEndian.PutUint64(b[off:], uint64(off)^seed<<56)
		}
	}
}

func (s *suite) registerDeregister(t *testing.T) {
	e := s.newEnv(t, 1<<16, 1<<16)
	if e.dstDesc.Length != 1<<16 {
		t.Errorf("receiver RegionDesc.Length = %d, want %d", e.dstDesc.Length, 1<<16)
	}
	if e.srcDesc.ID == 0 && e.dstDesc.ID == 0 {
		t.Logf("note: region IDs are 0")
	}
	extra, err := transport.AllocHost("transporttest-extra", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	d1, err := e.r.RegisterMemory(extra.Memory())
	if err != nil {
		t.Fatalf("RegisterMemory second region: %v", err)
	}
	if d1.ID == e.dstDesc.ID {
		t.Errorf("two live regions share ID %d", d1.ID)
	}
	if err := e.r.DeregisterMemory(d1.ID); err != nil {
		t.Fatalf("DeregisterMemory(%d): %v", d1.ID, err)
	}
	if err := e.r.DeregisterMemory(d1.ID); !errors.Is(err, transport.ErrUnknownRegion) {
		t.Errorf("second DeregisterMemory(%d) = %v, want ErrUnknownRegion", d1.ID, err)
	}
	if err := e.r.DeregisterMemory(0xFFFFFF00); !errors.Is(err, transport.ErrUnknownRegion) {
		t.Errorf("DeregisterMemory(unknown) = %v, want ErrUnknownRegion", err)
	}
	if _, err := e.r.RegisterMemory(transport.Memory{Addr: extra.Addr(), Length: 0, FD: -1}); err == nil {
		t.Errorf("RegisterMemory with length 0 succeeded; want an error")
	}
	// Re-register after deregistration works and the region is usable.
	d2, err := e.r.RegisterMemory(extra.Memory())
	if err != nil {
		t.Fatalf("re-RegisterMemory: %v", err)
	}
	seg := e.open(d2)
	defer seg.Close()
	id, err := seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: e.src.Addr(), Remote: d2.ID, Length: 1 << 16}}})
	if err != nil {
		t.Fatalf("Submit to re-registered region: %v", err)
	}
	if st := e.wait(seg, id); st.State != transport.BatchCompleted {
		t.Fatalf("write to re-registered region: %v %v", st.State, st.Err)
	}
	if !bytes.Equal(extra.Bytes(), e.src.Bytes()[:1<<16]) {
		t.Fatalf("re-registered region content differs from the source")
	}
	if err := e.r.DeregisterMemory(d2.ID); err != nil {
		t.Fatal(err)
	}
}

func (s *suite) writeSizes(t *testing.T) {
	const mib = 1 << 20
	e := s.newEnv(t, 16*mib, 16*mib)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 2, 7, 63, 4096, 4097, 65536 + 3, mib, mib + 1, 4*mib + 1, 9*mib + 13, 16 * mib} {
		so := rng.IntN(16*mib - n + 1)
		do := rng.IntN(16*mib - n + 1)
		t.Run(fmt.Sprintf("bytes=%d", n), func(t *testing.T) {
			e.t = t
			e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(so, do, n)}})
			e.verify()
		})
	}
	// Edges of the region: first and last byte.
	e.t = t
	e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(5, 0, 1), e.write(9, 16*mib-1, 1)}})
	e.verify()
}

func (s *suite) multiRequestBatch(t *testing.T) {
	e := s.newEnv(t, 4<<20, 4<<20)
	rng := rand.New(rand.NewPCG(5, 6))
	var b transport.TransferBatch
	// 64 non-overlapping destination slots of 64 KiB, random lengths.
	for i := 0; i < 64; i++ {
		n := 1 + rng.IntN(64<<10)
		b.Requests = append(b.Requests, e.write(rng.IntN(4<<20-n), i*(64<<10), n))
	}
	e.run(e.seg, &b)
	e.verify()
}

// scattered sends the KV shape of a fragmented pool: one batch of many
// small writes (1 B .. 64 KiB, mostly 4 KiB pages) to random slots of two
// receiver regions in random order, so nothing is contiguous, mixed with a
// large write, a strided request and a write just over 256 KiB; then a
// batch of 2048 4 KiB pages in random order (more writes than one frame or
// one work-request chain holds).
func (s *suite) scattered(t *testing.T) {
	const mib, slot = 1 << 20, 64 << 10
	e := s.newEnv(t, 16*mib, 8*mib)
	x := e.addRegion(12 * mib)
	rng := rand.New(rand.NewPCG(11, 12))
	sizes := []int{1, 7, 512, 4096, 4096, 4096, 4096, 4099, 16 << 10, 32 << 10, slot - 1, slot}
	type dest struct {
		id  transport.RegionID
		off int
	}
	var slots []dest
	for i := 0; i < 8*mib/slot; i++ {
		slots = append(slots, dest{e.dstDesc.ID, i * slot}, dest{x.desc.ID, i * slot})
	}
	rng.Shuffle(len(slots), func(i, j int) { slots[i], slots[j] = slots[j], slots[i] })
	var b transport.TransferBatch
	for _, d := range slots {
		n := sizes[rng.IntN(len(sizes))]
		b.Requests = append(b.Requests, transport.WriteRequest{Local: e.src.Addr() + uintptr(rng.IntN(16*mib-n)),
			Remote: d.id, RemoteOffset: uint64(d.off + rng.IntN(slot-n+1)), Length: uint64(n)})
	}
	// Region x beyond 8 MiB: a large write, a strided one, one just over
	// 256 KiB, at random places in the batch.
	for _, r := range []transport.WriteRequest{
		{Local: e.src.Addr() + 3, Remote: x.desc.ID, RemoteOffset: 8 * mib, Length: mib + 5},
		{Local: e.src.Addr() + 999, Remote: x.desc.ID, RemoteOffset: 10 * mib, Length: 256, Count: 64, LocalStride: 512, RemoteStride: 1024},
		{Local: e.src.Addr() + 77, Remote: x.desc.ID, RemoteOffset: 11 * mib, Length: 256<<10 + 1},
	} {
		i := rng.IntN(len(b.Requests) + 1)
		b.Requests = append(b.Requests[:i], append([]transport.WriteRequest{r}, b.Requests[i:]...)...)
	}
	seg := e.open(e.dstDesc, x.desc)
	defer seg.Close()
	e.run(seg, &b)
	e.verify()

	t.Run("2048-pages", func(t *testing.T) {
		e.t = t
		var pages transport.TransferBatch
		for _, p := range rng.Perm(8 * mib / 4096) {
			pages.Requests = append(pages.Requests, e.write(rng.IntN(16*mib/4096)*4096, p*4096, 4096))
		}
		e.run(e.seg, &pages)
		e.verify()
	})
}

// scatteredRefused forges a SegmentInfo that claims a longer region and
// sends a batch of many small writes of which one lies past the real end:
// only the receiving side can refuse it. The batch must fail (with
// ErrOutOfBounds or ErrUnknownRegion), no byte outside the regions may
// change (writes of the batch inside them may or may not have landed), and
// the segment must keep working.
func (s *suite) scatteredRefused(t *testing.T) {
	const mib = 1 << 20
	e := s.newEnv(t, 4*mib, mib)
	x := e.addRegion(mib)
	forged := e.dstDesc
	forged.Length += mib
	seg := e.open(forged, x.desc)
	defer seg.Close()
	rng := rand.New(rand.NewPCG(13, 14))
	for _, badAt := range []int{0, 100, 255} {
		t.Run(fmt.Sprintf("bad=%d", badAt), func(t *testing.T) {
			e.t = t
			var b transport.TransferBatch
			pages := rng.Perm(2 * mib / 4096)
			for _, p := range pages[:256] {
				id := e.dstDesc.ID
				if p >= mib/4096 {
					id, p = x.desc.ID, p-mib/4096
				}
				b.Requests = append(b.Requests, transport.WriteRequest{Local: e.src.Addr() + uintptr(rng.IntN(4*mib/4096)*4096), Remote: id, RemoteOffset: uint64(p * 4096), Length: 4096})
			}
			free := pages[256] // a page no other write of the batch touches
			if free >= mib/4096 {
				free -= mib / 4096
			}
			b.Requests[badAt] = transport.WriteRequest{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: mib - 2048, Length: 4096}
			e.refused(seg, &b, transport.ErrOutOfBounds, transport.ErrUnknownRegion)
			// Inside the regions anything of this batch may have landed:
			// take the regions as they are, check the guards.
			copy(e.expected[guard:guard+mib], e.dst)
			for _, y := range e.extra {
				copy(y.expected[guard:len(y.expected)-guard], y.buf.Bytes()[guard:len(y.expected)-guard])
			}
			e.verify()
			// The segment keeps working: the same batch, all in bounds.
			b.Requests[badAt].Remote = e.dstDesc.ID
			if pages[256] >= mib/4096 {
				b.Requests[badAt].Remote = x.desc.ID
			}
			b.Requests[badAt].RemoteOffset = uint64(free * 4096)
			e.run(seg, &b)
			e.verify()
		})
	}
}

func (s *suite) strided(t *testing.T) {
	e := s.newEnv(t, 1<<20, 1<<20)
	cases := []transport.WriteRequest{
		// TP-mismatch head slicing: 16 blocks of 256 B, packed on the sender,
		// spread on the receiver.
		{Local: e.src.Addr() + 100, RemoteOffset: 0, Length: 256, Count: 16, LocalStride: 256, RemoteStride: 1024},
		// Spread on both sides, odd sizes.
		{Local: e.src.Addr() + 7, RemoteOffset: 65536 + 3, Length: 129, Count: 33, LocalStride: 300, RemoteStride: 129},
		// Many blocks (one descriptor).
		{Local: e.src.Addr(), RemoteOffset: 200000, Length: 128, Count: 2048, LocalStride: 256, RemoteStride: 384},
		// Count 1 behaves as contiguous.
		{Local: e.src.Addr() + 11, RemoteOffset: 1<<20 - 4096, Length: 4096, Count: 1, LocalStride: 99999, RemoteStride: 99999},
	}
	for i, r := range cases {
		r.Remote = e.dstDesc.ID
		t.Run(fmt.Sprintf("case%d/count=%d/len=%d", i, r.Count, r.Length), func(t *testing.T) {
			e.t = t
			e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{r}})
			e.verify()
		})
	}
}

func (s *suite) outOfBoundsSender(t *testing.T) {
	e := s.newEnv(t, 1<<20, 1<<20)
	n := int(e.dstDesc.Length)
	bad := []transport.WriteRequest{
		e.write(0, n-10, 11),      // one byte past the end
		e.write(0, n, 1),          // starts at the end
		e.write(0, 1<<62, 4096),   // far away
		e.write(0, n-4096, 1<<20), // long
		{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: uint64(n) - 4096, Length: 512, Count: 8, LocalStride: 512, RemoteStride: 1024}, // strided tail past the end
		{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: 0, Length: 8, Count: 4, LocalStride: 8, RemoteStride: 1 << 63},                 // stride overflow
	}
	for i, r := range bad {
		t.Run(fmt.Sprintf("case%d", i), func(t *testing.T) {
			e.t = t
			_, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 64), r}})
			if !errors.Is(err, transport.ErrOutOfBounds) {
				t.Fatalf("Submit of a write past the advertised region: err = %v, want ErrOutOfBounds at once", err)
			}
			e.verify() // nothing sent, not even the valid first request
		})
	}
	t.Run("local-outside-registered", func(t *testing.T) {
		e.t = t
		for _, r := range []transport.WriteRequest{
			{Local: e.src.Addr() + uintptr(e.src.Len()) - 10, Remote: e.dstDesc.ID, Length: 11},
			{Local: e.src.Addr() - 4096, Remote: e.dstDesc.ID, Length: 16},
			{Local: e.src.Addr(), Remote: e.dstDesc.ID, Length: 16, Count: 3, LocalStride: uint64(e.src.Len()), RemoteStride: 16},
		} {
			_, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{r}})
			if !errors.Is(err, transport.ErrOutOfBounds) {
				t.Errorf("Submit from local %#x (+%d) outside the registered source: err = %v, want ErrOutOfBounds", r.Local, r.Length, err)
			}
		}
		e.verify()
	})
	t.Run("still-usable", func(t *testing.T) {
		e.t = t
		e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, n-4096, 4096)}})
		e.verify()
	})
}

// outOfBoundsReceiver forges a SegmentInfo that claims a longer region, so
// only the receiving side can refuse.
func (s *suite) outOfBoundsReceiver(t *testing.T) {
	e := s.newEnv(t, 1<<20, 1<<20)
	n := int(e.dstDesc.Length)
	forged := e.dstDesc
	forged.Length += 1 << 20
	seg := e.open(forged)
	defer seg.Close()
	bad := []transport.WriteRequest{
		e.write(0, n-10, 11),
		e.write(0, n, guard),
		e.write(0, n-(1<<19), 1<<20), // half in, half out: nothing may land
		{Local: e.src.Addr(), Remote: e.dstDesc.ID, RemoteOffset: uint64(n) - 2048, Length: 512, Count: 8, LocalStride: 512, RemoteStride: 1024},
	}
	for i, r := range bad {
		t.Run(fmt.Sprintf("case%d", i), func(t *testing.T) {
			e.t = t
			e.refused(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{r}}, transport.ErrOutOfBounds, transport.ErrUnknownRegion)
			e.verify()
			// The same segment keeps working after a refusal.
			e.run(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(i*4096, i*4096, 4096)}})
			e.verify()
		})
	}
}

func (s *suite) unknownRegion(t *testing.T) {
	e := s.newEnv(t, 1<<16, 1<<16)
	t.Run("sender", func(t *testing.T) {
		e.t = t
		r := e.write(0, 0, 16)
		r.Remote = e.dstDesc.ID + 1000
		_, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{r}})
		if !errors.Is(err, transport.ErrUnknownRegion) {
			t.Fatalf("Submit to a region not in the SegmentInfo: err = %v, want ErrUnknownRegion", err)
		}
	})
	t.Run("receiver", func(t *testing.T) {
		e.t = t
		fake := e.dstDesc
		fake.ID = e.dstDesc.ID + 1000
		seg := e.open(e.dstDesc, fake)
		defer seg.Close()
		r := e.write(0, 0, 4096)
		r.Remote = fake.ID
		e.refused(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{r}}, transport.ErrUnknownRegion, transport.ErrOutOfBounds)
		e.verify()
		e.run(seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 4096)}})
		e.verify()
	})
}

func (s *suite) deregistered(t *testing.T) {
	e := s.newEnv(t, 1<<16, 1<<16)
	e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 4096)}})
	e.verify()
	if err := e.r.DeregisterMemory(e.dstDesc.ID); err != nil {
		t.Fatalf("DeregisterMemory: %v", err)
	}
	e.refused(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 4096, 4096)}}, transport.ErrUnknownRegion, transport.ErrOutOfBounds)
	e.verify()
}

func (s *suite) regionsAdded(t *testing.T) {
	e := s.newEnv(t, 1<<16, 1<<16)
	ra, ok := e.seg.(transport.RegionAdder)
	if !ok {
		t.Fatalf("%s segment does not implement transport.RegionAdder", e.s.Name())
	}
	late, err := transport.AllocHost("transporttest-late", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { late.Close() })
	ld, err := e.r.RegisterMemory(late.Memory())
	if err != nil {
		t.Fatalf("receiver RegisterMemory (late region): %v", err)
	}
	t.Cleanup(func() { _ = e.r.DeregisterMemory(ld.ID) })
	req := transport.WriteRequest{Local: e.src.Addr() + 512, Remote: ld.ID, RemoteOffset: 4096, Length: 8192}
	if _, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{req}}); !errors.Is(err, transport.ErrUnknownRegion) {
		t.Fatalf("Submit to a region registered after the open, before AddRegions: err = %v, want ErrUnknownRegion", err)
	}
	if err := ra.AddRegions([]transport.RegionDesc{e.dstDesc, ld}); err != nil {
		t.Fatalf("AddRegions: %v", err)
	}
	id, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{req, e.write(0, 0, 4096)}})
	if err != nil {
		t.Fatalf("Submit after AddRegions: %v", err)
	}
	if st := e.wait(e.seg, id); st.State != transport.BatchCompleted {
		t.Fatalf("batch after AddRegions: %v (%v), want completed", st.State, st.Err)
	}
	e.seg.Release(id)
	e.expect(e.write(0, 0, 4096))
	e.verify()
	if got, want := late.Bytes()[4096:4096+8192], e.src.Bytes()[512:512+8192]; !bytes.Equal(got, want) {
		t.Fatalf("late region: bytes differ from the source after the write")
	}
	if !bytes.Equal(late.Bytes()[:4096], make([]byte, 4096)) || !bytes.Equal(late.Bytes()[4096+8192:], make([]byte, len(late.Bytes())-4096-8192)) {
		t.Fatalf("late region: bytes outside the written range changed")
	}
	e.refused(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: e.src.Addr(), Remote: ld.ID, RemoteOffset: uint64(late.Len()) - 8, Length: 16}}}, transport.ErrOutOfBounds)
}

func (s *suite) concurrent(t *testing.T) {
	const workers, batches, slot = 8, 16, 512 << 10
	e := s.newEnv(t, 4<<20, workers*slot)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var all []transport.WriteRequest
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 77))
			for i := 0; i < batches; i++ {
				var b transport.TransferBatch
				// Requests inside a batch never overlap: disjoint 64 KiB cells.
				cells := rng.Perm(slot / (64 << 10))[:1+rng.IntN(8)]
				for _, c := range cells {
					n := 1 + rng.IntN(64<<10)
					b.Requests = append(b.Requests, e.write(rng.IntN(4<<20-n), w*slot+c*(64<<10), n))
				}
				id, err := e.seg.Submit(e.ctx, &b)
				if err != nil {
					errs <- fmt.Errorf("worker %d batch %d: Submit: %w", w, i, err)
					return
				}
				st, err := e.seg.Wait(e.ctx, id)
				if err != nil || st.State != transport.BatchCompleted {
					errs <- fmt.Errorf("worker %d batch %d: state %v err %v wait %v", w, i, st.State, st.Err, err)
					return
				}
				e.seg.Release(id)
				mu.Lock()
				all = append(all, b.Requests...) // applied in completion order per worker
				mu.Unlock()
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, r := range all {
		e.expect(r)
	}
	e.verify()
}

func (s *suite) pollWaitRelease(t *testing.T) {
	e := s.newEnv(t, 1<<20, 1<<20)
	b := &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 1<<20)}}
	id, err := e.seg.Submit(e.ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	// Poll never blocks and never goes backwards.
	for {
		st, err := e.seg.Poll(id)
		if err != nil {
			t.Fatalf("Poll: %v", err)
		}
		if st.State.Terminal() {
			break
		}
		if e.ctx.Err() != nil {
			t.Fatalf("batch never reached a terminal state by polling")
		}
		time.Sleep(100 * time.Microsecond)
	}
	st := e.wait(e.seg, id)
	if st.State != transport.BatchCompleted || st.BytesDone != 1<<20 || st.Err != nil {
		t.Fatalf("Wait = %+v, want completed with %d bytes and no error", st, 1<<20)
	}
	for i := 0; i < 3; i++ { // a terminal status is returned until Release
		if st2, err := e.seg.Poll(id); err != nil || st2.State != transport.BatchCompleted {
			t.Fatalf("Poll after completion = %+v, %v", st2, err)
		}
	}
	e.seg.Release(id)
	if _, err := e.seg.Poll(id); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Errorf("Poll after Release: %v, want ErrUnknownBatch", err)
	}
	if _, err := e.seg.Wait(e.ctx, id); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Errorf("Wait after Release: %v, want ErrUnknownBatch", err)
	}
	if err := e.seg.Cancel(id); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Errorf("Cancel after Release: %v, want ErrUnknownBatch", err)
	}
	e.seg.Release(id) // twice: harmless
	if _, err := e.seg.Poll(12345678); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Errorf("Poll(never submitted): %v, want ErrUnknownBatch", err)
	}
	// Wait honours its context.
	expired, cancel := context.WithCancel(e.ctx)
	cancel()
	id2, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 4096)}})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := e.seg.Wait(expired, id2); err == nil && !st.State.Terminal() {
		t.Errorf("Wait with a canceled context returned nil error and a pending state")
	}
	e.wait(e.seg, id2)
	e.seg.Release(id2)
}

func (s *suite) cancel(t *testing.T) {
	const mib = 1 << 20
	e := s.newEnv(t, 64*mib, 64*mib)
	var b transport.TransferBatch
	for i := 0; i < 64; i++ {
		b.Requests = append(b.Requests, e.write(i*mib, i*mib, mib))
	}
	e.submitCancel(&b)
	if err := e.seg.Cancel(999999); !errors.Is(err, transport.ErrUnknownBatch) {
		t.Errorf("Cancel(unknown) = %v, want ErrUnknownBatch", err)
	}
	// The segment stays usable; rewrite everything and verify.
	var again transport.TransferBatch
	for i := 0; i < 64; i++ {
		again.Requests = append(again.Requests, e.write(i*mib, i*mib, mib))
	}
	e.run(e.seg, &again)
	e.verify()
}

// submitCancel submits b on the env's segment, cancels it at once and
// requires it to end canceled (with ErrCanceled) or completed (Cancel is
// best effort), then releases it: Poll then answers ErrUnknownBatch.
func (e *env) submitCancel(b *transport.TransferBatch) {
	e.t.Helper()
	id, err := e.seg.Submit(e.ctx, b)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := e.seg.Cancel(id); err != nil {
		e.t.Fatalf("Cancel: %v", err)
	}
	st := e.wait(e.seg, id)
	switch st.State {
	case transport.BatchCanceled:
		if !errors.Is(st.Err, transport.ErrCanceled) {
			e.t.Errorf("canceled %s batch Err = %v, want ErrCanceled", b.Op, st.Err)
		}
		e.t.Logf("%s canceled after %d of %d bytes", b.Op, st.BytesDone, b.Bytes())
	case transport.BatchCompleted:
		e.t.Logf("%s batch completed before Cancel took effect (allowed: best effort)", b.Op)
	default:
		e.t.Fatalf("after Cancel: %s batch %v err %v, want canceled or completed", b.Op, st.State, st.Err)
	}
	e.seg.Release(id)
	if _, err := e.seg.Poll(id); !errors.Is(err, transport.ErrUnknownBatch) {
		e.t.Errorf("Poll after Release: %v, want ErrUnknownBatch", err)
	}
}

func (s *suite) closeIdempotent(t *testing.T) {
	e := s.newEnv(t, 1<<16, 1<<16)
	e.run(e.seg, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 4096)}})
	if err := e.seg.Close(); err != nil {
		t.Fatalf("segment Close: %v", err)
	}
	if err := e.seg.Close(); err != nil {
		t.Fatalf("second segment Close: %v", err)
	}
	if _, err := e.seg.Submit(e.ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, 16)}}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("Submit after segment Close = %v, want ErrClosed", err)
	}
	for _, tr := range []transport.Transport{e.s, e.r} {
		if err := tr.Close(); err != nil {
			t.Fatalf("%s Close: %v", tr.Name(), err)
		}
		if err := tr.Close(); err != nil {
			t.Fatalf("second %s Close: %v", tr.Name(), err)
		}
		if _, err := tr.RegisterMemory(e.src.Memory()); err == nil {
			t.Errorf("RegisterMemory after Close succeeded; want an error")
		}
	}
	e.verify()
}

// streamUntilLost submits batches of 8 MiB back to back on seg, calls stop
// after the first completes, and requires a batch (or Submit) to fail with
// ErrPeerLost within PeerLostWithin of stop, every batch terminal.
func (s *suite) streamUntilLost(t *testing.T, ctx context.Context, seg transport.Segment, mk func(i int) *transport.TransferBatch, stop func()) {
	t.Helper()
	var stopped time.Time
	stopDone := make(chan struct{})
	defer func() {
		if !stopped.IsZero() {
			<-stopDone
		}
	}()
	for i := 0; ; i++ {
		id, err := seg.Submit(ctx, mk(i))
		if err == nil {
			var st transport.BatchStatus
			st, err = seg.Wait(ctx, id)
			if err != nil {
				t.Fatalf("batch %d: Wait: %v (state %v) — hung after the peer went away", i, err, st.State)
			}
			seg.Release(id)
			switch st.State {
			case transport.BatchCompleted:
				err = nil
			case transport.BatchFailed:
				err = st.Err
			default:
				t.Fatalf("batch %d ended %v (%v); want completed or failed", i, st.State, st.Err)
			}
		}
		if err != nil {
			if stopped.IsZero() {
				t.Fatalf("batch %d failed before the peer went away: %v", i, err)
			}
			if !errors.Is(err, transport.ErrPeerLost) {
				t.Fatalf("after the peer went away: %v; want an error wrapping ErrPeerLost", err)
			}
			if d := time.Since(stopped); d > s.cfg.PeerLostWithin {
				t.Fatalf("peer loss reported %v after it happened; want within %v", d, s.cfg.PeerLostWithin)
			}
			t.Logf("batch %d: %v", i, err)
			return
		}
		if stopped.IsZero() {
			// Stop the peer while the next batch is in flight.
			go func() { defer close(stopDone); time.Sleep(time.Millisecond); stop() }()
			stopped = time.Now()
		} else if time.Since(stopped) > s.cfg.PeerLostWithin {
			t.Fatalf("batches still complete %v after the peer went away", time.Since(stopped))
		}
	}
}

func (s *suite) peerCloses(t *testing.T) {
	const mib = 1 << 20
	e := s.newEnv(t, 8*mib, 8*mib)
	mk := func(int) *transport.TransferBatch {
		var b transport.TransferBatch
		for j := 0; j < 8; j++ {
			b.Requests = append(b.Requests, e.write(j*mib, j*mib, mib))
		}
		return &b
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

func (s *suite) peerKilled(t *testing.T) {
	const mib = 1 << 20
	ctx, src, seg, region, kill := s.remoteSegment(t, 9)
	mk := func(int) *transport.TransferBatch {
		var b transport.TransferBatch
		for j := 0; j < 8; j++ {
			b.Requests = append(b.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(j*mib), Remote: region, RemoteOffset: uint64(j * mib), Length: mib})
		}
		return &b
	}
	s.streamUntilLost(t, ctx, seg, mk, kill)
}

// remoteSegment sets up the killed-peer cases (WRITE and READ): a fresh
// sender with 8 MiB of registered local memory filled with pattern seed, a
// receiver in another process (RemotePeer) with a region of at least
// 8 MiB, and a segment to it, all closed at the case's end. It returns the
// case context, the local buffer, the segment, the remote region and the
// function that kills the receiver process.
func (s *suite) remoteSegment(t *testing.T, seed uint64) (context.Context, *transport.HostBuffer, transport.Segment, transport.RegionID, func()) {
	t.Helper()
	skipWithoutRemotePeer(t, s.cfg)
	const mib = 1 << 20
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.CaseTimeout)
	t.Cleanup(cancel)
	local, err := transport.AllocHost("transporttest-local", 8*mib)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { local.Close() })
	fillRandom(local.Bytes(), seed)
	sender, recv := s.newPair(t)
	t.Cleanup(func() { sender.Close(); recv.Close() })
	if _, err := sender.RegisterMemory(local.Memory()); err != nil {
		t.Fatal(err)
	}
	info, kill := s.cfg.RemotePeer(t, 8*mib)
	if len(info.Regions) == 0 || info.Regions[0].Length < 8*mib {
		t.Fatalf("RemotePeer returned %d regions; want one of at least %d bytes", len(info.Regions), 8*mib)
	}
	seg, err := sender.OpenSegment(ctx, info)
	if err != nil {
		kill()
		t.Fatalf("OpenSegment to the remote peer: %v", err)
	}
	t.Cleanup(func() { seg.Close() })
	return ctx, local, seg, info.Regions[0].ID, kill
}

// skipWithoutRemotePeer skips a killed-peer case when the suite has no
// RemotePeer hook.
func skipWithoutRemotePeer(t *testing.T, cfg Config) {
	if cfg.RemotePeer == nil {
		t.Skip("no RemotePeer hook given (transporttest.WithRemotePeer): the cross-process kill case needs one")
	}
}

func (s *suite) large(t *testing.T) {
	if testing.Short() {
		t.Skip("large transfer skipped under -short")
	}
	n := int(s.cfg.LargeBytes) &^ (1<<20 - 1)
	if n <= 0 {
		t.Skip("large transfer disabled (LargeBytes <= 0)")
	}
	e := s.newEnv(t, n, n)
	// First half as one request (the transport splits it as it likes), the
	// second half as 1 MiB requests (the KV page-run shape).
	half := n / 2 &^ (1<<20 - 1)
	b := transport.TransferBatch{Requests: []transport.WriteRequest{e.write(0, 0, half)}}
	for off := half; off < n; off += 1 << 20 {
		b.Requests = append(b.Requests, e.write(off, off, 1<<20))
	}
	start := time.Now()
	// Not e.ctx: the whole case may outlast CaseTimeout under load while it
	// progresses (waitProgress bounds the stalls instead).
	id, err := e.seg.Submit(context.Background(), &b)
	if err != nil {
		t.Fatal(err)
	}
	st := e.waitProgress(e.seg, id, s.cfg.CaseTimeout)
	el := time.Since(start)
	if st.State != transport.BatchCompleted || st.BytesDone != uint64(n) {
		t.Fatalf("large batch: %v, %d of %d bytes, err %v", st.State, st.BytesDone, n, st.Err)
	}
	t.Logf("%d MiB in %v (%.2f GB/s, informational)", n>>20, el, float64(n)/el.Seconds()/1e9)
	if !bytes.Equal(e.dst, e.src.Bytes()[:n]) {
		for i := range e.dst {
			if e.dst[i] != e.src.Bytes()[i] {
				t.Fatalf("large transfer: first difference at byte %d", i)
			}
		}
	}
	g := e.dstBuf.Bytes()
	if !bytes.Equal(g[:guard], e.expected[:guard]) || !bytes.Equal(g[guard+n:], e.expected[guard+n:]) {
		t.Fatalf("large transfer wrote outside the region")
	}
}
