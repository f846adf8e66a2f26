package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// batch is one submitted TransferBatch.
type batch struct {
	id    transport.BatchID
	total uint64
	stop  atomic.Bool // canceled or failed: writers skip its unsent frames
	done  chan struct{}

	mu        sync.Mutex
	frames    int // frames not yet acknowledged, failed or skipped
	bytesDone uint64
	err       error
	skipped   bool
	canceled  bool
	state     transport.BatchState
	// tail is a LastAfterAll batch's last write (counted in frames),
	// held back until every other frame was acknowledged, then sent on
	// seg (nil once sent or dropped).
	tail *frame
	seg  *segment
}

// Status returns the batch's status, Err only once terminal (transport.TableBatch).
func (b *batch) Status() transport.BatchStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := transport.BatchStatus{State: b.state, BytesDone: b.bytesDone}
	if b.state.Terminal() {
		st.Err = b.err
	}
	return st
}

// Done is closed when the batch is terminal (transport.TableBatch).
func (b *batch) Done() <-chan struct{} { return b.done }

// Terminal reports whether done is closed (transport.TableBatch).
func (b *batch) Terminal() bool {
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

// finish accounts for one frame: landed bytes, its error, or skipped. When
// the frames left are only a LastAfterAll batch's tail, every other frame
// was acknowledged (its bytes landed): the tail is sent now, or, when the
// batch failed or was canceled, dropped (it never lands).
func (b *batch) finish(bytes uint64, err error, skipped bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.bytesDone += bytes
	if err != nil && b.err == nil {
		b.err = err
		b.stop.Store(true)
	}
	if skipped {
		b.skipped = true
	}
	b.frames--
	if t := b.tail; t != nil && b.frames == 1 {
		b.tail = nil
		if b.err == nil && !b.skipped && !b.stop.Load() {
			// Sent outside b.mu: a dead stream finishes it at once.
			b.mu.Unlock()
			b.seg.sendTail(t)
			b.mu.Lock()
			return
		}
		if b.err == nil {
			b.skipped = true // canceled before its last write
		}
		b.frames--
	}
	if b.frames > 0 {
		return
	}
	switch {
	case b.err != nil:
		b.state = transport.BatchFailed
	case b.skipped:
		b.state = transport.BatchCanceled
		b.err = fmt.Errorf("tcp: batch %d: %w after %d of %d bytes", b.id, transport.ErrCanceled, b.bytesDone, b.total)
	default:
		b.state = transport.BatchCompleted
	}
	close(b.done)
}

// frame is one header (+ payload) on one stream: a write frame (one request
// or chunk, local is its source region) or a scatter frame (many small
// requests; local is nil, table and srcs describe them). A read frame
// (hdr.Kind kindRead or kindReadScatter) has the same fields, local and
// srcs naming the destinations of the bytes the receiver sends back
// (read.go); its header (and table) is all the writer sends.
type frame struct {
	b      *batch
	hdr    header
	local  *region
	off    uint64 // offset of block 0 in local
	stride uint64 // local stride between blocks
	bytes  uint64 // payload bytes
	// scatter frames only: the encoded scatter table and each entry's
	// source bytes (destination bytes for a read) in registered host
	// memory, in table order, as one run per entry (a strided entry's
	// blocks are expanded into iovecs only when the frame is written);
	// blocks is the number of slices they expand to.
	table  []byte
	srcs   []srcRun
	blocks int
	// wire is the encoded header, written by the writer for the kernel.
	wire [headerSize]byte
	// localErr is a sender-side failure while writing the payload (device
	// copy); the frame was padded to keep the stream in sync and fails.
	// Atomic: set by the writer, read by the ack reader.
	localErr atomic.Pointer[error]
}

// srcRun is one scatter entry's local bytes: count blocks of length bytes,
// block k at span[k*stride:]. It stands for what would otherwise be one
// slice per block: a per-token batch's 262,144 1 KiB head slices are
// 4,096 runs (bench/RESULTS.md, issue 27).
type srcRun struct {
	span                  []byte
	stride, length, count uint64
}

// appendTo appends the run's blocks to iov, one slice each (one for all
// when they are back to back).
func (r srcRun) appendTo(iov [][]byte) [][]byte {
	if r.count == 1 || r.stride == r.length {
		return append(iov, r.span[:r.count*r.length])
	}
	for k := uint64(0); k < r.count; k++ {
		o := k * r.stride
		iov = append(iov, r.span[o:o+r.length])
	}
	return iov
}

// slices is the number of slices appendTo appends.
func (r srcRun) slices() int {
	if r.count == 1 || r.stride == r.length {
		return 1
	}
	return int(r.count)
}

// device reports whether the frame's payload is read from device memory
// (it then goes alone through the bounce buffer). A read frame sends no
// payload: never.
func (f *frame) device() bool { return f.local != nil && f.local.buf == nil && !f.hdr.read() }

// iovs is the number of slices the frame needs in a vectored write.
func (f *frame) iovs() int {
	switch {
	case f.hdr.Kind == kindReadScatter:
		return 2
	case f.hdr.read():
		return 1
	case f.hdr.Kind == kindScatter:
		return 2 + f.blocks
	}
	return 1 + int(f.hdr.Count)
}

// wireBytes is the payload the writer sends for the frame (0 for a read).
func (f *frame) wireBytes() uint64 {
	if f.hdr.read() {
		return 0
	}
	return f.bytes
}

// stream is one data connection of a segment.
type stream struct {
	seg *segment
	idx int
	c   net.Conn

	queued atomic.Uint64 // payload bytes queued or in flight (load balance)
	wake   chan struct{}

	mu       sync.Mutex
	queue    []*frame // not yet written
	inflight []*frame // written (or being written), awaiting ack, in order
	dead     bool
	deadErr  error
	// idleLoss: the connection was lost (reset, closed by the peer) while
	// no frame was queued or in flight, so no write can still land through
	// it and the segment may dial it again (segment.redial).
	idleLoss bool
	seq      uint64
	lastAck  time.Time
	raw      syscall.RawConn // for the reader's readv of read payloads (read.go)

	writerDone chan struct{}
	readerDone chan struct{}

	// reader-only state (read.go): destinations of one read answer, and
	// the staging buffer of answers into device memory
	answerIOV    [][]byte
	answerBounce []byte

	// writer-only state
	hdrBuf [headerSize]byte
	iov    [][]byte
	bufs   net.Buffers
	bounce []byte
	burst  []*frame
}

var _ transport.RegionAdder = (*segment)(nil)

// segment is a sender's connection to one receiver.
type segment struct {
	t     *Transport
	addr  string
	epoch uint64 // SegmentInfo.Epoch, sent in every stream's hello
	// remote is the receiver's region table, replaced whole (copy on
	// write) by AddRegions so Submit reads it without a lock.
	remote atomic.Pointer[map[transport.RegionID]transport.RegionDesc]

	mu sync.Mutex // guards closed, streams and retired; Submit adds to batches under it
	// streams is replaced whole (copy on write) when a stream is dialled
	// again; readers take it under mu.
	streams []*stream
	retired []*stream // replaced streams, waited for by Close
	closed  bool
	batches *transport.BatchTable[*batch]
	// redialMu serializes redials; nextRedial (under it) is the earliest
	// time of the next attempt after a failed one.
	redialMu   sync.Mutex
	nextRedial time.Time
	redialWait time.Duration
}

// Redial backoff: the attempts of one redial (Submit) are redialPauses
// apart; after a redial failed, the segment tries again no sooner than
// redialWait later, doubling up to maxRedialWait.
var redialPauses = []time.Duration{0, 50 * time.Millisecond, 200 * time.Millisecond}

const (
	minRedialWait = 250 * time.Millisecond
	maxRedialWait = 5 * time.Second
	// redialDialTimeout bounds one connection attempt of a redial.
	redialDialTimeout = 2 * time.Second
)

// dialStream opens data connection i of the segment and sends its hello
// (protocol version, stream index, epoch).
func (s *segment) dialStream(ctx context.Context, i int, timeout time.Duration) (*stream, error) {
	d := net.Dialer{KeepAlive: 5 * time.Second, Timeout: timeout}
	c, err := d.DialContext(ctx, "tcp", s.addr)
	if err != nil {
		return nil, err
	}
	tuneConn(c)
	var hb [helloSize]byte
	hello{Version: protoVersion, Stream: uint16(i), Epoch: s.epoch}.encode(&hb)
	c.SetWriteDeadline(time.Now().Add(s.t.ackTimeout))
	if _, err = c.Write(hb[:]); err != nil {
		c.Close()
		return nil, err
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("data connection %T has no file descriptor", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		c.Close()
		return nil, err
	}
	return &stream{seg: s, idx: i, c: c, raw: raw, wake: make(chan struct{}, 1),
		writerDone: make(chan struct{}), readerDone: make(chan struct{})}, nil
}

// redial dials again every stream whose connection was lost while idle
// (stream.idleLoss: a reset, or the receiver closed it, with nothing in
// flight), so the next batch goes through instead of failing: a data
// connection broken between rooms heals without a room failing (issue 18
// case 1). A stream lost with frames in flight is not dialled again: that
// batch failed, and the engine fences the epoch. The receiver admits the new
// connections only while the segment's epoch is admitted and not fenced.
// Bounded: len(redialPauses) attempts of at most redialDialTimeout each,
// then no new attempt for a backoff that doubles up to maxRedialWait.
// Returns the first dial error when a stream could not be dialled.
func (s *segment) redial(ctx context.Context) error {
	need := func() []int {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.closed {
			return nil
		}
		var idx []int
		for i, st := range s.streams {
			st.mu.Lock()
			if st.dead && st.idleLoss {
				idx = append(idx, i)
			}
			st.mu.Unlock()
		}
		return idx
	}
	if len(need()) == 0 {
		return nil
	}
	s.redialMu.Lock()
	defer s.redialMu.Unlock()
	idx := need() // another Submit may have redialled meanwhile
	if len(idx) == 0 || time.Now().Before(s.nextRedial) {
		return nil
	}
	fresh := make(map[int]*stream, len(idx))
	var lastErr error
	for _, pause := range redialPauses {
		if pause > 0 {
			select {
			case <-ctx.Done():
				lastErr = ctx.Err()
			case <-time.After(pause):
			}
			if ctx.Err() != nil {
				break
			}
		}
		for _, i := range idx {
			if fresh[i] != nil {
				continue
			}
			st, err := s.dialStream(ctx, i, redialDialTimeout)
			if err != nil {
				lastErr = err
				continue
			}
			fresh[i] = st
		}
		if len(fresh) == len(idx) {
			lastErr = nil
			break
		}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		for _, st := range fresh {
			st.c.Close()
		}
		return nil
	}
	next := slices.Clone(s.streams)
	for i, st := range fresh {
		s.retired = append(s.retired, next[i])
		next[i] = st
		go st.writer()
		go st.reader()
	}
	s.streams = next
	s.mu.Unlock()
	if lastErr != nil {
		s.redialWait = min(max(2*s.redialWait, minRedialWait), maxRedialWait)
		s.nextRedial = time.Now().Add(s.redialWait)
		return fmt.Errorf("tcp: dial %s again (%d of %d streams lost while idle): %w", s.addr, len(idx)-len(fresh), len(s.streams), lastErr)
	}
	s.redialWait = 0
	s.t.redials.Add(uint64(len(fresh)))
	return nil
}

// OpenSegment dials Options.Streams data connections to the receiver whose
// Endpoint blob is info.Endpoint ("host:port") and remembers info.Regions for
// sender-side validation (the receiver checks again). Errors: a malformed
// endpoint, a dial failure (wraps transport.ErrPeerLost: is the receiver's
// transport running and its ListenHost reachable?), a closed transport.
func (t *Transport) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	addr := string(info.Endpoint)
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("tcp: open segment: endpoint %q is not host:port: %w", addr, err)
	}
	t.mu.RLock()
	closed := t.closed
	t.mu.RUnlock()
	if closed {
		return nil, fmt.Errorf("tcp: open segment to %s: transport %w", addr, transport.ErrClosed)
	}
	s := &segment{t: t, addr: addr, epoch: info.Epoch, batches: transport.NewBatchTable[*batch]("tcp")}
	remote := make(map[transport.RegionID]transport.RegionDesc, len(info.Regions))
	for _, d := range info.Regions {
		remote[d.ID] = d
	}
	s.remote.Store(&remote)
	var timeout time.Duration
	if _, ok := ctx.Deadline(); !ok {
		timeout = t.ackTimeout
	}
	for i := 0; i < t.streams; i++ {
		st, err := s.dialStream(ctx, i, timeout)
		if err != nil {
			for _, st := range s.streams {
				st.c.Close()
			}
			return nil, fmt.Errorf("tcp: open segment to %s: stream %d of %d: %w: %v (is the receiver's transport running and its listen address reachable?)",
				addr, i+1, t.streams, transport.ErrPeerLost, err)
		}
		s.streams = append(s.streams, st)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		for _, st := range s.streams {
			st.c.Close()
		}
		return nil, fmt.Errorf("tcp: open segment to %s: transport %w", addr, transport.ErrClosed)
	}
	t.segments[s] = struct{}{}
	t.mu.Unlock()
	for _, st := range s.streams {
		go st.writer()
		go st.reader()
	}
	return s, nil
}

