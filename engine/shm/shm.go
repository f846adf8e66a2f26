// Package shm is kvxfer's same-host shared-memory transport, registered with
// the engine as "shm" (priority 200: preferred over tcp, below rdma). It also
// registers "cma" (priority 150, cma.go): the same control memfd, fencing
// and batches, with cross-memory attach (process_vm_writev/readv) as the
// data path, for host memory that has no memfd (a caller's own buffers).
//
// # How memory is shared
//
// The receiver registers memfd-backed memory (transport.AllocHost). It keeps a
// duplicate of each region's memfd open and describes it in RegionDesc.Key
// (fd number, offset, st_dev/st_ino; see wire.go). Its endpoint blob carries
// the host's boot id, its pid and start time, and the fd of a small control
// memfd. The sender checks the boot id (a different host is
// transport.ErrUnavailable, so automatic selection falls back to tcp), pins the
// receiver with pidfd_open, opens /proc/PID/fd/N for the control memfd and for
// every region, checks that each opened file has the advertised st_dev/st_ino,
// and maps exactly the region's bytes MAP_SHARED. A one-sided WRITE is then a
// memcpy from the sender's registered memory into that mapping, and a
// one-sided READ (transport.OpRead, CapRead) a memcpy from the mapping into
// the sender's registered memory, with the same bounds, fence units and
// peer-loss checks; large batches are split into chunks copied by several
// goroutines. A batch with TransferBatch.LastAfterAll (CapOrderedLast)
// copies its last write, an 8-byte commit word, after every other copy of
// the batch ended, with one atomic store (a release store), inside its own
// fence unit, and not at all when the batch was stopped first.
//
// /proc/PID/fd/N was chosen over pidfd_getfd (needs ptrace attach rights, which
// Yama's ptrace_scope=1 denies between sibling processes) and over an
// SCM_RIGHTS hand-off (needs a second socket next to the engine's control
// channel): it needs only the same user (or root), works from Linux 2.6, and the
// inode check makes pid or fd reuse harmless.
//
// # Bounds
//
// Each mapping covers exactly one region. Submit checks every block of every
// request against the mapped region length and the sender's own registered
// regions before copying anything; a request outside either is refused with
// transport.ErrOutOfBounds and nothing is written. A region the receiver has
// deregistered is refused with transport.ErrUnknownRegion: the receiver's control
// memfd holds each live region's true length and memfd offset, which the
// sender loads before each batch, so a SegmentInfo forged to claim a longer or
// unregistered region cannot write past what the receiver registered.
//
// # Ordering (completion and commit)
//
// All copies of a batch happen before the sender's atomic add of the batch's
// bytes to the receiver's committed counter (control memfd word 1) and before
// the atomic store of BatchCompleted (both sequentially consistent in Go's
// memory model, so they are release operations). Poll and Wait read the state
// with an atomic load (acquire), so a sender that observes BatchCompleted and
// then writes a metadata record or sends a status message publishes the payload
// first. On the receiving side, CommittedBytes is an acquire load of the same
// counter; a receiver that learns of completion through a control message has
// the ordering from the kernel's socket syscalls as well.
//
// # Fencing and deregistration
//
// A receiver cannot take back a mapping, so copies check, per unit of at most
// 1 MiB, a fenced flag and the region's control slot, and count themselves in
// their sender slot of the control memfd; FenceEpoch and DeregisterMemory wait
// until no unit that started before them is still copying (or its sender
// exited). See fence.go for the protocol and its bounds.
//
// # Peer loss
//
// The sender watches the receiver's pidfd (it becomes readable when the
// process exits) and the control memfd's state word (set when the receiver's
// transport closes). Either fails every pending batch of the segment with
// transport.ErrPeerLost. A batch of 256 KiB or more is marked completed only
// after a last pidfd check, so a receiver killed mid-batch is reported, never
// hidden; smaller batches skip that syscall (it would double their cost) and
// rely on the watcher, which the kernel wakes at the receiver's exit.
package shm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Name is the registry name of this transport.
const Name = "shm"

// Priority is the registry priority (rdma 300 > shm 200 > tcp 100).
const Priority = 200

// MaxRegions is the number of region IDs one receiver transport can hand out
// over its lifetime (IDs are never reused; the control memfd has one slot each).
const MaxRegions = 1 << 16

