package shm

import (
	"bytes"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestWarmerChangesNothing: the warmer of a new segment writes through every
// page of the receiver region (watermark reaches the region's length, its
// pwrite descriptor is closed) while the receiver writes the same pages, and
// no byte the receiver wrote changes.
func TestWarmerChangesNothing(t *testing.T) {
	const size = 16 << 20
	p := newPair(t, size, transport.DefaultOptions())
	dst := p.dst.Bytes()
	for i := range dst { // concurrent with the warmer
		dst[i] = byte(i*13 + i>>12)
	}
	r := p.seg.(*segment).regions[p.dDesc.ID]
	deadline := time.Now().Add(2 * time.Minute)
	for {
		r.fdMu.RLock()
		fd := r.fd
		r.fdMu.RUnlock()
		pages := uint64(len(r.mapping)+os.Getpagesize()-1) / uint64(os.Getpagesize())
		if allSet(r.warm, 0, pages-1) && fd < 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("warmer did not finish: fd %d, pages warm %v", fd, allSet(r.warm, 0, pages-1))
		}
		time.Sleep(10 * time.Millisecond)
	}
	for i := range dst {
		if want := byte(i*13 + i>>12); dst[i] != want {
			t.Fatalf("byte %d is %#x after warming, the receiver wrote %#x", i, dst[i], want)
		}
	}
}

// TestColdPieceWrites: a large piece on pages not yet warm goes through
// pwrite on the region's memfd (at the region's file offset) and leaves
// them cold (the warmer's job), a small one is copied and warms its pages,
// a warm piece is copied; without a descriptor a large piece is copied (and
// warms its pages). Every write lands where the receiver's own mapping
// shows it.
func TestColdPieceWrites(t *testing.T) {
	buf, err := transport.AllocHost("cold", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Close()
	var st unix.Stat_t
	if err := unix.Fstat(buf.Memory().FD, &st); err != nil {
		t.Fatal(err)
	}
	pg := uint64(os.Getpagesize())
	off := pg + 100 // region starts inside a page of the memfd
	r, err := mapPeerFD(os.Getpid(), buf.Memory().FD, uint64(st.Dev), st.Ino, off, 512<<10, true)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { r.closeFD(); unix.Munmap(r.mapping) }()
	if r.fd < 0 || r.lead != 100 {
		t.Fatalf("region fd %d lead %d, want a descriptor and lead 100", r.fd, r.lead)
	}
	if !r.pwrite([]byte("0123456789"), 7) {
		t.Fatal("pwrite on the region's memfd failed")
	}
	if got := string(buf.Bytes()[off+7 : off+17]); got != "0123456789" {
		t.Fatalf("pwrite landed %q", got)
	}
	pages := func(at, n uint64) (uint64, uint64) { return (r.lead + at) / pg, (r.lead + at + n - 1) / pg }
	put := func(at uint64, b []byte, wantWarm bool) {
		t.Helper()
		piece{dst: r.data[at : at+uint64(len(b))], src: b, rr: r, off: at}.put(false)
		if got := buf.Bytes()[off+at : off+at+uint64(len(b))]; !bytes.Equal(got, b) {
			t.Fatalf("bytes at %d differ from the piece written there", at)
		}
		if f, l := pages(at, uint64(len(b))); allSet(r.warm, f, l) != wantWarm {
			t.Fatalf("piece of %d bytes at %d: pages warm %v, want %v", len(b), at, !wantWarm, wantWarm)
		}
	}
	large := bytes.Repeat([]byte("kvxfer-cold-"), 1<<13)[:pwriteMin+9000]
	put(5000, large, false) // pwrite: cold stays cold
	put(5000, large[1:], false)
	small := large[:3000]
	put(200000, small, true) // copy: warmed
	put(200000, small[1:], true)
	f, l := pages(5000, uint64(len(large)))
	setBits(r.warm, f, l) // as the warmer would
	put(5000, large[2:], true)
	r.closeFD()
	r.closeFD() // idempotent
	if r.pwrite(large, 0) {
		t.Fatal("pwrite after closeFD reported success")
	}
	put(300000, large, true) // no descriptor: copied
}

func TestBitRanges(t *testing.T) {
	bm := make([]atomic.Uint64, 3)
	setBits(bm, 60, 130)
	for _, c := range []struct {
		first, last uint64
		want        bool
	}{{60, 130, true}, {60, 60, true}, {64, 127, true}, {59, 60, false}, {130, 131, false}, {0, 191, false}, {100, 100, true}} {
		if got := allSet(bm, c.first, c.last); got != c.want {
			t.Errorf("allSet(%d, %d) = %v, want %v", c.first, c.last, got, c.want)
		}
	}
	if bm[0].Load() != 0xF<<60 || bm[1].Load() != ^uint64(0) || bm[2].Load() != 0x7 {
		t.Errorf("bits %#x %#x %#x", bm[0].Load(), bm[1].Load(), bm[2].Load())
	}
}

// TestTinyRegionPut: a region shorter than a page (one bit of state) takes
// pieces and warms its page (a bitmap sized by whole pages, not by
// span/page rounded down: that was zero words and panicked at Submit).
func TestTinyRegionPut(t *testing.T) {
	buf, err := transport.AllocHost("tiny", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Close()
	var st unix.Stat_t
	if err := unix.Fstat(buf.Memory().FD, &st); err != nil {
		t.Fatal(err)
	}
	r, err := mapPeerFD(os.Getpid(), buf.Memory().FD, uint64(st.Dev), st.Ino, 50, 100, true)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { r.closeFD(); unix.Munmap(r.mapping) }()
	if len(r.warm) != 1 {
		t.Fatalf("%d bitmap words for a one-page mapping, want 1", len(r.warm))
	}
	src := bytes.Repeat([]byte{7}, 64)
	piece{dst: r.data[10:74], src: src, rr: r, off: 10}.put(false)
	if !bytes.Equal(buf.Bytes()[60:124], src) || !allSet(r.warm, 0, 0) {
		t.Fatal("piece into a sub-page region did not land or did not warm its page")
	}
}