// AddRegions adds receiver regions registered after the segment was opened
// (transport.RegionAdder); regions already in the table are kept as they are.
// The receiver checks every write against its own registrations anyway.
func (s *segment) AddRegions(regions []transport.RegionDesc) error {
	s.mu.Lock() // one writer at a time
	defer s.mu.Unlock()
	old := *s.remote.Load()
	next := make(map[transport.RegionID]transport.RegionDesc, len(old)+len(regions))
	for id, d := range old {
		next[id] = d
	}
	for _, d := range regions {
		if _, ok := next[d.ID]; !ok {
			next[d.ID] = d
		}
	}
	s.remote.Store(&next)
	return nil
}

// HandshakeReply returns nil: TCP needs no second handshake step.
func (s *segment) HandshakeReply() []byte { return nil }

// checkRequest validates one request of a batch of op against the remote
// descriptor and the local registrations and returns the local region
// holding its source (a write) or destination (a read).
func (s *segment) checkRequest(i int, op transport.Op, r transport.WriteRequest) (*region, error) {
	if r.Length == 0 {
		return nil, fmt.Errorf("tcp: request %d: length must be > 0 bytes", i)
	}
	blocks := r.Blocks()
	if op == transport.OpWrite && blocks > 1 && r.RemoteStride < r.Length {
		return nil, fmt.Errorf("tcp: request %d: remote stride %d < block length %d (blocks would overlap)", i, r.RemoteStride, r.Length)
	}
	desc, ok := (*s.remote.Load())[r.Remote]
	if !ok {
		return nil, fmt.Errorf("tcp: request %d: remote region %d on %s: %w (not in the segment's region table)", i, r.Remote, s.addr, transport.ErrUnknownRegion)
	}
	if hi, lo := bits.Mul64(blocks, r.Length); hi != 0 || lo > maxFramePayload {
		return nil, fmt.Errorf("tcp: request %d: %d blocks of %d bytes exceed the %d-byte request limit; split it", i, blocks, r.Length, uint64(maxFramePayload))
	}
	end, ok := header{Count: uint32(blocks), Offset: r.RemoteOffset, Length: r.Length, Stride: r.RemoteStride}.span()
	if !ok || end > desc.Length {
		return nil, fmt.Errorf("tcp: request %d: %s of region %d at offset %d length %d x %d (stride %d) ends at %d, past its %d bytes: %w",
			i, op, r.Remote, r.RemoteOffset, blocks, r.Length, r.RemoteStride, end, desc.Length, transport.ErrOutOfBounds)
	}
	lend, ok := header{Count: uint32(blocks), Offset: uint64(r.Local), Length: r.Length, Stride: r.LocalStride}.span()
	if !ok {
		return nil, fmt.Errorf("tcp: request %d: local range at %#x overflows: %w", i, r.Local, transport.ErrOutOfBounds)
	}
	lr, err := s.t.lookupLocal(r.Local, lend-uint64(r.Local))
	if err != nil {
		return nil, fmt.Errorf("tcp: request %d: %w", i, err)
	}
	return lr, nil
}

