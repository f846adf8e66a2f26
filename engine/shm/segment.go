package shm

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// chunkBytes is the unit of work of a parallel copy and the granularity at
// which cancellation and peer loss are noticed inside a large request.
const chunkBytes = 1 << 20

// liveCheckMin is the batch size from which completion polls the receiver's
// pidfd once more before reporting BatchCompleted (one syscall, about 1 µs:
// under 1% of copying this much). Smaller batches rely on the watcher, which
// the kernel wakes when the receiver exits, so at most the batches finishing
// within that wake-up latency report completed, as an RDMA write acked just
// before the peer died would.
const liveCheckMin = 256 << 10

// watchInterval bounds how long a closed receiver transport (state word) goes
// unnoticed by an idle segment; a dead process is noticed at once via pidfd.
const watchInterval = 100 * time.Millisecond

type remoteRegion struct {
	mapping []byte // page-aligned mapping to unmap (nil for cma)
	data    []byte // exactly the region: Length bytes (nil for cma)
	// size is the region's usable length in bytes (0: refused at Submit);
	// base its address in the receiver (cma only).
	size uint64
	base uintptr

	// First contact (warm.go): lead is data's offset in mapping; warm holds
	// one bit per page of mapping: written through this mapping at least
	// once. fdMu guards
	// fd, the receiver's memfd kept open for that pwrite (-1 once every page
	// is warm or the segment is released); fileOff is the file offset of
	// data[0].
	lead    uint64
	warm    []atomic.Uint64
	fdMu    sync.RWMutex
	fd      int
	sfd     *sharedFD // fd's owner (nil: fd is this region's own)
	fileOff uint64
}

// fdKey names a receiver memfd by its file's device and inode (the
// receiver may name it by several descriptors).
type fdKey struct {
	dev, ino uint64
}

type segment struct {
	t        *shmTransport
	peer     endpoint
	pidfd    int // -1 when pidfd_open is unavailable (then liveness uses /proc start time)
	ctl      []byte
	ctlWord  []uint64
	regions  map[transport.RegionID]*remoteRegion
	fds      map[fdKey]*sharedFD // receiver memfds open here, by descriptor (mapRegion)
	wake     [2]int              // pipe that stops the watcher
	watchEnd chan struct{}

	peerLost atomic.Bool
	closing  atomic.Bool // Close: batches still copying end Failed/ErrClosed

	// slot is this segment's sender slot in the receiver's control memfd
	// (fence.go); slotIdx its index (-1 before it is claimed).
	slot    []uint64
	slotIdx int
	epoch   uint64

	mu      sync.Mutex // guards closed; Submit adds to batches under it
	closed  bool
	batches *transport.BatchTable[*batch]
	running sync.WaitGroup // copy goroutines and warmers in flight; Close waits before unmapping
	warmMu  sync.Mutex     // one warmer at a time (warm.go)
}

var (
	_ transport.Segment     = (*segment)(nil)
	_ transport.RegionAdder = (*segment)(nil)
)

type batch struct {
	read     bool // a read batch: copies from the receiver's regions into local memory
	state    atomic.Uint32
	done     atomic.Uint64 // bytes landed
	canceled atomic.Bool
	errMu    sync.Mutex
	err      error
	doneCh   chan struct{}
	total    uint64
}

// finish moves the batch to a terminal state once; later calls are no-ops.
func (b *batch) finish(st transport.BatchState, err error) {
	b.errMu.Lock()
	defer b.errMu.Unlock()
	if transport.BatchState(b.state.Load()).Terminal() {
		return
	}
	b.err = err
	b.state.Store(uint32(st)) // release: copies and err happen before
	close(b.doneCh)
}

// Done is closed when the batch is terminal (transport.TableBatch).
func (b *batch) Done() <-chan struct{} { return b.doneCh }

// Terminal reports whether the state is terminal (transport.TableBatch).
func (b *batch) Terminal() bool { return transport.BatchState(b.state.Load()).Terminal() }

// Status returns the batch's status, Err only once terminal (transport.TableBatch).
func (b *batch) Status() transport.BatchStatus {
	st := transport.BatchState(b.state.Load()) // acquire
	s := transport.BatchStatus{State: st, BytesDone: b.done.Load()}
	if st.Terminal() {
		b.errMu.Lock()
		s.Err = b.err
		b.errMu.Unlock()
	}
	return s
}