// Control memfd layout, in 8-byte words.
const (
	ctlState     = 0 // 0 = not ready, 1 = open, 2 = closed
	ctlCommitted = 1 // bytes committed by all senders (atomic add)
	ctlSlots     = 8 // region slots: words ctlSlots+2*id (length in bytes, 0 = not registered) and +1 (offset in its memfd)
	// then the epoch admission table and the sender slots (fence.go)
	ctlWords = ctlSend + sendSlots*sendWords
	ctlBytes = ctlWords * 8

	stateOpen   = 1
	stateClosed = 2
)

func init() {
	transport.RegisterTransport(Name, Priority, Probe, New)
	transport.RegisterTransport(CMAName, CMAPriority, ProbeCMA, NewCMA)
}

// Probe reports whether the shm transport can run here: it needs Linux's
// /proc (boot id, /proc/self/fd) and memfd. Errors wrap transport.ErrUnavailable.
func Probe() error {
	if _, err := readBootID(); err != nil {
		return fmt.Errorf("shm: %v: %w", err, transport.ErrUnavailable)
	}
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		return fmt.Errorf("shm: /proc is not mounted (%v): %w", err, transport.ErrUnavailable)
	}
	return nil
}

type localRegion struct {
	desc transport.RegionDesc
	addr uintptr
	len  uint64
	fd   int // our duplicate of the backing memfd, shared (memfds)
	file fileID
}

// fileID names a memfd by device and inode.
type fileID struct{ dev, ino uint64 }

// memfdRef is this transport's one duplicate of a memfd that backs
// registered regions, shared by all of them (a caller registering 10,000
// regions of one buffer spends one descriptor, not 10,000); closed with the
// last region.
type memfdRef struct {
	fd   int
	refs int
}

// unrefLocked drops region r's reference to its memfd; t.mu held.
func (t *shmTransport) unrefLocked(r *localRegion) {
	ref := t.memfds[r.file]
	if ref == nil {
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
		return
	}
	if ref.refs--; ref.refs == 0 {
		unix.Close(ref.fd)
		delete(t.memfds, r.file)
	}
}

type shmTransport struct {
	// cma: this instance is the "cma" transport (cma.go): regions are any
	// host memory, moved by process_vm_writev/readv instead of a mapping.
	cma         bool
	log         *slog.Logger
	refusedOnce sync.Once // the one log line when the kernel refuses cross-memory attach

	copyThreads int
	parallelMin uint64
	streamMin   uint64 // write batches from this many bytes copy with non-temporal stores (SHMOptions.StreamMinBytes)
	unitBytes   uint64 // copy unit (fence check, parallel split): chunkBytes, or cmaUnitBytes

	self    endpoint
	blob    []byte
	ctlFD   int
	ctl     []byte
	ctlWord []uint64

	mu       sync.Mutex
	closed   bool
	nextID   transport.RegionID
	regions  map[transport.RegionID]*localRegion
	memfds   map[fileID]*memfdRef // the memfds backing regions, one descriptor each
	segments map[*segment]struct{}
	admitted map[uint64]int // epoch → admission entry (fence.go)

	// slotMu serialises the phase flips of each sender slot (fence.go);
	// ctlRW is read-held while a fence or deregistration waits on the
	// control memfd, which Close unmaps only under the write lock.
	slotMu [sendSlots]sync.Mutex
	ctlRW  sync.RWMutex
	// local is a copy-on-write snapshot of regions for Submit's lock-free
	// local-range check; replaced under mu.
	local atomic.Pointer[[]*localRegion]
}

var (
	_ transport.Transport = (*shmTransport)(nil)
	_ transport.Fencer    = (*shmTransport)(nil)
)

// New creates an shm transport instance. Options used: Streams (copy
// goroutines per large batch) and SHM (transport.SHMOptions: CopyThreads,
// ParallelMinBytes, StreamMinBytes). Errors: /proc unreadable,
// memfd_create or mmap failures for the control memfd, CopyThreads outside
// 0..256.
func New(opts transport.Options) (transport.Transport, error) {
	return newTransport(opts, false)
}

