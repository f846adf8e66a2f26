package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// The "cma" transport: same-host transfers on any registered host memory.
//
// shm needs every region backed by a memfd (transport.AllocHost), because
// the sender maps it. A serving engine registers its own tensors (malloc,
// PyTorch's pinned or pageable host memory, a numpy array), which have no
// such file: shm refuses them (transport.ErrUnsupportedMemory) and the KV
// manager leaves shm out. cma moves those bytes with cross-memory attach:
// a WRITE is one process_vm_writev(2) per copy unit from the sender's
// registered memory into the receiver's, a READ one process_vm_readv(2)
// the other way: the kernel copies between the two address spaces
// directly (one copy, no staging, no mapping of the peer's memory).
//
// Everything but the data path is shm's: the receiver's control memfd
// (region slots, epoch admission, sender slots) that the sender maps
// through /proc/PID/fd, the fence protocol (fence.go: a fenced flag and
// phase counters checked around every unit of at most 1 MiB), peer loss
// through the receiver's pidfd, and the batch table. A region slot holds
// the region's length and its address in the receiver; the sender takes
// both from the slot, never from the descriptor it was sent, so a forged
// SegmentInfo can neither write outside a registered region nor name one
// that is gone.
//
// Permission: process_vm_writev needs the same access as ptrace attach
// (PTRACE_MODE_ATTACH_REALCREDS): the same user, a dumpable target, and,
// where Yama restricts ptrace (/proc/sys/kernel/yama/ptrace_scope = 1), a
// declared tracer. A receiver cannot name its senders' pids in advance
// (a rank registers with peers it has not met), so at scope 1 every cma
// transport calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): any process
// that passes the classic same-user checks may attach to it, which is the
// rule of ptrace_scope 0 for this one process. Scope 2 (admin only) works
// for root senders only and scope 3 never: the probe says so and `auto`
// leaves cma out. Where the kernel still refuses (EPERM: a seccomp filter,
// another user), OpenSegment fails with transport.ErrUnavailable naming
// the cause, the KV manager falls back to the next transport both sides
// have (tcp), and the transport logs it once.
//
// Pid reuse: process_vm_writev names the receiver by pid, not by pidfd.
// The sender pins the receiver with a pidfd, checks its start time at
// OpenSegment, reads the receiver's control memfd through the pid once
// (the bytes must be that memfd's), and polls the pidfd before each batch
// and after one of 256 KiB or more; a pid is reused only after the pid
// space wraps, far longer than the gap between those checks.

// CMAName is the registry name of the cross-memory-attach transport.
const CMAName = "cma"

// CMAPriority is its registry priority: below shm (200), which needs no
// system call per copy, above tcp (100). `auto` opens both; a KV manager
// whose buffers shm cannot register (no memfd) uses cma.
const CMAPriority = 150

// yamaPath holds Yama's ptrace restriction level (absent without Yama); a
// variable so a test can give another level.
var yamaPath = "/proc/sys/kernel/yama/ptrace_scope"

// ptraceScope returns Yama's ptrace_scope (0..3), or -1 without Yama.
func ptraceScope() int {
	raw, err := os.ReadFile(yamaPath)
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		return -1
	}
	return n
}

// scopeWords describes ptrace_scope for messages.
func scopeWords() string {
	switch s := ptraceScope(); s {
	case -1:
		return "no Yama"
	default:
		return "Yama ptrace_scope " + strconv.Itoa(s)
	}
}

// processVMReadv and processVMWritev are the system calls (variables so a
// test can make the kernel refuse).
var (
	processVMReadv  = unix.ProcessVMReadv
	processVMWritev = unix.ProcessVMWritev
)

// ProbeCMA reports whether the cma transport can run here: shm's probe
// (Linux /proc), Yama's ptrace_scope below 3 (below 2 unless root), and a
// process_vm_readv of this process's own memory (a seccomp filter or a
// kernel without CONFIG_CROSS_MEMORY_ATTACH refuses it). Errors wrap
// transport.ErrUnavailable and say what to change.
func ProbeCMA() error {
	if err := Probe(); err != nil {
		return fmt.Errorf("cma: %w", err)
	}
	switch s := ptraceScope(); {
	case s >= 3:
		return fmt.Errorf("cma: Yama ptrace_scope is 3 (%s: no process may attach to another), so cross-memory attach is impossible; use shm with kvxfer-allocated memory, or tcp: %w", yamaPath, transport.ErrUnavailable)
	case s == 2 && os.Geteuid() != 0:
		return fmt.Errorf("cma: Yama ptrace_scope is 2 (%s: only CAP_SYS_PTRACE may attach) and this process is not root; set it to 1 (kvxfer grants its peers itself) or use shm with kvxfer-allocated memory, or tcp: %w", yamaPath, transport.ErrUnavailable)
	}
	buf := new([2]uint64) // heap: does not move during the call
	buf[0] = 0x6b76786665720001
	local := []unix.Iovec{{Base: (*byte)(unsafe.Pointer(&buf[1]))}}
	local[0].SetLen(8)
	remote := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&buf[0])), Len: 8}}
	n, err := processVMReadv(os.Getpid(), local, remote, 0)
	runtime.KeepAlive(buf)
	if err != nil || n != 8 || buf[1] != buf[0] {
		return fmt.Errorf("cma: process_vm_readv of this process's own memory: %d bytes, %v (a seccomp filter, e.g. a container's default profile, or a kernel without CONFIG_CROSS_MEMORY_ATTACH); use shm with kvxfer-allocated memory, or tcp: %w", n, err, transport.ErrUnavailable)
	}
	return nil
}