// OpenSegment maps the receiver's regions named in info. Errors wrap
// transport.ErrUnavailable when the receiver is on another host (different boot
// id) or its memory cannot be reached from here (other pid namespace, other
// user, process gone), so automatic selection can fall back to tcp.
func (t *shmTransport) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%s: open segment: %w", t.Name(), err)
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("%s: open segment: transport %w", t.Name(), transport.ErrClosed)
	}
	ep, err := decodeEndpoint(info.Endpoint, t.cma)
	if err != nil {
		return nil, err
	}
	if ep.BootID != t.self.BootID {
		return nil, fmt.Errorf("%s: peer is on another host (boot id %s, ours %s); use tcp or rdma: %w", t.Name(), fmtBootID(ep.BootID), fmtBootID(t.self.BootID), transport.ErrUnavailable)
	}
	s := &segment{t: t, peer: ep, pidfd: -1, regions: map[transport.RegionID]*remoteRegion{}, slotIdx: -1, epoch: info.Epoch,
		batches: transport.NewBatchTable[*batch](t.Name()), wake: [2]int{-1, -1}, watchEnd: make(chan struct{})}
	ok := false
	defer func() {
		if !ok {
			s.release()
		}
	}()
	pid := int(ep.PID)
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		s.pidfd = fd
	} else if !errors.Is(err, unix.ENOSYS) {
		return nil, fmt.Errorf("%s: receiver pid %d: pidfd_open: %v (%s): %w", t.Name(), pid, err, openHint(err, "process gone, or in another pid namespace"), transport.ErrUnavailable)
	}
	// The pidfd now pins the process the pid names; check it is the receiver.
	if st, err := procStartTime(pid); err != nil || st != ep.StartTime {
		return nil, fmt.Errorf("%s: receiver pid %d is not the process that published the endpoint (start time %d, want %d; err %v): %w", t.Name(), pid, st, ep.StartTime, err, transport.ErrUnavailable)
	}
	ctl, err := mapPeerFD(pid, int(ep.CtlFD), ep.CtlDev, ep.CtlIno, 0, ctlBytes, false)
	if err != nil {
		return nil, fmt.Errorf("%s: map receiver control memfd: %v: %w", t.Name(), err, transport.ErrUnavailable)
	}
	s.ctl = ctl.mapping
	s.ctlWord = unsafe.Slice((*uint64)(unsafe.Pointer(&ctl.data[0])), ctlWords)
	if atomic.LoadUint64(&s.ctlWord[ctlState]) != stateOpen {
		return nil, fmt.Errorf("%s: receiver pid %d has closed its transport: %w", t.Name(), pid, transport.ErrPeerLost)
	}
	if t.cma {
		if err := s.checkAttach(); err != nil {
			return nil, err
		}
	}
	// Claim a sender slot (our epoch published in it), then check the
	// receiver admitted the epoch: a fence that withdrew it either is seen
	// here or sees our slot (fence.go).
	idx, err := claimSlot(s.ctlWord, uint64(os.Getpid()), t.self.StartTime, info.Epoch)
	if err != nil {
		return nil, fmt.Errorf("%s: open segment to receiver pid %d: %v: %w", t.Name(), pid, err, transport.ErrUnavailable)
	}
	s.slotIdx, s.slot = idx, slotWords(s.ctlWord, idx)
	if info.Epoch != 0 && !admitted(s.ctlWord, info.Epoch) {
		return nil, fmt.Errorf("%s: open segment to receiver pid %d: epoch %d is not admitted there: it was fenced (the decode gave up on that data path) or never registered; the decode registers again with a new epoch: %w: %w",
			t.Name(), pid, info.Epoch, transport.ErrFenced, transport.ErrPeerLost)
	}
	for _, d := range info.Regions {
		if _, dup := s.regions[d.ID]; dup {
			return nil, fmt.Errorf("%s: segment info lists region %d twice", t.Name(), d.ID)
		}
		r, err := s.mapRegion(d)
		if err != nil {
			return nil, err
		}
		s.regions[d.ID] = r
	}
	if err := unix.Pipe2(s.wake[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("%s: open segment: pipe: %w", t.Name(), err)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil, fmt.Errorf("%s: open segment: transport %w", t.Name(), transport.ErrClosed)
	}
	t.segments[s] = struct{}{}
	t.mu.Unlock()
	ok = true
	go s.watch()
	fresh := make([]*remoteRegion, 0, len(s.regions))
	for _, r := range s.regions {
		fresh = append(fresh, r)
	}
	s.mu.Lock()
	s.startWarmer(fresh)
	s.mu.Unlock()
	return s, nil
}