// newTransport creates an shm (cma false) or cma (cma true) instance.
func newTransport(opts transport.Options, cma bool) (*shmTransport, error) {
	name := Name
	if cma {
		name = CMAName
	}
	boot, err := readBootID()
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %w", name, err, transport.ErrUnavailable)
	}
	st, err := procStartTime(os.Getpid())
	if err != nil {
		return nil, fmt.Errorf("%s: read own start time: %w", name, err)
	}
	t := &shmTransport{
		cma:         cma,
		log:         opts.Log(),
		copyThreads: opts.Streams,
		parallelMin: defaultParallelMin,
		unitBytes:   chunkBytes,
		streamMin:   defaultStreamMin,
		nextID:      1,
		regions:     map[transport.RegionID]*localRegion{},
		segments:    map[*segment]struct{}{},
		admitted:    map[uint64]int{},
	}
	if t.copyThreads <= 0 {
		t.copyThreads = DefaultCopyThreads()
	}
	if cma {
		t.parallelMin, t.unitBytes = cmaParallelMin, cmaUnitBytes
	}
	if n := opts.SHM.CopyThreads; n != 0 {
		if n < 1 || n > 256 {
			return nil, fmt.Errorf("%s: SHMOptions.CopyThreads %d: want 1..256 (0 for the default)", name, n)
		}
		t.copyThreads = n
	}
	if n := opts.SHM.ParallelMinBytes; n != 0 {
		t.parallelMin = n
	}
	if n := opts.SHM.StreamMinBytes; n != 0 {
		t.streamMin = n // transport.SHMStreamOff: no batch is that large
	}
	fd, err := unix.MemfdCreate("kvxfer:shm-ctl", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("%s: control memfd: memfd_create: %w", name, err)
	}
	if err := unix.Ftruncate(fd, ctlBytes); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: control memfd: ftruncate: %w", name, err)
	}
	ctl, err := unix.Mmap(fd, 0, ctlBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: control memfd: mmap: %w", name, err)
	}
	var fst unix.Stat_t
	if err := unix.Fstat(fd, &fst); err != nil {
		unix.Munmap(ctl)
		unix.Close(fd)
		return nil, fmt.Errorf("%s: control memfd: fstat: %w", name, err)
	}
	t.ctlFD, t.ctl = fd, ctl
	t.ctlWord = unsafe.Slice((*uint64)(unsafe.Pointer(&ctl[0])), ctlWords)
	atomic.StoreUint64(&t.ctlWord[ctlState], stateOpen)
	t.self = endpoint{BootID: boot, PID: uint32(os.Getpid()), StartTime: st,
		CtlFD: uint32(fd), CtlDev: uint64(fst.Dev), CtlIno: fst.Ino, CtlAddr: uint64(uintptr(unsafe.Pointer(&ctl[0])))}
	t.blob = t.self.encode(cma)
	if cma {
		grantPtrace(t.log)
	}
	return t, nil
}

// Name is "shm", or "cma" for the cross-memory-attach instance.
func (t *shmTransport) Name() string {
	if t.cma {
		return CMAName
	}
	return Name
}

// Capabilities: host memory, zero copy (one copy, by the CPU or the
// kernel), strided requests, READ; not cross-host.
func (t *shmTransport) Capabilities() transport.Caps {
	return transport.CapHostMemory | transport.CapZeroCopy | transport.CapStrided | transport.CapRead | transport.CapOrderedLast
}