// NewCMA creates a cma transport instance (Options as for New). At Yama
// ptrace_scope 1 it lets any same-user process attach to this one
// (PR_SET_PTRACER_ANY; see the package's cma notes).
func NewCMA(opts transport.Options) (transport.Transport, error) {
	return newTransport(opts, true)
}

// grantOnce makes grantPtrace act once per process (a pointer so a test
// can start over).
var grantOnce = new(sync.Once)

// grantPtrace declares, once per process and only at ptrace_scope 1, that
// any process may attach (the kernel's same-user and dumpable checks still
// apply). A refusal is logged: OpenSegment on the sender then reports
// EPERM and the KV manager falls back to tcp.
func grantPtrace(log *slog.Logger) {
	if ptraceScope() != 1 {
		return
	}
	grantOnce.Do(func() {
		if err := unix.Prctl(unix.PR_SET_PTRACER, unix.PR_SET_PTRACER_ANY, 0, 0, 0); err != nil {
			log.Warn("cma: prctl(PR_SET_PTRACER, ANY) failed; same-host peers cannot write into this process's memory and fall back to tcp", "err", err, "ptrace_scope", 1)
			return
		}
		log.Debug("cma: Yama ptrace_scope 1: same-user peers may attach to this process (PR_SET_PTRACER_ANY) for cross-memory attach")
	})
}

// registerCMA registers host memory of any kind (no file descriptor
// needed): the region slot records its length and address, which senders
// read before every batch. Errors: device memory
// (transport.ErrUnsupportedMemory), a zero or wrapping range, a range not
// mapped in this process, a closed transport, region IDs exhausted.
func (t *shmTransport) registerCMA(m transport.Memory) (transport.RegionDesc, error) {
	if m.Kind != transport.MemoryHost {
		return transport.RegionDesc{}, fmt.Errorf("cma: register %s memory at %#x (%d bytes): %w (cross-memory attach reaches host memory only; use tcp or rdma for device memory)", m.Kind, m.Addr, m.Length, transport.ErrUnsupportedMemory)
	}
	if m.Addr == 0 || m.Length == 0 {
		return transport.RegionDesc{}, fmt.Errorf("cma: register memory at %#x (%d bytes): address and length must be non-zero", m.Addr, m.Length)
	}
	if m.Addr+uintptr(m.Length) < m.Addr || m.Length > 1<<46 {
		return transport.RegionDesc{}, fmt.Errorf("cma: register memory at %#x (%d bytes): range wraps the address space or exceeds 64 TiB", m.Addr, m.Length)
	}
	if err := checkMapped(m.Addr, m.Length); err != nil {
		return transport.RegionDesc{}, fmt.Errorf("cma: register memory at %#x (%d bytes): %w", m.Addr, m.Length, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return transport.RegionDesc{}, fmt.Errorf("cma: register memory: transport %w", transport.ErrClosed)
	}
	if int(t.nextID) >= MaxRegions {
		return transport.RegionDesc{}, fmt.Errorf("cma: register memory: this transport has handed out all %d region IDs; open a new transport", MaxRegions-1)
	}
	id := t.nextID
	t.nextID++
	desc := transport.RegionDesc{ID: id, Addr: uint64(m.Addr), Length: m.Length, Kind: transport.MemoryHost, Key: encodeCMAKey(uint64(m.Addr))}
	t.regions[id] = &localRegion{desc: desc, addr: m.Addr, len: m.Length, fd: -1}
	t.snapshotLocked()
	atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)+1], uint64(m.Addr))
	atomic.StoreUint64(&t.ctlWord[ctlSlots+2*int(id)], m.Length) // release: the slot is complete
	return desc, nil
}