// mapRegion maps one receiver region named in a descriptor. A region the
// receiver does not hold (or holds elsewhere) gets an empty entry, refused at
// Submit; a longer claim is cut to the true length.
func (s *segment) mapRegion(d transport.RegionDesc) (*remoteRegion, error) {
	if d.Kind != transport.MemoryHost {
		return nil, fmt.Errorf("%s: region %d is %s memory: %w", s.t.Name(), d.ID, d.Kind, transport.ErrUnsupportedMemory)
	}
	if s.t.cma {
		return s.cmaRegion(d)
	}
	k, err := decodeKey(d.Key)
	if err != nil {
		return nil, fmt.Errorf("%s: region %d: %w", s.t.Name(), d.ID, err)
	}
	if d.Length == 0 || d.Length > 1<<46 {
		return nil, fmt.Errorf("%s: region %d: length %d bytes out of range", s.t.Name(), d.ID, d.Length)
	}
	// Trust the receiver's control slot over the advertised descriptor.
	if int(d.ID) >= MaxRegions {
		return &remoteRegion{fd: -1}, nil
	}
	trueLen := atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(d.ID)])
	trueOff := atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(d.ID)+1])
	if trueLen == 0 || trueOff != k.Offset {
		return &remoteRegion{fd: -1}, nil
	}
	length := min(d.Length, trueLen)
	// Regions of one receiver memfd share one descriptor (sharedFD).
	key := fdKey{dev: k.Dev, ino: k.Ino}
	sf := s.fds[key]
	if sf == nil || !sf.acquire() {
		var err error
		if sf, err = openPeerFD(int(s.peer.PID), int(k.FD), k.Dev, k.Ino); err != nil {
			return nil, fmt.Errorf("shm: map receiver region %d (%d bytes): %v: %w", d.ID, d.Length, err, transport.ErrUnavailable)
		}
		if s.fds == nil {
			s.fds = map[fdKey]*sharedFD{}
		}
		s.fds[key] = sf
	}
	defer sf.release() // the lookup's reference; the region holds its own
	r, err := mapShared(sf, k.Offset, length, true)
	if err != nil {
		return nil, fmt.Errorf("%s: map receiver region %d (%d bytes): %v: %w", s.t.Name(), d.ID, d.Length, err, transport.ErrUnavailable)
	}
	return r, nil
}

// AddRegions maps receiver regions registered after the segment was opened
// (transport.RegionAdder). Regions already in the table (mapped or refused)
// are kept as they are. Errors: a closed segment, a region that cannot be
// mapped (nothing is added then).
func (s *segment) AddRegions(regions []transport.RegionDesc) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("%s: add regions: segment %w", s.t.Name(), transport.ErrClosed)
	}
	added := map[transport.RegionID]*remoteRegion{}
	for _, d := range regions {
		if _, ok := s.regions[d.ID]; ok {
			continue
		}
		if _, ok := added[d.ID]; ok {
			continue
		}
		r, err := s.mapRegion(d)
		if err != nil {
			for _, a := range added {
				a.closeFD()
				if a.mapping != nil {
					unix.Munmap(a.mapping)
				}
			}
			return err
		}
		added[d.ID] = r
	}
	fresh := make([]*remoteRegion, 0, len(added))
	for id, r := range added {
		s.regions[id] = r
		fresh = append(fresh, r)
	}
	s.startWarmer(fresh)
	return nil
}

// openHint explains a failed open of a peer's descriptor: running out of
// descriptors (EMFILE: this process's RLIMIT_NOFILE; ENFILE: the system's)
// says so with the limit and what to raise, since the peer is fine then;
// other errors get otherwise (what the failure usually means).
func openHint(err error, otherwise string) string {
	switch {
	case errors.Is(err, unix.EMFILE):
		var rl unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
		return fmt.Sprintf("EMFILE: this process has no file descriptor left, its RLIMIT_NOFILE soft limit is %d (hard %d); raise it (ulimit -n, LimitNOFILE= in a systemd unit, --ulimit nofile= for a container): the receiver is not at fault", rl.Cur, rl.Max)
	case errors.Is(err, unix.ENFILE):
		return "ENFILE: the system has no file descriptor left (fs.file-max); the receiver is not at fault"
	}
	return otherwise
}

// mapPeerFD opens /proc/PID/fd/FD, checks it is the advertised file, and maps
// exactly length bytes from offset. With keepFD the region keeps the
// descriptor for pwrite into the pages its mapping has not written yet.
func mapPeerFD(pid, fd int, dev, ino, offset, length uint64, keepFD bool) (*remoteRegion, error) {
	sf, err := openPeerFD(pid, fd, dev, ino)
	if err != nil {
		return nil, err
	}
	defer sf.release() // the region holds its own reference when it keeps the descriptor
	return mapShared(sf, offset, length, keepFD)
}

// sharedFD is one receiver memfd opened from /proc/PID/fd, shared by every
// region of a segment that lies in it (a receiver's KV buffers are often
// regions of one kvx_alloc_host memfd): one descriptor per memfd instead of
// one per region (10,000 regions used to run the process out of
// descriptors). Each region keeping it for pwrite holds a reference; the
// last release closes it.
type sharedFD struct {
	path string
	mu   sync.Mutex
	fd   int // -1 once closed
	refs int
}

// openPeerFD opens /proc/PID/fd/FD and checks it is the advertised file;
// the caller holds one reference.
func openPeerFD(pid, fd int, dev, ino uint64) (*sharedFD, error) {
	path := "/proc/" + strconv.Itoa(pid) + "/fd/" + strconv.Itoa(fd)
	f, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w (%s)", path, err, openHint(err, "receiver gone, other user, or other pid namespace"))
	}
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil {
		unix.Close(f)
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if uint64(st.Dev) != dev || st.Ino != ino {
		unix.Close(f)
		return nil, fmt.Errorf("%s is inode %d:%d, the receiver advertised %d:%d (descriptor reused or wrong peer)", path, st.Dev, st.Ino, dev, ino)
	}
	return &sharedFD{path: path, fd: f, refs: 1}, nil
}

