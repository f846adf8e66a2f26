package main

import (
	"bytes"
	"runtime"
	"testing"
	"unsafe"
)

// TestSegmentSyncSoA: kvx_segment_write_soa lands every entry's bytes in
// the peer's region before it returns and kvx_segment_read_soa reads them
// back; bad arguments and ranges are refused with the status that names
// them, nothing moved.
func TestSegmentSyncSoA(t *testing.T) {
	runtime.LockOSThread() // kvx_last_error is per thread
	defer runtime.UnlockOSThread()
	env := newBatchABI(t)
	base := uint64(uintptr(unsafe.Pointer(&env.src[0])))
	p := func(s []uint64) *cUint64 {
		if s == nil {
			return nil
		}
		return (*cUint64)(unsafe.Pointer(unsafe.SliceData(s)))
	}
	for i := range 4096 {
		env.src[i] = byte(i*7 + 1)
	}
	// Three entries, the remote side reversed: src[0:1K] -> dst[2K:3K], ...
	l := []uint64{base, base + 1024, base + 2048}
	r := []uint64{2048, 1024, 0}
	n := []uint64{1024, 1024, 1024}
	if rc := kvx_segment_write_soa(cSegment(env.seg), 3, p(l), p(r), p(n), cUint32(env.region), 30000); rc != 0 {
		t.Fatalf("kvx_segment_write_soa = %d: %s", rc, lastErrorText())
	}
	for i := range 3 {
		if !bytes.Equal(env.dst[r[i]:r[i]+1024], env.src[i*1024:(i+1)*1024]) {
			t.Fatalf("entry %d: the peer's bytes at %d are not the source's after the call returned", i, r[i])
		}
	}
	// Read the peer's first 3 KiB back into src[8K:11K].
	rl := []uint64{base + 8192}
	rr := []uint64{0}
	rn := []uint64{3072}
	if rc := kvx_segment_read_soa(cSegment(env.seg), 1, p(rl), p(rr), p(rn), cUint32(env.region), 0); rc != 0 {
		t.Fatalf("kvx_segment_read_soa = %d: %s", rc, lastErrorText())
	}
	if !bytes.Equal(env.src[8192:8192+3072], env.dst[:3072]) {
		t.Fatal("the read's bytes are not the peer's after the call returned")
	}

	one := []uint64{base}
	off := []uint64{0}
	ln := []uint64{64}
	cases := []struct {
		name    string
		seg     uint64
		n       uint32
		l, r, k []uint64
		region  uint32
		want    int32
	}{
		{"unknown segment", 0xdead, 1, one, off, ln, env.region, int32(stBadHandle)},
		{"n 0", env.seg, 0, one, off, ln, env.region, int32(stInvalidArgument)},
		{"n over the limit", env.seg, maxBatchCapacity + 1, one, off, ln, env.region, int32(stInvalidArgument)},
		{"local_addrs NULL", env.seg, 1, nil, off, ln, env.region, int32(stInvalidArgument)},
		{"remote_offsets NULL", env.seg, 1, one, nil, ln, env.region, int32(stInvalidArgument)},
		{"lengths NULL", env.seg, 1, one, off, nil, env.region, int32(stInvalidArgument)},
		{"length 0", env.seg, 1, one, off, []uint64{0}, env.region, int32(stInvalidArgument)},
		{"past the peer's region", env.seg, 1, one, []uint64{uint64(len(env.dst)) - 32}, ln, env.region, int32(stOutOfBounds)},
		{"unknown region", env.seg, 1, one, off, ln, env.region + 100, int32(stUnknownRegion)},
		{"local memory not registered", env.seg, 1, []uint64{8}, off, ln, env.region, int32(stNotRegistered)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			for _, read := range []bool{false, true} {
				var rc int32
				if read {
					rc = int32(kvx_segment_read_soa(cSegment(tc.seg), cUint32(tc.n), p(tc.l), p(tc.r), p(tc.k), cUint32(tc.region), 30000))
				} else {
					rc = int32(kvx_segment_write_soa(cSegment(tc.seg), cUint32(tc.n), p(tc.l), p(tc.r), p(tc.k), cUint32(tc.region), 30000))
				}
				if rc != tc.want {
					t.Errorf("read %v: status %d, want %d (%s)", read, rc, tc.want, lastErrorText())
				}
				if msg := lastErrorText(); msg == "" {
					t.Errorf("read %v: no last_error for status %d", read, rc)
				}
			}
		})
	}
}