// checkMapped reports an error unless every page of [addr, addr+n) is
// mapped in this process (mincore fails with ENOMEM on a hole). It reads
// no byte of the range.
func checkMapped(addr uintptr, n uint64) error {
	pg := uintptr(os.Getpagesize())
	start := addr &^ (pg - 1)
	end := (addr + uintptr(n) + pg - 1) &^ (pg - 1)
	const step = 1 << 30 // bound the residency vector (256 KiB per GiB)
	vec := make([]byte, min(uint64(end-start), step)/uint64(pg))
	for a := start; a < end; a += step {
		l := min(end-a, step)
		_, _, e := unix.Syscall(unix.SYS_MINCORE, a, l, uintptr(unsafe.Pointer(&vec[0])))
		runtime.KeepAlive(vec)
		if e != 0 {
			err := error(e)
			if errors.Is(err, unix.ENOMEM) {
				return fmt.Errorf("not mapped in this process from %#x on (pass memory the caller allocated and keeps alive)", a)
			}
			return fmt.Errorf("mincore: %w", err)
		}
	}
	return nil
}

// cma region key (RegionDesc.Key): version, 'C', the region's address in
// the receiver (little-endian). The address must equal RegionDesc.Addr and
// the receiver's control slot.
const cmaKeySize = 10

func encodeCMAKey(addr uint64) []byte {
	b := make([]byte, cmaKeySize)
	b[0], b[1] = wireVersion, 'C'
	binary.LittleEndian.PutUint64(b[2:], addr)
	return b
}

func decodeCMAKey(b []byte) (uint64, error) {
	if len(b) != cmaKeySize || b[1] != 'C' {
		return 0, fmt.Errorf("cma: region key is %d bytes, want a %d-byte cma key (was the region registered with the cma transport?)", len(b), cmaKeySize)
	}
	if b[0] != wireVersion {
		return 0, fmt.Errorf("cma: region key version %d, this build speaks %d", b[0], wireVersion)
	}
	a := binary.LittleEndian.Uint64(b[2:])
	if a == 0 {
		return 0, errors.New("cma: region key names address 0")
	}
	return a, nil
}

// cmaEndpointMagic and cmaEndpointSize: the cma endpoint blob is shm's
// with its own magic and the control memfd's address appended.
var cmaEndpointMagic = [4]byte{'K', 'V', 'X', 'C'}

const cmaEndpointSize = endpointSize + 8

// cmaRegion returns the table entry for a receiver region named in a
// descriptor: its address and length from the receiver's control slot (an
// empty entry, refused at Submit, when the slot is empty or disagrees with
// the descriptor); a longer claim is cut to the true length.
func (s *segment) cmaRegion(d transport.RegionDesc) (*remoteRegion, error) {
	addr, err := decodeCMAKey(d.Key)
	if err != nil {
		return nil, fmt.Errorf("cma: region %d: %w", d.ID, err)
	}
	if d.Length == 0 || d.Length > 1<<46 {
		return nil, fmt.Errorf("cma: region %d: length %d bytes out of range", d.ID, d.Length)
	}
	if int(d.ID) >= MaxRegions {
		return &remoteRegion{fd: -1}, nil
	}
	trueLen := atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(d.ID)])
	trueAddr := atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(d.ID)+1])
	if trueLen == 0 || trueAddr != addr || d.Addr != addr {
		return &remoteRegion{fd: -1}, nil
	}
	return &remoteRegion{fd: -1, base: uintptr(trueAddr), size: min(d.Length, trueLen)}, nil
}

// checkAttach reads the receiver's control memfd through its pid
// (process_vm_readv at the address the endpoint names) and compares it
// with this process's mapping of the same memfd: it proves the kernel lets
// this process attach and that the pid is the receiver. EPERM is logged
// once per transport and returned wrapping transport.ErrUnavailable, so
// the KV manager falls back to tcp.
func (s *segment) checkAttach() error {
	buf := new(uint64)
	local := []unix.Iovec{{Base: (*byte)(unsafe.Pointer(buf))}}
	local[0].SetLen(8)
	remote := []unix.RemoteIovec{{Base: uintptr(s.peer.CtlAddr), Len: 8}}
	n, err := processVMReadv(int(s.peer.PID), local, remote, 0)
	runtime.KeepAlive(buf)
	if errors.Is(err, unix.EPERM) {
		s.t.refusedOnce.Do(func() {
			s.t.log.Warn("cma: the kernel refuses cross-memory attach to same-host peers (EPERM); their transfers fall back to tcp",
				"receiver_pid", s.peer.PID, "ptrace", scopeWords(), "hint", "same user for both processes; at Yama ptrace_scope 1 kvxfer grants its peers itself; a seccomp filter must allow process_vm_readv/writev")
		})
		return fmt.Errorf("cma: receiver pid %d: process_vm_readv: %v: the kernel refuses cross-memory attach (%s; another user, or a seccomp filter); KV managers fall back to tcp, a segment engine (Mooncake API) on cma cannot: open it with tcp: %w", s.peer.PID, err, scopeWords(), transport.ErrUnavailable)
	}
	if err != nil || n != 8 {
		return fmt.Errorf("cma: receiver pid %d: process_vm_readv of its control memory: %d bytes, %v: %w", s.peer.PID, n, err, transport.ErrUnavailable)
	}
	if want := atomic.LoadUint64(&s.ctlWord[ctlState]); *buf != want {
		return fmt.Errorf("cma: receiver pid %d holds %#x at its control address, its control memfd holds %#x (not the process that published the endpoint): %w", s.peer.PID, *buf, want, transport.ErrUnavailable)
	}
	return nil
}

