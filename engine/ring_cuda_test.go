package engine

import (
	"errors"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/cuda/gpucheck"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// TestAutoRingMemoryHostFallback: with no CUDA the ring is plain host memory
// on the same code path (DevicePtr 0, memfd-backed).
func TestAutoRingMemoryHostFallback(t *testing.T) {
	if err := cuda.Available(); err == nil || !errors.Is(err, cuda.ErrNotSupported) {
		t.Skipf("CUDA is usable here (%v); the fallback is exercised on hosts without it", err)
	}
	r, err := NewMetaRing(8, AutoRingMemory)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if d := r.RingMem().DevicePtr(); d != 0 {
		t.Fatalf("DevicePtr = %#x without CUDA, want 0", d)
	}
	if m := r.Memory(); m.FD < 0 || m.Kind != transport.MemoryHost || m.Length < 8*RecordSize {
		t.Fatalf("ring memory = %+v, want memfd-backed host memory", m)
	}
}

// TestRingGPUProof is the GPU proof on the engine's own ring: a record
// written by the host with EncodeBody is read by a CUDA kernel through the
// ring's device pointer, which checks its bootstrap_room. It needs a GPU
// (KVXFER_REQUIRE_GPU=1 turns the skip into a failure).
func TestRingGPUProof(t *testing.T) {
	testenv.RequireGPU(t)
	r, err := NewMetaRing(64, CUDARingMemory(0))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	base := r.RingMem().DevicePtr()
	if base == 0 {
		t.Fatal("ring on a CUDA host has no device pointer")
	}
	for i := 0; i < 3; i++ {
		slot, gen, err := r.Acquire()
		if err != nil {
			t.Fatal(err)
		}
		room := uint64(0x0123_4567_89ab_cd00) + uint64(slot)
		rec := MetaRecord{Room: room, Generation: gen, PageCount: 4, Producer: 1, ByteCount: 4 << 12}
		b := r.RingMem().Bytes()[r.Offset(slot):]
		rec.EncodeBody(b)
		rec.EncodeCommit(b)
		got, mode, err := gpucheck.CheckRoom(0, cuda.DevicePtr(base+uintptr(r.Offset(slot))), room, gpucheck.ProofAuto)
		if err != nil {
			t.Fatalf("slot %d: GPU read room %#x via %s: %v", slot, got, mode, err)
		}
		t.Logf("slot %d: GPU read bootstrap_room %#x via %s", slot, got, mode)
	}
}

// TestRingFakeCUDA runs the CUDA ring path against the fake CUDA libraries
// of cuda/testdata (built with gcc): registration gives a device alias, the
// fake "kernel" reads the record's room through it, and Close unregisters.
// Without cudaHostRegister the ring falls back to cudaHostAlloc memory (no fd).
func TestRingFakeCUDA(t *testing.T) {
	for _, tc := range []struct {
		name    string
		defines []string
		wantFD  bool
	}{
		{"registered memfd", nil, true},
		{"cudaHostAlloc fallback", []string{"-DFAKE_NO_HOST_REGISTER"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testenv.BuildFakeCUDA(t, tc.defines, tc.defines).Load(t)
			r, err := NewMetaRing(16, CUDARingMemory(0))
			if err != nil {
				t.Fatal(err)
			}
			base := r.RingMem().DevicePtr()
			if base == 0 || (r.Memory().FD >= 0) != tc.wantFD {
				t.Fatalf("CUDA ring: DevicePtr %#x, FD %d; want a device alias, fd present = %v", base, r.Memory().FD, tc.wantFD)
			}
			slot, gen, err := r.Acquire()
			if err != nil {
				t.Fatal(err)
			}
			rec := MetaRecord{Room: 4242, Generation: gen}
			b := r.RingMem().Bytes()[r.Offset(slot):]
			rec.EncodeBody(b)
			rec.EncodeCommit(b)
			if got, _, err := gpucheck.CheckRoom(0, cuda.DevicePtr(base+uintptr(r.Offset(slot))), 4242, gpucheck.ProofAuto); err != nil || got != 4242 {
				t.Fatalf("CheckRoom = %d, %v; want 4242", got, err)
			}
			if _, _, err := gpucheck.CheckRoom(0, cuda.DevicePtr(base+uintptr(r.Offset(slot))), 4243, gpucheck.ProofAuto); !errors.Is(err, gpucheck.ErrRoomMismatch) {
				t.Fatalf("CheckRoom(wrong room) = %v, want ErrRoomMismatch", err)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if err := r.Close(); err != nil {
				t.Fatalf("second Close: %v", err)
			}
		})
	}
}