// acquire takes a reference; false when the descriptor is already closed.
func (sf *sharedFD) acquire() bool {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if sf.fd < 0 {
		return false
	}
	sf.refs++
	return true
}

// release drops a reference, closing the descriptor with the last one.
func (sf *sharedFD) release() {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if sf.refs--; sf.refs == 0 && sf.fd >= 0 {
		unix.Close(sf.fd)
		sf.fd = -1
	}
}

// mapShared maps exactly length bytes from offset of sf's file; with keepFD
// the region takes a reference to sf for pwrite (released by closeFD).
func mapShared(sf *sharedFD, offset, length uint64, keepFD bool) (*remoteRegion, error) {
	path, f := sf.path, sf.fd
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil {
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if offset+length < offset || st.Size < 0 || offset+length > uint64(st.Size) {
		return nil, fmt.Errorf("%s is %d bytes, too small for offset %d + length %d", path, st.Size, offset, length)
	}
	pg := uint64(os.Getpagesize())
	start := offset / pg * pg
	span := offset - start + length
	if span > uint64(int(^uint(0)>>1)) {
		return nil, fmt.Errorf("region of %d bytes does not fit the address space", length)
	}
	m, err := unix.Mmap(f, int64(start), int(span), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		hint := ""
		if errors.Is(err, unix.ENOMEM) {
			hint = " (out of address space or of mappings: vm.max_map_count)"
		}
		return nil, fmt.Errorf("mmap %s (%d bytes at %d): %w%s", path, span, start, err, hint)
	}
	// Map the receiver's pages now (they are resident on its side when it
	// prefaulted them), so the first batch does not fault once per 4 KiB
	// in this process. Best effort: without it the copies fault them in.
	// On a VM this is not enough (warm.go): the warmer and put finish it.
	_ = unix.Madvise(m, unix.MADV_POPULATE_WRITE)
	r := &remoteRegion{mapping: m, data: m[offset-start : offset-start+length : offset-start+length], size: length, fd: -1, fileOff: offset, lead: offset - start}
	if keepFD && sf.acquire() {
		words := ((span+pg-1)/pg + 63) / 64 // one bit per page of the mapping
		r.warm = make([]atomic.Uint64, words)
		r.fd, r.sfd = f, sf
	}
	return r, nil
}

// alive reports whether the receiver process is still running and its
// transport open. It is a non-blocking check.
func (s *segment) alive() bool {
	if s.peerLost.Load() {
		return false
	}
	if atomic.LoadUint64(&s.ctlWord[ctlState]) != stateOpen {
		return false
	}
	if s.pidfd >= 0 {
		fds := []unix.PollFd{{Fd: int32(s.pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		return err != nil || n == 0 // EINTR counts as alive; the watcher retries
	}
	st, err := procStartTime(int(s.peer.PID))
	return err == nil && st == s.peer.StartTime
}

// watch fails pending batches when the receiver dies or closes.
func (s *segment) watch() {
	defer close(s.watchEnd)
	fds := []unix.PollFd{{Fd: int32(s.wake[0]), Events: unix.POLLIN}}
	if s.pidfd >= 0 {
		fds = append(fds, unix.PollFd{Fd: int32(s.pidfd), Events: unix.POLLIN})
	}
	for {
		_, err := unix.Poll(fds, int(watchInterval/time.Millisecond))
		if err != nil && !errors.Is(err, unix.EINTR) {
			s.lose(fmt.Errorf("%s: watching receiver pid %d: poll: %v: %w", s.t.Name(), s.peer.PID, err, transport.ErrPeerLost))
			return
		}
		if fds[0].Revents != 0 {
			return // Close
		}
		if !s.alive() {
			s.lose(fmt.Errorf("%s: receiver pid %d exited or closed its transport: %w", s.t.Name(), s.peer.PID, transport.ErrPeerLost))
			return
		}
	}
}

// lose marks the peer lost: every pending batch stops at its next copy
// unit and fails (copyAll finishes it, so a terminal batch never copies any
// more), wrapping transport.ErrPeerLost.
// lostPeer is the error of a batch whose peer process is gone (what: how
// and when), wrapping transport.ErrPeerLost. It names the peer for the
// operation, since a READ's "receiver" is the process this one copies
// from, not this one, and says what to do.
func (s *segment) lostPeer(read bool, what string) error {
	if read {
		return fmt.Errorf("%s: the peer process (pid %d) whose memory this READ copies from %s; this process is fine, the peer's registered memory went with it: open the segment again once the peer runs again (a restarted peer publishes a new endpoint): %w",
			s.t.Name(), s.peer.PID, what, transport.ErrPeerLost)
	}
	return fmt.Errorf("%s: the receiver process (pid %d) this WRITE copies into %s: open the segment again once the receiver runs again (a restarted receiver publishes a new endpoint): %w",
		s.t.Name(), s.peer.PID, what, transport.ErrPeerLost)
}

func (s *segment) lose(err error) {
	s.peerLost.Store(true)
	s.mu.Lock()
	pend := s.batches.All()
	s.mu.Unlock()
	for _, b := range pend {
		b.canceled.Store(true)
	}
}

func (s *segment) HandshakeReply() []byte { return nil }

// piece is one contiguous copy, or n > 1 blocks of blk bytes at strides
// dstStride and srcStride (a strided request's blocks, up to one unit: one
// piece, not one per block, so a head-sliced room of 1 KiB token rows does
// not allocate and scan a piece per row; shm only). dst and src then span
// every block. A write into a receiver region names the region (rr) and
// dst's byte offset in it (off), so put can tell whether dst is warm; a
// read (dst local, src the receiver's mapping) or a test leaves rr nil.
//
// A cma piece names local memory (local) and the receiver's address
// (raddr) instead; the batch's op gives the direction.
type piece struct {
	dst []byte
	src []byte
	rr  *remoteRegion
	off uint64
	// n, blk, dstStride, srcStride: the blocks of a strided piece (n <= 1:
	// dst and src are one copy).
	n, blk, dstStride, srcStride uint64

	local []byte
	raddr uintptr
}

// unit is a run of pieces [start, end) into one remote region, at most
// about 1 MiB: the granularity at which copies check for a fence, a
// deregistered region, cancellation and peer loss (fence.go).
type unit struct {
	start, end int
	region     transport.RegionID
	bytes      uint64
}

// Submit validates every request, then copies: a write batch from local
// memory into the receiver's regions, a read batch (transport.OpRead) from
// the receiver's regions into local memory, both through the same mapping
// and the same fence units (enter/leave: a fenced epoch or a deregistered
// region stops a read as it stops a write, and FenceEpoch waits for a read
// unit in progress). Batches smaller than the transport's parallel
// threshold are copied before Submit returns; larger ones are split into
// 1 MiB chunks copied by several goroutines.
func (s *segment) Submit(ctx context.Context, tb *transport.TransferBatch) (transport.BatchID, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("%s: submit: %w", s.t.Name(), err)
	}
	if tb == nil {
		return 0, fmt.Errorf("%s: submit: nil batch", s.t.Name())
	}
	if err := transport.CheckBatch(s.t.Name(), s.t.Capabilities(), tb); err != nil {
		return 0, err
	}
	read := tb.Op == transport.OpRead
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("%s: submit: segment %w", s.t.Name(), transport.ErrClosed)
	}
	// Cheap check here (no syscall); the pidfd is polled when the batch
	// completes and by the watcher.
	if s.peerLost.Load() || atomic.LoadUint64(&s.ctlWord[ctlState]) != stateOpen {
		return 0, fmt.Errorf("submit: %w", s.lostPeer(read, "exited or closed its transport"))
	}
	if atomic.LoadUint64(&s.slot[sFenced]) != 0 {
		return 0, fmt.Errorf("%s: submit: receiver pid %d fenced this segment (epoch %d): %w: %w", s.t.Name(), s.peer.PID, s.epoch, transport.ErrFenced, transport.ErrPeerLost)
	}
	// Size the piece slice once, to what the loop below appends: a strided
	// request of blocks smaller than a unit is packed, at most one piece
	// per unit it fills plus two (the ends; so a batch of strided 1 KiB head slices,
	// hundreds of thousands of blocks, allocates and clears a few thousand
	// pieces, not one per block: that was 15 % of SGLang's per-token
	// batch); any other request takes one piece per block and unit.
	np := 0
	ub := max(s.t.unitBytes, 1)
	for _, r := range tb.Requests {
		if n := r.Blocks(); !s.t.cma && n > 1 && r.Length < ub {
			np += int(min(n*r.Length/ub+2, 1<<32))
			continue
		}
		np += int(min(r.Blocks(), 1<<32) * max((r.Length+ub-1)/ub, 1))
	}
	pieces := make([]piece, 0, min(np, 1<<24))
	var units []unit
	var total uint64
	var tail *tailPiece // LastAfterAll: the last request, copied after every unit
	for i, r := range tb.Requests {
		rr, ok := s.regions[r.Remote]
		var live uint64
		if ok && rr.size > 0 {
			live = atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(r.Remote)]) // acquire
		}
		if live == 0 {
			return 0, fmt.Errorf("%s: request %d: remote region %d: %w (not in this segment's region table, or not registered on the receiver)", s.t.Name(), i, r.Remote, transport.ErrUnknownRegion)
		}
		limit := min(rr.size, live)
		n := r.Blocks()
		if r.Length == 0 {
			continue
		}
		// Last block's end, with overflow checks, for both sides.
		rEnd, ok1 := spanEnd(r.RemoteOffset, r.RemoteStride, r.Length, n)
		if !ok1 || rEnd > limit {
			return 0, fmt.Errorf("%s: request %d: %s of %d×%d bytes at offset %d stride %d of region %d (%d bytes registered): %w", s.t.Name(), i, tb.Op, n, r.Length, r.RemoteOffset, r.RemoteStride, r.Remote, limit, transport.ErrOutOfBounds)
		}
		lEnd, ok2 := spanEnd(uint64(r.Local), r.LocalStride, r.Length, n)
		if !ok2 || !s.t.localRange(r.Local, lEnd-uint64(r.Local)) {
			return 0, fmt.Errorf("%s: request %d: local range %#x + %d×%d bytes (stride %d) is not inside a region registered with this transport: %w", s.t.Name(), i, r.Local, n, r.Length, r.LocalStride, transport.ErrOutOfBounds)
		}
		if tb.LastAfterAll && i == len(tb.Requests)-1 { // 8 bytes (CheckBatch)
			tail = &tailPiece{region: r.Remote}
			if s.t.cma {
				tail.p = piece{local: hostBytes(r.Local, r.Length), raddr: rr.base + uintptr(r.RemoteOffset)}
			} else {
				tail.p = piece{dst: rr.data[r.RemoteOffset : r.RemoteOffset+r.Length], src: hostBytes(r.Local, r.Length), rr: rr, off: r.RemoteOffset}
			}
			total += r.Length
			continue
		}
		if ub := s.t.unitBytes; !s.t.cma && n > 1 && r.Length < ub {
			// Blocks smaller than a unit: as many per piece as the unit holds.
			for j := uint64(0); j < n; {
				k := len(units) - 1
				if k < 0 || units[k].region != r.Remote || units[k].bytes+r.Length > ub {
					units = append(units, unit{start: len(pieces), end: len(pieces), region: r.Remote})
					k++
				}
				cnt := min(n-j, (ub-units[k].bytes)/r.Length)
				src := uintptr(uint64(r.Local) + j*r.LocalStride)
				off := r.RemoteOffset + j*r.RemoteStride
				rspan, lspan := (cnt-1)*r.RemoteStride+r.Length, (cnt-1)*r.LocalStride+r.Length
				if read {
					pieces = append(pieces, piece{dst: hostBytes(src, lspan), src: rr.data[off : off+rspan], n: cnt, blk: r.Length, dstStride: r.LocalStride, srcStride: r.RemoteStride})
				} else {
					pieces = append(pieces, piece{dst: rr.data[off : off+rspan], src: hostBytes(src, lspan), rr: rr, off: off, n: cnt, blk: r.Length, dstStride: r.RemoteStride, srcStride: r.LocalStride})
				}
				units[k].end++
				units[k].bytes += cnt * r.Length
				j += cnt
			}
			total += n * r.Length
			continue
		}
		for j := uint64(0); j < n; j++ {
			src := uintptr(uint64(r.Local) + j*r.LocalStride)
			off := r.RemoteOffset + j*r.RemoteStride
			ub := s.t.unitBytes
			for c := uint64(0); c < r.Length; c += ub {
				m := min(ub, r.Length-c)
				if k := len(units) - 1; k < 0 || units[k].region != r.Remote || units[k].bytes+m > ub {
					units = append(units, unit{start: len(pieces), end: len(pieces), region: r.Remote})
				}
				if s.t.cma {
					pieces = append(pieces, piece{local: hostBytes(src+uintptr(c), m), raddr: rr.base + uintptr(off+c)})
				} else if read {
					pieces = append(pieces, piece{dst: hostBytes(src+uintptr(c), m), src: rr.data[off+c : off+c+m]})
				} else {
					pieces = append(pieces, piece{dst: rr.data[off+c : off+c+m], src: hostBytes(src+uintptr(c), m), rr: rr, off: off + c})
				}
				units[len(units)-1].end++
				units[len(units)-1].bytes += m
			}
		}
		total += n * r.Length
	}
	b := &batch{doneCh: make(chan struct{}), total: total, read: read}
	id := s.batches.Add(b)
	s.running.Add(1)
	if workers, yield := s.t.copyPlan(total, len(units)); workers == 0 {
		// Small batch: copy on the caller's goroutine (outside the lock).
		s.mu.Unlock()
		s.copyAll(b, pieces, units, 1, tail, yield)
		s.mu.Lock() // for the deferred unlock
	} else {
		go s.copyAll(b, pieces, units, workers, tail, yield)
	}
	return id, nil
}