// cmaUnitBytes and cmaParallelMin: cma copies in units of 256 KiB and
// splits a batch of 1 MiB or more across the copy goroutines. The kernel's
// copy between address spaces (it pins the receiver's pages, then copies
// page by page) ran at about half a single-goroutine memmove on the
// development VM (process_vm_writev of 1 MiB: 9.5-11.4 GB/s; memmove:
// 20-26 GB/s), so one thread stays below memcpy at 1 MiB; the split lets a
// batch use more cores where they are free (on the loaded 2-core VM it
// measured within noise of one thread), and the smaller unit costs one
// system call (about 0.4 us) per 256 KiB.
const (
	cmaUnitBytes   = 256 << 10
	cmaParallelMin = 1 << 20
)

// maxIov is the most iovecs one process_vm_writev/readv call takes
// (IOV_MAX).
const maxIov = 1024

// iovScratch is one copy worker's iovec arrays.
type iovScratch struct {
	local  [maxIov]unix.Iovec
	remote [maxIov]unix.RemoteIovec
}

// iovPool recycles the copy workers' iovec arrays.
var iovPool = sync.Pool{New: func() any { return new(iovScratch) }}

// vmCopy moves the pieces of one unit between local memory (piece.local)
// and the receiver (piece.raddr): process_vm_writev for a write,
// process_vm_readv for a read, up to maxIov pieces a call, resuming after
// a partial transfer. Errors: the receiver exited (ESRCH, wraps
// transport.ErrPeerLost), the kernel refused (EPERM, wraps ErrPeerLost), an
// address not mapped any more (EFAULT: a region freed while registered;
// wraps transport.ErrOutOfBounds).
func (s *segment) vmCopy(ps []piece, read bool, sc *iovScratch) error {
	pid := int(s.peer.PID)
	for len(ps) > 0 {
		n := min(len(ps), maxIov)
		want := 0
		for j, p := range ps[:n] {
			sc.local[j] = unix.Iovec{Base: &p.local[0]}
			sc.local[j].SetLen(len(p.local))
			sc.remote[j] = unix.RemoteIovec{Base: p.raddr, Len: len(p.local)}
			want += len(p.local)
		}
		l, r := sc.local[:n], sc.remote[:n]
		for want > 0 {
			var got int
			var err error
			if read {
				got, err = processVMReadv(pid, l, r, 0)
			} else {
				got, err = processVMWritev(pid, l, r, 0)
			}
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err == nil && got <= 0 {
				err = unix.EFAULT
			}
			if err != nil {
				return s.vmError(read, err)
			}
			want -= got
			// Skip the bytes moved; local and remote iovecs pair up with
			// equal lengths, so both advance alike.
			for got > 0 {
				k := min(got, r[0].Len)
				r[0].Base += uintptr(k)
				r[0].Len -= k
				l[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(l[0].Base), k))
				l[0].SetLen(int(l[0].Len) - k)
				got -= k
				if r[0].Len == 0 {
					l, r = l[1:], r[1:]
				}
			}
		}
		ps = ps[n:]
	}
	return nil
}

// vmError turns a process_vm_writev/readv failure into the transport's
// error. ESRCH ("no such process", which reads like a local fault) means
// the peer process exited: the error names it and what to do.
func (s *segment) vmError(read bool, err error) error {
	pid := int(s.peer.PID)
	call := "process_vm_writev"
	if read {
		call = "process_vm_readv"
	}
	switch {
	case errors.Is(err, unix.ESRCH):
		return s.lostPeer(read, fmt.Sprintf("exited during the batch (%s: %v: no process has that pid any more)", call, err))
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("cma: receiver pid %d: %s: %v: the kernel refused cross-memory attach during the batch: %w", pid, call, err, transport.ErrPeerLost)
	case errors.Is(err, unix.EFAULT):
		return fmt.Errorf("cma: receiver pid %d: %s: %v: a registered range is not mapped any more (memory freed while registered, here or in the receiver): %w", pid, call, err, transport.ErrOutOfBounds)
	}
	return fmt.Errorf("cma: receiver pid %d: %s: %w", pid, call, err)
}