// RegisterMemory registers memfd-backed host memory. It duplicates m.FD so the
// region stays shareable even if the caller closes its descriptor early.
func (t *shmTransport) RegisterMemory(m transport.Memory) (transport.RegionDesc, error) {
	if t.cma {
		return t.registerCMA(m)
	}
	if m.Kind != transport.MemoryHost {
		return transport.RegionDesc{}, fmt.Errorf("%s: register %s memory at %#x (%d bytes): %w (use tcp or rdma for device memory)", t.Name(), m.Kind, m.Addr, m.Length, transport.ErrUnsupportedMemory)
	}
	if m.Addr == 0 || m.Length == 0 {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x (%d bytes): address and length must be non-zero", t.Name(), m.Addr, m.Length)
	}
	if m.FD < 0 {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x (%d bytes): it has no backing file descriptor (Memory.FD = %d), so another process cannot map it; allocate it with kvx_alloc_host (C), kvxfer.HostBuffer (Python) or transport.AllocHost (Go): %w", t.Name(), m.Addr, m.Length, m.FD, transport.ErrUnsupportedMemory)
	}
	if m.Addr+uintptr(m.Length) < m.Addr {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x (%d bytes): range wraps the address space", t.Name(), m.Addr, m.Length)
	}
	var st unix.Stat_t
	if err := unix.Fstat(m.FD, &st); err != nil {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x: fstat fd %d: %w (is Memory.FD still open?)", t.Name(), m.Addr, m.FD, err)
	}
	if st.Size < 0 || m.FDOffset+m.Length > uint64(st.Size) || m.FDOffset+m.Length < m.FDOffset {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x: fd %d is %d bytes, too small for offset %d + length %d: %w", t.Name(), m.Addr, m.FD, st.Size, m.FDOffset, m.Length, transport.ErrOutOfBounds)
	}
	file := fileID{dev: uint64(st.Dev), ino: st.Ino}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory: transport %w", t.Name(), transport.ErrClosed)
	}
	if int(t.nextID) >= MaxRegions {
		return transport.RegionDesc{}, fmt.Errorf("%s: register memory: this transport has handed out all %d region IDs; open a new transport", t.Name(), MaxRegions-1)
	}
	ref := t.memfds[file]
	if ref == nil {
		dup, err := unix.FcntlInt(uintptr(m.FD), unix.F_DUPFD_CLOEXEC, 3)
		if err != nil {
			return transport.RegionDesc{}, fmt.Errorf("%s: register memory at %#x: dup fd %d: %w (%s)", t.Name(), m.Addr, m.FD, err, openHint(err, "the caller's descriptor"))
		}
		ref = &memfdRef{fd: dup}
		if t.memfds == nil {
			t.memfds = map[fileID]*memfdRef{}
		}
		t.memfds[file] = ref
	}
	ref.refs++
	dup := ref.fd
	id := t.nextID
	t.nextID++
	key := regionKey{FD: uint32(dup), Offset: m.FDOffset, Dev: uint64(st.Dev), Ino: st.Ino}
	desc := transport.RegionDesc{ID: id, Addr: uint64(m.Addr), Length: m.Length, Kind: transport.MemoryHost, Key: key.encode()}
	t.regions[id] = &localRegion{desc: desc, addr: m.Addr, len: m.Length, fd: dup, file: file}
	t.snapshotLocked()
	atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)+1], m.FDOffset)
	atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)], m.Length) // release: the slot is complete
	return desc, nil
}

// DeregisterMemory removes a region and returns once no sender copies into
// it any more: senders check the region's control slot before every copy
// unit (at most 1 MiB), so batches in flight stop at the next unit and fail
// with transport.ErrUnknownRegion, as on tcp, and later batches are refused.
// It waits up to 10 s for a copy unit in progress; a sender stopped (SIGSTOP)
// in the middle of one makes it return an error naming the pid: the region
// is deregistered, but its memory may still be written until that process
// is continued or exits, so do not reuse it before a later FenceEpoch or
// DeregisterMemory of another region succeeds. Errors also: an unknown id
// (wraps transport.ErrUnknownRegion).
func (t *shmTransport) DeregisterMemory(id transport.RegionID) error {
	t.ctlRW.RLock()
	defer t.ctlRW.RUnlock()
	t.mu.Lock()
	r, ok := t.regions[id]
	if !ok {
		t.mu.Unlock()
		return fmt.Errorf("%s: deregister region %d: %w", t.Name(), id, transport.ErrUnknownRegion)
	}
	atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)], 0)
	delete(t.regions, id)
	t.snapshotLocked()
	t.unrefLocked(r)
	t.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), deregisterWait)
	defer cancel()
	if err := t.quiesce(ctx, nil); err != nil {
		return fmt.Errorf("%s: deregister region %d: %w", t.Name(), id, err)
	}
	return nil
}

// Endpoint returns this node's endpoint blob (the same for every peer).
func (t *shmTransport) Endpoint(ctx context.Context, peer string) ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, fmt.Errorf("%s: endpoint: transport %w", t.Name(), transport.ErrClosed)
	}
	return append([]byte(nil), t.blob...), nil
}

// snapshotLocked publishes the current region set for localRange; t.mu held.
func (t *shmTransport) snapshotLocked() {
	rs := make([]*localRegion, 0, len(t.regions))
	for _, r := range t.regions {
		rs = append(rs, r)
	}
	t.local.Store(&rs)
}

// localRange reports whether [addr, addr+n) lies inside one registered local
// region (lock-free: reads the latest snapshot).
func (t *shmTransport) localRange(addr uintptr, n uint64) bool {
	rs := t.local.Load()
	if rs == nil {
		return false
	}
	for _, r := range *rs {
		if addr >= r.addr && uint64(addr-r.addr) <= r.len && n <= r.len-uint64(addr-r.addr) {
			return true
		}
	}
	return false
}

