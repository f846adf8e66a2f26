package transport

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Prefault makes the host memory mem resident and writable in this process
// now, so that the first transfer into or out of it runs at the speed of the
// later ones instead of paying a page fault (and, for fresh memfd pages, an
// allocation and a zeroing) per 4 KiB: issue 13 measured a first room of
// 760 ms against 60 ms for the next ones (shm, 0.9 GB). It calls
// madvise(MADV_POPULATE_WRITE) (Linux ≥ 5.14), which faults the pages in
// writable without changing them, and then, only where that succeeded (so
// the range is writable), adds 0 atomically to one word of every page: a
// hypervisor that shadows the guest's page tables or backs guest memory
// lazily (e.g. a paravirtualised VM) otherwise charges its own fault on the
// first write through each page, which on the development VM kept the
// first 256 MiB copy at ~1.1–2.3 s against ~40 ms after; the atomic add
// changes no value, even with concurrent writers, so caller-owned memory
// keeps its contents. On kernels without MADV_POPULATE_WRITE it reads one
// byte per page instead. Device memory is resident already (nil). The range
// is widened to whole OS pages. Errors name the range; the memory stays
// usable either way.
func Prefault(mem Memory) error {
	if mem.Kind != MemoryHost || mem.Addr == 0 || mem.Length == 0 {
		return nil
	}
	pg := uintptr(os.Getpagesize())
	start := mem.Addr &^ (pg - 1)
	end := (mem.Addr + uintptr(mem.Length) + pg - 1) &^ (pg - 1)
	b := Memory{Addr: start, Length: uint64(end - start), Kind: MemoryHost}.Bytes() // outside the Go heap
	err := unix.Madvise(b, unix.MADV_POPULATE_WRITE)
	if errors.Is(err, unix.EINVAL) {
		// Kernel without MADV_POPULATE_WRITE: read-fault every page.
		var sink byte
		for off := 0; off < len(b); off += int(pg) {
			sink ^= b[off]
		}
		runtime.KeepAlive(sink)
		return nil
	}
	if err != nil {
		return fmt.Errorf("engine: prefault %d bytes at %#x: %w (not enough memory, or the range is not mapped writable)", mem.Length, mem.Addr, err)
	}
	for off := 0; off < len(b); off += int(pg) {
		atomic.AddUint32((*uint32)(unsafe.Pointer(&b[off])), 0) // a write access that changes nothing
	}
	return nil
}

// AllocOption configures AllocHost.
type AllocOption func(*allocOptions)

type allocOptions struct{ prefault bool }

// WithPrefault makes AllocHost prefault the new memory: beyond Prefault
// (pages allocated, zeroed and written once from user space) the kernel
// itself writes every page once (a read from /dev/zero into it, harmless:
// fresh memory is zero). Hypervisors that shadow the kernel's and the user's
// views of a page separately (e.g. a paravirtualised VM) charge a fault for
// each on first use, and a transport that moves bytes with system calls (tcp:
// recvmsg/sendmsg) goes through the kernel's view: on the development VM a
// 256 MiB socket transfer into fresh memory took ~0.9–1.4 s the first time
// and ~60 ms after; with this prefault the first one ran at the later speed.
// The cost is paid once, at allocation (about one memory pass).
func WithPrefault() AllocOption { return func(o *allocOptions) { o.prefault = true } }

// prefaultFresh prefaults newly allocated (all-zero) memory b: populate,
// one kernel write pass (read from /dev/zero), one user write per page.
func prefaultFresh(b []byte) error {
	if err := unix.Madvise(b, unix.MADV_POPULATE_WRITE); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("engine: prefault %d bytes: %w (not enough memory?)", len(b), err)
	}
	zero, err := os.Open("/dev/zero")
	if err != nil {
		return fmt.Errorf("engine: prefault %d bytes: %w", len(b), err)
	}
	defer zero.Close()
	const chunk = 8 << 20
	for off := 0; off < len(b); {
		n, err := zero.Read(b[off:min(off+chunk, len(b))])
		if err != nil {
			return fmt.Errorf("engine: prefault %d bytes: read /dev/zero: %w", len(b), err)
		}
		off += n
	}
	pg := os.Getpagesize()
	for off := 0; off < len(b); off += pg {
		atomic.AddUint32((*uint32)(unsafe.Pointer(&b[off])), 0)
	}
	return nil
}
