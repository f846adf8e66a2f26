package shm

import (
	"errors"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/shm/internal/blkcopy"
)

// First contact with a receiver's memory.
//
// The sender writes into a second mapping of the receiver's memfd.
// madvise(MADV_POPULATE_WRITE) at map time fills this process's page tables,
// but a hypervisor that builds its own translation of a guest page table
// entry lazily (shadow or nested paging, e.g. the development VM) still
// charges an exit on the first write through each 4 KiB page of the new
// mapping: measured 20–50 µs per page after the populate (120–140 µs
// without it), so a 900 MB first room took 3.8–7.3 s against 0.13–0.34 s
// for the later ones, and a fragmented TP 8 demo, whose pages lie scattered
// over the whole pool, kept paying it room after room. Later writes through
// the mapping cost 0.5–3 µs per 4 KiB page. What keeps the first contact
// off the rooms:
//
//   - put, per piece, by the state of its pages (one bit each in warm):
//     all warm → a plain copy. A piece of at least pwriteMin bytes with a
//     page not yet warm → pwrite(2) on the receiver's memfd: the kernel
//     copies through its own linear map, which no first-write exit touches,
//     at about copy speed for such a piece. A smaller piece (a scattered
//     4 KiB page) → the copy, paying the exit once, and its pages are marked
//     warm: pwrite costs 4–10 µs per call under load against 0.5–3 µs for a
//     warm copy, and a fragmented pool's pages are written again by later
//     rooms, so a pwrite would only be paid on top of the exit.
//   - The warmer: when a segment maps regions it starts one goroutine that
//     writes once through every page not yet warm (an atomic add of 0 to
//     one word per page: no value changes, even with the receiver or another
//     sender writing the same word at once), region after region, as an
//     ordinary goroutine (see warmRegions for why not a niced thread); it
//     stops at Close (within warmChunk). Cost: one pass over the mapped
//     regions, once per segment: 20–50 µs per page on the VM (5–13 s of one
//     core per GiB), a few ns per page on bare metal, where the populate
//     did the work; memory: one bit per 4 KiB page beside the page tables
//     the populate filled (8 bytes per page).
//
// The cold path is as safe as the mapped one: the same bounds were checked
// at Submit, pwrite goes to the same pages inside the same fence unit
// (enter/leave in fence.go), and a failing pwrite falls back to the copy.
// Once every page of a region is warm its descriptor is closed.

// pwriteMin is the smallest piece put writes with pwrite while a page of it
// is not warm (see "First contact"). Measured with the demo (same run,
// loaded VM): pwrite for every cold piece (4 KiB ones too) made the TP 8
// --fragment rooms slower than paying the exits; switching a piece to the
// copy once pwrite had seen its pages moved the exits into the second room
// (TP 1 total transfer time 23.4 s against 18.8 s before).
const pwriteMin = 64 << 10

// warmChunk is how many bytes the warmer touches between watermark updates
// and Close checks.
const warmChunk = 2 << 20

// startWarmer starts a goroutine that warms regs (warm.go). Caller holds
// s.mu. It is counted in s.running, so Close waits for it before unmapping.
func (s *segment) startWarmer(regs []*remoteRegion) {
	if s.closed || len(regs) == 0 || s.t.cma { // cma maps nothing

		return
	}
	s.running.Add(1)
	go s.warmRegions(regs)
}

// warmRegions writes once through every page of regs not yet warm, one
// region at a time (warmMu: one warmer per segment at once), then closes
// each region's pwrite descriptor.
func (s *segment) warmRegions(regs []*remoteRegion) {
	defer s.running.Done()
	// An ordinary goroutine, deliberately: a thread of its own at nice 19
	// (locked and left to exit with the goroutine, since an unprivileged
	// process cannot lower its nice value again) measured within noise of
	// nice 0 in the same runs, and a Go thread that exits delivers the
	// parent-death signal (Pdeathsig) to every child process it forked: it
	// SIGKILLed the test suite's shared etcd when a shm segment's warmer
	// ended on the thread that had started it.
	s.warmMu.Lock()
	defer s.warmMu.Unlock()
	pg := os.Getpagesize()
	for _, r := range regs {
		if len(r.data) == 0 || r.warm == nil {
			continue
		}
		pages := (len(r.mapping) + pg - 1) / pg
		for i := 0; i < pages; {
			if s.closing.Load() || s.peerLost.Load() {
				return
			}
			for stop := min(i+warmChunk/pg, pages); i < stop; i++ {
				w := &r.warm[i/64]
				if w.Load()&(1<<(i%64)) != 0 {
					continue
				}
				atomic.AddUint32((*uint32)(unsafe.Pointer(&r.mapping[i*pg])), 0) // a write that changes nothing
				w.Or(1 << (i % 64))
			}
		}
		r.closeFD()
	}
}