// inlineYieldMin is the batch size from which a batch copied on the
// caller's goroutine yields the processor between its units (copyAll).
// Below it the copy ends within about a millisecond (8 MiB at 8 GB/s),
// well inside the scheduler's own 10 ms preemption period, and a yield
// costs more than it gives: a batch submitted from C (capi, Python) runs
// on a goroutine locked to the caller's thread, so each yield that finds
// the other Ps busy hands this thread's P over and sleeps the thread
// (stoplockedm/startlockedm). Measured on vLLM's sender pool shape, ten
// Python threads × 4 MiB per sync call (bench/RESULTS.md, issue 27).
const inlineYieldMin = 8 << 20

// copyPlan decides how Submit copies a batch of total bytes in units
// copy units: workers 0 on the caller's goroutine before Submit returns,
// else on that many goroutines of their own; yield: between units, as
// copyAll's comment explains (always for goroutines of their own, which
// hold Ps a control loop may need; for the caller's only from
// inlineYieldMin).
func (t *shmTransport) copyPlan(total uint64, units int) (workers int, yield bool) {
	if total < t.parallelMin || t.copyThreads <= 1 || units < 2 {
		return 0, total >= inlineYieldMin
	}
	return min(t.copyThreads, units), true
}

// spanEnd returns base + (n-1)*stride + length, and false on overflow.
func spanEnd(base, stride, length, n uint64) (uint64, bool) {
	hi, lo := bits.Mul64(n-1, stride)
	if hi != 0 {
		return 0, false
	}
	e, c1 := bits.Add64(base, lo, 0)
	e, c2 := bits.Add64(e, length, 0)
	return e, c1 == 0 && c2 == 0
}