// Scatter frames: a request of one block of at most scatterEntryMax bytes,
// from host memory to a host region, is a small write. A batch's small
// writes travel packed, in batch order, in scatter frames of at most
// maxScatterEntries entries; the payload per frame is the batch's small
// bytes spread over the segment's streams, within [scatterMinBytes,
// scatterMaxBytes] (see scatterLimit). The cap also bounds the bytes one
// ack covers: a stream whose receiver lands scattered pages slowly (cold
// memory on a loaded host) still acknowledges every MiB, well inside the
// ack timeout; 4 MiB frames of 4 KiB pages went 10 s without an ack on the
// 2-core build VM at load 50 (TP 8 → 8 demo, 16 ranks).
const (
	scatterEntryMax = 256 << 10
	scatterMinBytes = 256 << 10
	scatterMaxBytes = 1 << 20
)

// scatterLimit returns the payload cap of one scatter frame for a batch
// with total bytes of small writes over streams connections: total/streams
// (so every stream gets a share), at least scatterMinBytes (fewer, larger
// frames when the batch is small) and at most scatterMaxBytes.
func scatterLimit(total uint64, streams int) uint64 {
	per := (total + uint64(streams) - 1) / uint64(max(streams, 1))
	return min(max(per, scatterMinBytes), scatterMaxBytes)
}