// closeWait bounds how long Close waits for senders' copies in progress.
const closeWait = 2 * time.Second

// Close fails pending batches of every segment, tells senders that map this
// node's regions that it is gone, waits (up to 2 s) until none of them is
// in the middle of a copy, and releases all descriptors. Idempotent.
func (t *shmTransport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	segs := make([]*segment, 0, len(t.segments))
	for s := range t.segments {
		segs = append(segs, s)
	}
	t.mu.Unlock()
	for _, s := range segs {
		s.Close()
	}
	t.mu.Lock()
	atomic.StoreUint64(&t.ctlWord[ctlState], stateClosed)
	for id, r := range t.regions {
		atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)], 0)
		t.unrefLocked(r)
	}
	t.regions = map[transport.RegionID]*localRegion{}
	t.snapshotLocked()
	t.mu.Unlock()
	// Every region is deregistered: wait (bounded) until no sender copies
	// into them, so the caller may free the memory.
	ctx, cancel := context.WithTimeout(context.Background(), closeWait)
	qerr := t.quiesce(ctx, nil)
	cancel()
	t.ctlRW.Lock() // no fence or deregistration is using the control memfd
	defer t.ctlRW.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	if qerr != nil {
		errs = append(errs, fmt.Errorf("%s: close: %w (its memory may still be written until that process continues or exits)", t.Name(), qerr))
	}
	if err := unix.Munmap(t.ctl); err != nil {
		errs = append(errs, fmt.Errorf("%s: unmap control memfd: %w", t.Name(), err))
	}
	t.ctl, t.ctlWord = nil, nil
	if err := unix.Close(t.ctlFD); err != nil {
		errs = append(errs, fmt.Errorf("%s: close control memfd: %w", t.Name(), err))
	}
	return errors.Join(errs...)
}

// CommittedBytes returns, on a receiving shm transport, the total payload in
// bytes that senders have committed into its regions (an acquire load: every
// byte counted is visible to the caller). ok is false when t is not an open
// shm transport.
func CommittedBytes(t transport.Transport) (n uint64, ok bool) {
	st, isShm := t.(*shmTransport)
	if !isShm {
		return 0, false
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return 0, false
	}
	return atomic.LoadUint64(&st.ctlWord[ctlCommitted]), true
}

// DefaultCopyThreads is the number of goroutines that copy one large batch
// when transport.Options.Streams is 0: min(4, GOMAXPROCS).
func DefaultCopyThreads() int { return min(4, runtime.GOMAXPROCS(0)) }

// Non-temporal copies.
//
// A write batch of at least streamMin bytes is copied with
// blkcopy.Blocks: AVX loads with the source prefetched ahead and
// non-temporal stores, one call per strided piece instead of one memmove
// per block (SGLang's per-token head slices: 262,144 1 KiB blocks per 4K-
// token request). The stores skip the read for ownership of the
// receiver's lines and leave this process's caches to its own data; what
// is copied is the receiver's, read by it later if at all. Each call ends
// with SFENCE, and the worker finishes its unit after it, so the commit
// word (a LastAfterAll tail) and the committed counter are stored after
// every page of the batch is globally visible. Smaller batches, reads,
// cma and CPUs without AVX copy with copy() as before: a small batch
// (a commit word, a few KiB of metadata) is read soon by a receiver on
// the same host and is better left in the shared cache.

// defaultParallelMin is the batch size from which shm splits a batch's
// copy across copyThreads goroutines (transport.SHMOptions.ParallelMinBytes
// 0): 8 MiB. Smaller batches copy on the caller's goroutine; at 4 MiB,
// vLLM's ten sender threads × 16 × 256 KiB per call reached 1.05–1.18× of
// one thread × 160 blocks copied that way, against 0.72–0.93× with each
// 4 MiB batch split over two copy goroutines of its own (bench/RESULTS.md,
// issue 27). It was 4 MiB.
const defaultParallelMin = 8 << 20

// defaultStreamMin is the write batch size from which shm copies with
// non-temporal stores when transport.SHMOptions.StreamMinBytes is 0:
// 1 MiB, the size from which runtime.memmove itself switches to them for
// one call, and the L2 size of the development VM's cores (measured:
// bench/RESULTS.md, issue 27).
const defaultStreamMin = 1 << 20