// hostBytes views n bytes of host memory at addr (inside a registered region,
// checked by the caller).
func hostBytes(addr uintptr, n uint64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// tailPiece is a LastAfterAll batch's last request (an 8-byte commit word
// into region), copied by copyAll once every unit was copied.
type tailPiece struct {
	p      piece
	region transport.RegionID
}

// putTail writes the tail: one atomic 8-byte store into the receiver's
// mapping when it is aligned there (a release store: every copy of the
// batch, joined before it, is visible to a reader that loads the word and
// sees it; on amd64 a locked exchange), else a plain copy after them
// (aligned remote offsets of page-aligned mappings always are aligned).
func putTail(p piece) {
	if len(p.dst) == 8 && uintptr(unsafe.Pointer(&p.dst[0]))%8 == 0 {
		atomic.StoreUint64((*uint64)(unsafe.Pointer(&p.dst[0])), binary.NativeEndian.Uint64(p.src))
		if r := p.rr; r != nil && r.warm != nil {
			pg := uint64(os.Getpagesize())
			setBits(r.warm, (r.lead+p.off)/pg, (r.lead+p.off)/pg)
		}
		return
	}
	p.put(false)
}

// copyAll copies the units with workers goroutines and finishes the batch:
// it is the only place a batch turns terminal, after its last copy ended,
// so a terminal batch never writes again (into the receiver's memory, or
// for a read into local memory). A LastAfterAll batch's tail is copied
// after every unit, by this goroutine, once the workers ended and nothing
// stopped the batch (a stopped batch never writes its commit word). It
// owns one count of s.running. yield: the workers yield between units
// (copyPlan).
func (s *segment) copyAll(b *batch, pieces []piece, units []unit, workers int, tail *tailPiece, yield bool) {
	defer s.running.Done()
	if s.t.cma && !s.alive() {
		// process_vm_writev names the receiver by pid: never write
		// through a pid whose process has exited (see the cma notes).
		s.lose(fmt.Errorf("cma: receiver pid %d exited: %w", s.peer.PID, transport.ErrPeerLost))
	}
	// A large write batch copies with non-temporal stores (streamMin);
	// each put that used them ends with SFENCE, before the worker counts
	// the unit done, so the tail and the committed counter below are
	// stored after every page is globally visible.
	stream := !b.read && s.t.streamMin > 0 && b.total >= s.t.streamMin
	var next atomic.Int64
	var stopMu sync.Mutex
	var stopErr error // a fence or a deregistered region stopped the batch
	stopped := func() bool { stopMu.Lock(); defer stopMu.Unlock(); return stopErr != nil }
	work := func() {
		var sc *iovScratch
		if s.t.cma {
			sc = iovPool.Get().(*iovScratch) // 32 KiB: allocating it per batch dominated 4 KiB batches
			defer iovPool.Put(sc)
		}
		for {
			i := next.Add(1) - 1
			if i >= int64(len(units)) || b.canceled.Load() || s.peerLost.Load() || stopped() {
				return
			}
			u := units[i]
			ph, err := s.enter(u.region)
			if err != nil {
				stopMu.Lock()
				if stopErr == nil {
					stopErr = err
				}
				stopMu.Unlock()
				return
			}
			if sc != nil {
				err = s.vmCopy(pieces[u.start:u.end], b.read, sc)
			} else {
				for _, p := range pieces[u.start:u.end] {
					p.put(stream)
				}
			}
			s.leave(ph)
			if err != nil {
				stopMu.Lock()
				if stopErr == nil {
					stopErr = err
				}
				stopMu.Unlock()
				return
			}
			b.done.Add(u.bytes)
			// Yield once per unit (at most 1 MiB), outside the fence
			// count. The copy is runtime.memmove, which the Go
			// scheduler cannot preempt, and a loop of them has no
			// other preemption point: without the yield, copy
			// goroutines as many as GOMAXPROCS hold every P for the
			// whole batch (tens of seconds for a GiB on a loaded host,
			// with page faults on the peer's mapping), starving the
			// process's control loop, heartbeats and timers until
			// peers declare it hung. One yield per MiB costs well
			// under 1 %. After the last unit the loop ends anyway: no
			// yield (for a small batch copied on a cgo caller's locked
			// goroutine a yield is a P handoff between two threads), nor
			// between the units of a batch under inlineYieldMin copied
			// on the caller's goroutine (copyPlan).
			if yield && next.Load() < int64(len(units)) {
				runtime.Gosched()
			}
		}
	}
	if workers <= 1 {
		work()
	} else {
		var wg sync.WaitGroup
		for w := 1; w < workers; w++ {
			wg.Add(1)
			go func() { defer wg.Done(); work() }()
		}
		work()
		wg.Wait()
	}
	if tail != nil && next.Load() >= int64(len(units)) && !stopped() && !b.canceled.Load() && !s.peerLost.Load() && !s.closing.Load() {
		// Every unit was copied (next ran past the last one and nothing
		// stopped a worker): the commit word goes last.
		if err := s.copyTail(tail); err != nil {
			stopErr = err
		} else {
			b.done.Add(uint64(len(tail.p.dst) + len(tail.p.local)))
		}
	}
	switch {
	case s.closing.Load():
		b.finish(transport.BatchFailed, fmt.Errorf("%s: segment closed with the batch pending (%d of %d bytes copied): %w", s.t.Name(), b.done.Load(), b.total, transport.ErrClosed))
	case stopErr != nil:
		b.finish(transport.BatchFailed, fmt.Errorf("%w (%d of %d bytes copied)", stopErr, b.done.Load(), b.total))
	case b.canceled.Load() && !s.peerLost.Load():
		b.finish(transport.BatchCanceled, fmt.Errorf("%s: batch stopped after %d of %d bytes: %w", s.t.Name(), b.done.Load(), b.total, transport.ErrCanceled))
	case (b.total >= liveCheckMin && !s.alive()) || s.peerLost.Load():
		b.finish(transport.BatchFailed, s.lostPeer(b.read, fmt.Sprintf("exited or closed its transport during the batch (%d of %d bytes copied)", b.done.Load(), b.total)))
	default:
		if !b.read {
			atomic.AddUint64(&s.ctlWord[ctlCommitted], b.total) // release: publish to the receiver
		}
		b.finish(transport.BatchCompleted, nil)
	}
}

// copyTail copies a LastAfterAll batch's tail inside its own fence unit:
// a fence or a deregistered ring stops it as it stops any copy.
func (s *segment) copyTail(t *tailPiece) error {
	ph, err := s.enter(t.region)
	if err != nil {
		return err
	}
	defer s.leave(ph)
	if s.t.cma {
		sc := iovPool.Get().(*iovScratch)
		defer iovPool.Put(sc)
		return s.vmCopy([]piece{t.p}, false, sc)
	}
	putTail(t.p)
	return nil
}

// Poll returns the batch's state without blocking.
func (s *segment) Poll(id transport.BatchID) (transport.BatchStatus, error) {
	return s.batches.Poll(id)
}

// Wait blocks until the batch is terminal or ctx ends (then it returns the
// current status and ctx's error).
func (s *segment) Wait(ctx context.Context, id transport.BatchID) (transport.BatchStatus, error) {
	return s.batches.Wait(ctx, id)
}

// Cancel stops a pending batch at the next 1 MiB chunk boundary.
func (s *segment) Cancel(id transport.BatchID) error {
	b, err := s.batches.Get(id)
	if err != nil {
		return err
	}
	b.canceled.Store(true)
	return nil
}

// Release forgets a terminal batch (a pending one is kept).
func (s *segment) Release(id transport.BatchID) {
	s.batches.Release(id)
}

// Close fails pending batches with transport.ErrClosed, waits for copies in
// flight to stop, gives its sender slot back and unmaps the receiver's
// regions. Idempotent.
func (s *segment) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.closing.Store(true)
	pend := s.batches.All()
	s.mu.Unlock()
	for _, b := range pend {
		b.canceled.Store(true) // copyAll stops at the next unit and fails it with ErrClosed
	}
	s.running.Wait()
	unix.Write(s.wake[1], []byte{1})
	<-s.watchEnd
	s.t.mu.Lock()
	delete(s.t.segments, s)
	s.t.mu.Unlock()
	return s.release()
}

// release unmaps and closes everything the segment holds.
func (s *segment) release() error {
	var errs []error
	for id, r := range s.regions {
		r.closeFD()
		if r.mapping == nil {
			continue
		}
		if err := unix.Munmap(r.mapping); err != nil {
			errs = append(errs, fmt.Errorf("%s: unmap region %d: %w", s.t.Name(), id, err))
		}
	}
	s.regions = nil
	if s.slot != nil {
		releaseSlot(s.ctlWord, s.slotIdx) // no copy of this segment runs any more
		s.slot, s.slotIdx = nil, -1
	}
	if s.ctl != nil {
		unix.Munmap(s.ctl)
		s.ctl, s.ctlWord = nil, nil
	}
	for _, fd := range []int{s.pidfd, s.wake[0], s.wake[1]} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	s.pidfd, s.wake = -1, [2]int{-1, -1}
	return errors.Join(errs...)
}