// packer groups small writes into scatter frames of at most limit bytes.
type packer struct {
	limit   uint64
	entries int
	bytes   uint64
}

// add accounts for a small write of n bytes and reports whether it starts a
// new scatter frame.
func (p *packer) add(n uint64) bool {
	if p.entries == 0 || p.entries == maxScatterEntries || p.bytes+n > p.limit {
		p.entries, p.bytes = 1, n
		return true
	}
	p.entries++
	p.bytes += n
	return false
}

// reset starts over with the same limit.
func (p *packer) reset() { p.entries, p.bytes = 0, 0 }

// readFrame is one frame of a strided read: count blocks of length bytes,
// the first at remoteOff (localOff) from the request's start, stride apart
// on the remote side (0 for one block).
type readFrame struct {
	count               uint32
	length              uint64
	localOff, remoteOff uint64
	stride              uint64
}

// readFrames returns how many frames splitRead cuts r into.
func readFrames(r transport.WriteRequest) int {
	if r.Length <= chunkSize {
		k := chunkSize / r.Length
		return int((r.Blocks() + k - 1) / k)
	}
	return int(r.Blocks() * ((r.Length + chunkSize - 1) / chunkSize))
}

// splitRead cuts a strided read into frames of at most chunkSize bytes:
// runs of chunkSize/Length blocks, or, for blocks over chunkSize, each
// block in chunkSize pieces.
func splitRead(r transport.WriteRequest) []readFrame {
	out := make([]readFrame, 0, readFrames(r))
	blocks := r.Blocks()
	if r.Length <= chunkSize {
		k := chunkSize / r.Length
		for first := uint64(0); first < blocks; first += k {
			c := min(k, blocks-first)
			rf := readFrame{count: uint32(c), length: r.Length, localOff: first * r.LocalStride, remoteOff: first * r.RemoteStride}
			if c > 1 {
				rf.stride = r.RemoteStride
			}
			out = append(out, rf)
		}
		return out
	}
	for i := uint64(0); i < blocks; i++ {
		for done := uint64(0); done < r.Length; done += chunkSize {
			out = append(out, readFrame{count: 1, length: min(chunkSize, r.Length-done), localOff: i*r.LocalStride + done, remoteOff: i*r.RemoteStride + done})
		}
	}
	return out
}