// put writes the piece by the state of its pages (see "First contact"):
// a copy where all are warm, else pwrite for a large piece, else a copy
// that warms them. A strided piece is its blocks, each put so (one
// blkcopy.Blocks call for all of them when every page the piece spans is
// warm and stream is set). stream: the copies use blkcopy's non-temporal
// stores (see streamMin) instead of copy().
func (p piece) put(stream bool) {
	if p.n <= 1 {
		putBlock(p.rr, p.dst, p.src, p.off, stream)
		return
	}
	rr := p.rr
	if r := p.rr; r != nil && r.warm != nil && len(p.dst) > 0 {
		pg := uint64(os.Getpagesize())
		if allSet(r.warm, (r.lead+p.off)/pg, (r.lead+p.off+uint64(len(p.dst))-1)/pg) {
			rr = nil // all warm: plain copies
		}
	}
	if stream && (rr == nil || rr.warm == nil) {
		blkcopy.Blocks(p.dst, p.src, p.n, p.blk, p.dstStride, p.srcStride)
		return
	}
	for j := uint64(0); j < p.n; j++ {
		d, s := j*p.dstStride, j*p.srcStride
		putBlock(rr, p.dst[d:d+p.blk], p.src[s:s+p.blk], p.off+d, stream)
	}
}

// putBlock writes src to dst, which is at byte off of region r (nil: a
// plain copy), by the state of its pages; stream as for put.
func putBlock(r *remoteRegion, dst, src []byte, off uint64, stream bool) {
	if r == nil || r.warm == nil || len(dst) == 0 {
		copyBytes(dst, src, stream)
		return
	}
	pg := uint64(os.Getpagesize())
	first := (r.lead + off) / pg
	last := (r.lead + off + uint64(len(dst)) - 1) / pg
	if allSet(r.warm, first, last) {
		copyBytes(dst, src, stream)
		return
	}
	if len(dst) >= pwriteMin && r.pwrite(src, off) {
		return
	}
	copyBytes(dst, src, stream)
	setBits(r.warm, first, last)
}

// copyBytes is copy(dst, src), with blkcopy's non-temporal stores when
// stream is set.
func copyBytes(dst, src []byte, stream bool) {
	if stream {
		blkcopy.Copy(dst, src)
		return
	}
	copy(dst, src)
}

// allSet reports whether bits first..last (inclusive) of bm are all set.
func allSet(bm []atomic.Uint64, first, last uint64) bool {
	for i := first; i <= last; {
		w, b := i/64, i%64
		n := min(64-b, last-i+1) // bits of this word in range
		mask := (^uint64(0) >> (64 - n)) << b
		if bm[w].Load()&mask != mask {
			return false
		}
		i += n
	}
	return true
}

// setBits sets bits first..last (inclusive) of bm.
func setBits(bm []atomic.Uint64, first, last uint64) {
	for i := first; i <= last; {
		w, b := i/64, i%64
		n := min(64-b, last-i+1)
		bm[w].Or((^uint64(0) >> (64 - n)) << b)
		i += n
	}
}

// pwrite writes b at byte offset off of the region through its memfd. It
// reports false when the region has no descriptor (warm, or released) or
// the write fails (the caller copies instead).
func (r *remoteRegion) pwrite(b []byte, off uint64) bool {
	r.fdMu.RLock()
	defer r.fdMu.RUnlock()
	if r.fd < 0 {
		return false
	}
	pos := int64(r.fileOff + off)
	for len(b) > 0 {
		n, err := unix.Pwrite(r.fd, b, pos)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			return false
		}
		b, pos = b[n:], pos+int64(n)
	}
	return true
}

// closeFD closes the region's pwrite descriptor once (idempotent).
func (r *remoteRegion) closeFD() {
	r.fdMu.Lock()
	if r.fd >= 0 {
		if r.sfd != nil {
			r.sfd.release() // shared with the other regions of its memfd
		} else {
			unix.Close(r.fd)
		}
		r.fd = -1
	}
	r.fdMu.Unlock()
}