// Submit validates every request (remote region known and in bounds, local
// range inside a registered region; errors wrap transport.ErrUnknownRegion or
// transport.ErrOutOfBounds and nothing is sent), packs small requests (one
// block of at most 256 KiB, or a strided write of at most 256 KiB whose
// blocks are back to back on the receiver, host to host) into scatter frames of at most
// 1024 requests and 256 KiB..1 MiB (the batch's small bytes over the
// streams), splits contiguous requests over 4 MiB into 4 MiB frames, and
// queues the frames on the least-loaded streams. A read batch
// (transport.OpRead) is framed the same way with read frames (read.go),
// and a strided read is also split into frames of at most 4 MiB, so the
// receiver stages at most that much of device memory per frame and a large
// strided read spreads over the streams.
// Errors also: a closed segment (ErrClosed), every stream lost (ErrPeerLost).
func (s *segment) Submit(ctx context.Context, tb *transport.TransferBatch) (transport.BatchID, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("tcp: submit: %w", err)
	}
	if tb == nil {
		return 0, errors.New("tcp: submit: nil batch")
	}
	if err := transport.CheckBatch(Name, s.t.Capabilities(), tb); err != nil {
		return 0, err
	}
	// Validate everything first (nothing is sent on error), then build all
	// frames in one allocation. Small contiguous host-to-host requests are
	// packed into scatter frames (see scatterEntryMax, scatterFrameBytes).
	read := tb.Op == transport.OpRead
	kind, scatterKind := uint8(kindWrite), uint8(kindScatter)
	if read {
		kind, scatterKind = kindRead, kindReadScatter
	}
	// A LastAfterAll batch's last write (8 bytes, CheckBatch) is a plain
	// write frame held back until the others are acknowledged (finish).
	reqs := tb.Requests
	var tailReq *transport.WriteRequest
	var tailLocal *region
	if tb.LastAfterAll && len(reqs) > 1 {
		tailReq = &reqs[len(reqs)-1]
		reqs = reqs[:len(reqs)-1]
		lr, err := s.checkRequest(len(reqs), tb.Op, *tailReq)
		if err != nil {
			return 0, err
		}
		tailLocal = lr
	}
	locals := make([]*region, len(reqs))
	small := make([]bool, len(reqs))
	nframes, nsmall := 0, 0
	var smallBytes uint64
	remote := *s.remote.Load()
	for i, r := range reqs {
		lr, err := s.checkRequest(i, tb.Op, r)
		if err != nil {
			return 0, err
		}
		locals[i] = lr
		hostToHost := lr.buf != nil && remote[r.Remote].Kind == transport.MemoryHost
		switch {
		case r.Blocks() == 1 && r.Length <= scatterEntryMax && hostToHost,
			// A small strided write whose blocks are back to back on the
			// receiver (head slices into whole decode tokens) is one
			// scatter entry: one remote range, its blocks' sources in order.
			!read && r.Blocks() > 1 && r.RemoteStride == r.Length && r.Bytes() <= scatterEntryMax && hostToHost:
			small[i] = true
			nsmall++
			smallBytes += r.Bytes()
		case r.Blocks() > 1 && read:
			nframes += readFrames(r)
		case r.Blocks() > 1:
			nframes++
		default:
			nframes += int((r.Length + chunkSize - 1) / chunkSize)
		}
	}
	if nsmall == 1 { // a lone small write: a plain write frame is cheaper
		clear(small)
		nsmall, smallBytes = 0, 0
		nframes++
	}
	pk := packer{limit: scatterLimit(smallBytes, s.t.streams)}
	for i := range small {
		if small[i] && pk.add(reqs[i].Bytes()) {
			nframes++
		}
	}
	store := make([]frame, 0, nframes)
	frames := make([]*frame, 0, nframes)
	b := &batch{done: make(chan struct{}), seg: s}
	var (
		srcs  = make([]srcRun, 0, nsmall) // cur.srcs extend in place: never reallocated
		table = make([]byte, nsmall*entrySize)
		cur   *frame
	)
	pk.reset()
	for i, r := range reqs {
		lr := locals[i]
		off := uint64(r.Local - lr.mem.Addr)
		if small[i] {
			n := r.Bytes()
			if pk.add(n) {
				if cur != nil {
					cur.table = table[:int(cur.hdr.Count)*entrySize]
					table = table[len(cur.table):]
				}
				store = append(store, frame{b: b, hdr: header{Kind: scatterKind}})
				cur = &store[len(store)-1]
				frames = append(frames, cur)
				cur.srcs = srcs[len(srcs):]
			}
			putEntry(table[int(cur.hdr.Count)*entrySize:], entry{Region: uint32(r.Remote), Length: uint32(n), Offset: r.RemoteOffset})
			run := srcRun{span: lr.buf[off : off+(r.Blocks()-1)*r.LocalStride+r.Length], stride: r.LocalStride, length: r.Length, count: r.Blocks()}
			srcs = append(srcs, run)
			cur.srcs = cur.srcs[:len(cur.srcs)+1]
			cur.blocks += run.slices()
			cur.hdr.Count++
			cur.hdr.Length += n
			cur.bytes += n
			continue
		}
		if r.Blocks() > 1 && read {
			for _, rf := range splitRead(r) {
				store = append(store, frame{b: b, local: lr, off: off + rf.localOff, stride: r.LocalStride, bytes: uint64(rf.count) * rf.length,
					hdr: header{Kind: kindRead, Region: uint32(r.Remote), Count: rf.count, Offset: r.RemoteOffset + rf.remoteOff, Length: rf.length, Stride: rf.stride}})
				frames = append(frames, &store[len(store)-1])
			}
			continue
		}
		if r.Blocks() > 1 {
			store = append(store, frame{b: b, local: lr, off: off, stride: r.LocalStride, bytes: r.Bytes(),
				hdr: header{Region: uint32(r.Remote), Count: uint32(r.Blocks()), Offset: r.RemoteOffset, Length: r.Length, Stride: r.RemoteStride}})
			frames = append(frames, &store[len(store)-1])
			continue
		}
		for done := uint64(0); done < r.Length; done += chunkSize {
			n := min(chunkSize, r.Length-done)
			store = append(store, frame{b: b, local: lr, off: off + done, bytes: n,
				hdr: header{Kind: kind, Region: uint32(r.Remote), Count: 1, Offset: r.RemoteOffset + done, Length: n}})
			frames = append(frames, &store[len(store)-1])
		}
	}
	if cur != nil {
		cur.table = table[:int(cur.hdr.Count)*entrySize]
	}
	b.total = tb.Bytes()
	b.frames = len(frames)
	if tailReq != nil {
		r := *tailReq
		b.tail = &frame{b: b, local: tailLocal, off: uint64(r.Local - tailLocal.mem.Addr), bytes: r.Length,
			hdr: header{Kind: kindWrite, Region: uint32(r.Remote), Count: 1, Offset: r.RemoteOffset, Length: r.Length}}
		if len(frames) == 0 { // nothing to wait for: it goes now
			frames = append(frames, b.tail)
			b.tail = nil
		}
		b.frames = len(frames)
		if b.tail != nil {
			b.frames++ // sent by finish
		}
	}

	redialErr := s.redial(ctx)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return 0, fmt.Errorf("tcp: submit to %s: segment %w", s.addr, transport.ErrClosed)
	}
	streams := s.streams
	live := 0
	var lost error
	for _, st := range streams {
		st.mu.Lock()
		if !st.dead {
			live++
		} else if lost == nil {
			lost = st.deadErr
		}
		st.mu.Unlock()
	}
	if live == 0 {
		s.mu.Unlock()
		if redialErr != nil {
			return 0, fmt.Errorf("tcp: submit to %s: %w; %w", s.addr, lost, redialErr)
		}
		return 0, fmt.Errorf("tcp: submit to %s: %w", s.addr, lost)
	}
	// b.id is read only by finish, which runs after the frames are queued.
	b.id = s.batches.Add(b)
	s.mu.Unlock()

	if len(frames) == 0 {
		b.frames = 1
		b.finish(0, nil, false)
		return b.id, nil
	}
	per := make([][]*frame, len(streams))
	for _, f := range frames {
		best := 0
		for j := 1; j < len(streams); j++ {
			if streams[j].queued.Load() < streams[best].queued.Load() {
				best = j
			}
		}
		streams[best].queued.Add(f.bytes)
		per[best] = append(per[best], f)
	}
	for j, fs := range per {
		if len(fs) > 0 {
			streams[j].enqueue(fs)
		}
	}
	return b.id, nil
}

// sendTail queues a LastAfterAll batch's held-back last frame on the live
// stream with the least queued (a dead stream fails it at once; a closed
// segment fails it with ErrClosed).
func (s *segment) sendTail(f *frame) {
	s.mu.Lock()
	streams, closed := s.streams, s.closed
	s.mu.Unlock()
	if closed || len(streams) == 0 {
		f.b.finish(0, fmt.Errorf("tcp: submit to %s: segment %w before the batch's last write", s.addr, transport.ErrClosed), false)
		return
	}
	best := -1
	for j, st := range streams {
		st.mu.Lock()
		dead := st.dead
		st.mu.Unlock()
		if !dead && (best < 0 || st.queued.Load() < streams[best].queued.Load()) {
			best = j
		}
	}
	best = max(best, 0)
	streams[best].queued.Add(f.bytes)
	streams[best].enqueue([]*frame{f})
}

// Poll returns the batch's status without blocking (ErrUnknownBatch after
// Release or for an ID never returned by Submit).
func (s *segment) Poll(id transport.BatchID) (transport.BatchStatus, error) {
	return s.batches.Poll(id)
}

// Wait blocks until the batch is terminal or ctx ends (then it returns the
// current status and ctx's error).
func (s *segment) Wait(ctx context.Context, id transport.BatchID) (transport.BatchStatus, error) {
	return s.batches.Wait(ctx, id)
}

// Cancel stops sending the batch's frames that are not on the wire yet. The
// batch ends Canceled if any frame was skipped, Completed if all had already
// landed, Failed if one failed. Errors: ErrUnknownBatch.
func (s *segment) Cancel(id transport.BatchID) error {
	b, err := s.batches.Get(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	b.canceled = true
	b.mu.Unlock()
	b.stop.Store(true)
	return nil
}

// Release forgets a terminal batch. Releasing a pending batch is ignored (its
// memory is still in use; Cancel and Wait first).
func (s *segment) Release(id transport.BatchID) {
	s.batches.Release(id)
}

// Close closes every stream; pending batches fail with an error wrapping
// transport.ErrClosed (or ErrPeerLost if the peer was lost first). It returns
// once no stream reads local memory any more. Idempotent.
func (s *segment) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	streams := append(slices.Clone(s.streams), s.retired...)
	s.mu.Unlock()
	for _, st := range streams {
		st.kill(fmt.Errorf("tcp: segment to %s %w", s.addr, transport.ErrClosed))
	}
	for _, st := range streams {
		<-st.writerDone
		<-st.readerDone
	}
	s.t.mu.Lock()
	delete(s.t.segments, s)
	s.t.mu.Unlock()
	return nil
}

func (st *stream) enqueue(fs []*frame) {
	st.mu.Lock()
	if st.dead {
		err := st.deadErr
		st.mu.Unlock()
		for _, f := range fs {
			st.queued.Add(^(f.bytes - 1))
			f.b.finish(0, err, false)
		}
		return
	}
	st.queue = append(st.queue, fs...)
	st.mu.Unlock()
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// kill marks the stream dead with err (first error wins) and closes its
// socket; the writer then fails every queued and in-flight frame.
func (st *stream) kill(err error) {
	st.mu.Lock()
	if !st.dead {
		st.dead = true
		st.deadErr = err
		st.idleLoss = len(st.inflight) == 0 && len(st.queue) == 0 &&
			errors.Is(err, transport.ErrPeerLost) && !errors.Is(err, transport.ErrFenced)
	}
	st.mu.Unlock()
	st.c.Close()
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

func (st *stream) lost(format string, args ...any) error {
	return fmt.Errorf("tcp: stream %d to %s: %w: %s", st.idx, st.seg.addr, transport.ErrPeerLost, fmt.Sprintf(format, args...))
}

// writer owns the socket's write side. It is the only goroutine that fails
// in-flight frames, so no frame fails while its payload is being written.
func (st *stream) writer() {
	defer close(st.writerDone)
	for {
		st.mu.Lock()
		for len(st.queue) == 0 && !st.dead {
			st.mu.Unlock()
			<-st.wake
			st.mu.Lock()
		}
		if st.dead {
			fs := append(st.inflight, st.queue...)
			st.inflight, st.queue = nil, nil
			err := st.deadErr
			st.mu.Unlock()
			for _, f := range fs {
				st.queued.Add(^(f.bytes - 1))
				f.b.finish(0, err, false)
			}
			return
		}
		// Take a burst of queued host frames for one vectored write (at
		// most burstIOV slices and burstBytes of payload; one frame of any
		// size always goes); a device frame goes alone.
		burst := st.burst[:0]
		var skipped []*frame
		iovs, size := 0, uint64(0)
		for len(st.queue) > 0 {
			f := st.queue[0]
			if f.b.stop.Load() {
				st.queue[0] = nil
				st.queue = st.queue[1:]
				skipped = append(skipped, f)
				continue
			}
			need := f.iovs()
			if len(burst) > 0 && (f.device() || iovs+need > burstIOV || size+f.wireBytes() > burstBytes) {
				break
			}
			st.queue[0] = nil
			st.queue = st.queue[1:]
			st.seq++
			f.hdr.Seq = st.seq
			if len(st.inflight) == 0 {
				st.lastAck = time.Now()
			}
			st.inflight = append(st.inflight, f)
			burst = append(burst, f)
			iovs += need
			size += f.wireBytes()
			if f.device() {
				break
			}
		}
		st.mu.Unlock()
		for _, f := range skipped {
			st.queued.Add(^(f.bytes - 1))
			f.b.finish(0, nil, true)
		}
		if len(burst) > 0 {
			if err := st.write(burst); err != nil {
				st.kill(st.lost("write frames %d..%d (%d bytes): %v", burst[0].hdr.Seq, burst[len(burst)-1].hdr.Seq, size, err))
			}
		}
		clear(burst)
		st.burst = burst[:0]
	}
}

// write sends a burst of frames: every header and payload slice of host
// frames in one vectored write (no staging copy); a device frame (always
// alone in its burst) through the bounce buffer.
func (st *stream) write(burst []*frame) error {
	st.c.SetWriteDeadline(time.Now().Add(st.seg.t.ackTimeout))
	if !burst[0].device() {
		// st.bufs is a field so WriteTo's pointer receiver does not make
		// a per-call allocation; st.iov keeps the backing array.
		st.iov = st.iov[:0]
		for _, f := range burst {
			f.hdr.encode(&f.wire)
			st.iov = append(st.iov, f.wire[:])
			switch f.hdr.Kind {
			case kindScatter:
				st.iov = append(st.iov, f.table)
				for _, r := range f.srcs {
					st.iov = r.appendTo(st.iov)
				}
				continue
			case kindReadScatter:
				st.iov = append(st.iov, f.table)
				continue
			case kindRead:
				continue
			}
			if f.hdr.Count > 1 && f.stride == f.hdr.Length { // blocks back to back here: one range
				st.iov = append(st.iov, f.local.buf[f.off:f.off+f.bytes])
				continue
			}
			for i := uint64(0); i < uint64(f.hdr.Count); i++ {
				o := f.off + i*f.stride
				st.iov = append(st.iov, f.local.buf[o:o+f.hdr.Length])
			}
		}
		st.bufs = st.iov
		_, err := st.bufs.WriteTo(st.c)
		clear(st.iov)
		st.bufs = nil
		return err
	}
	f := burst[0]
	f.hdr.encode(&st.hdrBuf)
	if _, err := st.c.Write(st.hdrBuf[:]); err != nil {
		return err
	}
	if st.bounce == nil {
		st.bounce = make([]byte, bounceSize)
	}
	for i := uint64(0); i < uint64(f.hdr.Count); i++ {
		src := f.local.mem.Addr + uintptr(f.off+i*f.stride)
		for done := uint64(0); done < f.hdr.Length; {
			k := min(f.hdr.Length-done, uint64(len(st.bounce)))
			chunk := st.bounce[:k]
			if f.localErr.Load() == nil {
				if err := deviceCopier.copyFromDevice(chunk, src+uintptr(done), f.local.mem.Device); err != nil {
					lerr := fmt.Errorf("tcp: copy %d bytes from cuda:%d at %#x: %w", k, f.local.mem.Device, src+uintptr(done), err)
					f.localErr.Store(&lerr)
				}
			}
			if f.localErr.Load() != nil {
				clear(chunk) // pad: keep the stream in sync, the frame fails
			}
			if _, err := st.c.Write(chunk); err != nil {
				return err
			}
			done += k
		}
	}
	return nil
}

// reader consumes acks, completes frames in order and watches for stalls.
func (st *stream) reader() {
	defer close(st.readerDone)
	timeout := st.seg.t.ackTimeout
	tick := min(timeout/2, time.Second)
	var hb [ackSize]byte
	msg := make([]byte, maxAckMsg)
	br := bufio.NewReaderSize(st.c, 16<<10) // acks arrive in bursts
	pr := payloadReader{c: st.c, raw: st.raw, br: br, timeout: timeout}
	readFull := func(p []byte) error {
		for n := 0; n < len(p); {
			st.c.SetReadDeadline(time.Now().Add(tick))
			k, err := br.Read(p[n:])
			n += k
			if err == nil {
				continue
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				st.mu.Lock()
				stalled := len(st.inflight) > 0 && time.Since(st.lastAck) > timeout
				dead := st.dead
				st.mu.Unlock()
				if dead {
					return net.ErrClosed
				}
				if stalled {
					return fmt.Errorf("no acknowledgement for %v with frames in flight", timeout)
				}
				continue
			}
			if errors.Is(err, io.EOF) && n > 0 {
				return io.ErrUnexpectedEOF
			}
			return err
		}
		return nil
	}
	for {
		if err := readFull(hb[:]); err != nil {
			st.kill(st.lost("read ack: %v", err))
			return
		}
		a, n, err := decodeAckHeader(hb[:])
		if err == nil && n > 0 {
			if err = readFull(msg[:n]); err == nil {
				a.Msg = string(msg[:n])
			}
		}
		if err != nil {
			st.kill(st.lost("read ack: %v", err))
			return
		}
		st.mu.Lock()
		if a.Status != ackFenced && (len(st.inflight) == 0 || (a.Status != ackProtocol && st.inflight[0].hdr.Seq != a.Seq)) {
			st.mu.Unlock()
			if a.Status == ackProtocol {
				st.kill(st.lost("receiver reported a protocol error: %s", a.Msg))
			} else {
				st.kill(st.lost("unexpected ack for frame %d (protocol out of sync)", a.Seq))
			}
			return
		}
		if a.Status == ackFenced {
			st.mu.Unlock()
			st.kill(fmt.Errorf("tcp: stream %d to %s: %w: %w: %s", st.idx, st.seg.addr, transport.ErrFenced, transport.ErrPeerLost, a.Msg))
			return
		}
		f := st.inflight[0]
		st.inflight[0] = nil
		st.inflight = st.inflight[1:]
		st.lastAck = time.Now()
		st.mu.Unlock()
		st.queued.Add(^(f.bytes - 1))
		if f.hdr.read() && a.Status == ackOK {
			// The answer's bytes follow the ack: land them, then finish
			// the frame (popped above, so only this goroutine finishes it).
			if err := st.readAnswer(&pr, f, a); err != nil {
				f.b.finish(0, err, false)
				st.kill(err)
				return
			}
		}
		f.b.finish(a.Bytes, st.ackErr(f, a), false)
		if a.Status == ackProtocol || a.Status == ackShutdown {
			st.kill(st.lost("receiver closed the stream: %s", a.Msg))
			return
		}
	}
}

// ackErr turns a refused ack into an error naming the request and wrapping
// the matching engine sentinel.
func (st *stream) ackErr(f *frame, a ack) error {
	if a.Status == ackOK {
		if p := f.localErr.Load(); p != nil {
			return *p
		}
		return nil
	}
	where := fmt.Sprintf("tcp: write to region %d at offset %d length %d x %d on %s refused", f.hdr.Region, f.hdr.Offset, f.hdr.Count, f.hdr.Length, st.seg.addr)
	switch f.hdr.Kind {
	case kindScatter:
		where = fmt.Sprintf("tcp: scatter frame of %d writes (%d bytes) on %s refused", f.hdr.Count, f.hdr.Length, st.seg.addr)
	case kindRead:
		where = fmt.Sprintf("tcp: read of region %d at offset %d length %d x %d on %s refused (nothing was read)", f.hdr.Region, f.hdr.Offset, f.hdr.Count, f.hdr.Length, st.seg.addr)
	case kindReadScatter:
		where = fmt.Sprintf("tcp: scatter frame of %d reads (%d bytes) on %s refused (nothing was read)", f.hdr.Count, f.hdr.Length, st.seg.addr)
	}
	var sentinel error
	switch a.Status {
	case ackUnknownRegion:
		sentinel = transport.ErrUnknownRegion
	case ackOutOfBounds:
		sentinel = transport.ErrOutOfBounds
	case ackShutdown, ackProtocol:
		sentinel = transport.ErrPeerLost
	default:
		return fmt.Errorf("%s: %s", where, a.Msg)
	}
	return fmt.Errorf("%s: %w: %s", where, sentinel, a.Msg)
}
