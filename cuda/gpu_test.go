//go:build cgo

package cuda_test

import (
	"encoding/binary"
	"errors"
	"os"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/cuda/gpucheck"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// requireGPU loads the real CUDA libraries. It skips with the reason when
// CUDA is not supported here, unless KVXFER_REQUIRE_GPU is set (the lent GPU
// machine), where a skip would hide a broken probe; a failed probe is fatal.
func requireGPU(tb testing.TB) {
	tb.Helper()
	testenv.RequireGPU(tb)
}

func TestGPUDevices(t *testing.T) {
	requireGPU(t)
	n, err := cuda.DeviceCount()
	if err != nil || n < 1 {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	rt, drv := cuda.Versions()
	rtp, drvp, _ := cuda.Libraries()
	t.Logf("runtime %d (%s), driver %d (%s)", rt, rtp, drv, drvp)
	for i := 0; i < n; i++ {
		p, err := cuda.Device(i)
		if err != nil {
			t.Fatalf("Device(%d): %v", i, err)
		}
		if p.Name == "" || p.PCIBusID == "" || p.TotalMemory == 0 || p.ComputeMajor == 0 {
			t.Fatalf("Device(%d) incomplete: %+v", i, p)
		}
		t.Logf("device %d: %+v", i, p)
	}
}

func TestGPUMemoryRoundTrip(t *testing.T) {
	requireGPU(t)
	const size = 4 << 20
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i*31 + i>>8)
	}
	d1, err := cuda.Malloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d1)
	d2, err := cuda.Malloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d2)
	if err := cuda.CopyToDevice(0, d1, src); err != nil {
		t.Fatal(err)
	}
	if err := cuda.Memcpy(0, uintptr(d2), uintptr(d1), size, cuda.DeviceToDevice); err != nil {
		t.Fatal(err)
	}
	pinned, err := cuda.AllocMapped(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer pinned.Close()
	s, err := cuda.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.MemcpyAsync(pinned.Host(), uintptr(d2), size, cuda.DeviceToHost); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if string(pinned.Bytes()) != string(src) {
		t.Fatal("device -> pinned host bytes differ")
	}
	got := make([]byte, size)
	if err := cuda.CopyFromDevice(0, got, d2); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(src) {
		t.Fatal("device -> Go bytes differ")
	}
	for _, tc := range []struct {
		name string
		p    uintptr
		want cuda.MemoryType
	}{
		{"device", uintptr(d1), cuda.MemoryDevice},
		{"mapped host", pinned.Host(), cuda.MemoryHost},
		{"go heap", uintptr(unsafe.Pointer(&got[0])), cuda.MemoryUnregistered},
	} {
		info, err := cuda.PointerAttributes(tc.p)
		if err != nil || info.Type != tc.want {
			t.Errorf("PointerAttributes(%s) = %+v, %v; want %s", tc.name, info, err, tc.want)
		}
	}
	if _, err := cuda.IPCGetHandle(0, d1); err != nil {
		t.Errorf("IPCGetHandle: %v", err)
	}
}

func TestGPUDmaBuf(t *testing.T) {
	requireGPU(t)
	pg := uint64(os.Getpagesize())
	size := uint64(2 << 20)
	d, err := cuda.Malloc(0, size+pg)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d)
	aligned := (uintptr(d) + uintptr(pg) - 1) &^ uintptr(pg-1)
	fd, err := cuda.DmaBufFD(aligned, size)
	if errors.Is(err, cuda.ErrNotSupported) {
		// Whether dma-buf works depends on the kernel and driver (open
		// kernel modules); the RDMA path falls back to peer memory.
		t.Logf("dma-buf export not supported on this host (RDMA falls back to peer memory): %v", err)
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("dma-buf fd %d for %d bytes", fd, size)
	syscall.Close(fd)
}

// TestGPUProofKernel is the GPU proof: a kernel reads a ring slot's
// bootstrap_room through the slot's device pointer (mapped pinned memory)
// and compares it with the expected room. Both build paths run: NVRTC (when
// installed) and the built-in PTX.
func TestGPUProofKernel(t *testing.T) {
	requireGPU(t)
	ring, err := cuda.AllocMapped(0, 16*64)
	if err != nil {
		t.Fatal(err)
	}
	defer ring.Close()
	for slot := 0; slot < 16; slot++ {
		binary.LittleEndian.PutUint64(ring.Bytes()[slot*64:], uint64(1000+slot))
	}
	for _, mode := range []gpucheck.ProofMode{gpucheck.ProofNVRTC, gpucheck.ProofBuiltinPTX} {
		t.Run(string(mode), func(t *testing.T) {
			got, used, err := gpucheck.CheckRoom(0, ring.DevicePtr()+5*64, 1005, mode)
			if mode == gpucheck.ProofNVRTC && errors.Is(err, cuda.ErrLibraryNotFound) {
				t.Skipf("NVRTC not installed: %v", err)
			}
			if err != nil || got != 1005 || used != mode {
				t.Fatalf("CheckRoom(slot 5) = %d via %s, %v; want 1005", got, used, err)
			}
			// The host changes the slot; the GPU must see the new room.
			binary.LittleEndian.PutUint64(ring.Bytes()[5*64:], 77)
			got, _, err = gpucheck.CheckRoom(0, ring.DevicePtr()+5*64, 1005, mode)
			if !errors.Is(err, gpucheck.ErrRoomMismatch) || got != 77 {
				t.Fatalf("CheckRoom after rewrite = %d, %v; want 77 and ErrRoomMismatch", got, err)
			}
			binary.LittleEndian.PutUint64(ring.Bytes()[5*64:], 1005)
		})
	}
}

// TestGPUPointerDevice: the driver's cuPointerGetAttribute tells device
// memory (its ordinal) from mapped pinned host memory and plain host memory
// on a real GPU, as kvx_register_memory's location detection relies on.
func TestGPUPointerDevice(t *testing.T) {
	requireGPU(t)
	d, err := cuda.Malloc(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d)
	pinned, err := cuda.AllocMapped(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer pinned.Close()
	plain := make([]byte, 4096)
	for _, tc := range []struct {
		name   string
		p      uintptr
		device bool
	}{
		{"device", uintptr(d), true},
		{"inside device", uintptr(d) + 12345, true},
		{"mapped pinned host", pinned.Host(), false},
		{"go heap", uintptr(unsafe.Pointer(&plain[0])), false},
	} {
		dev, ok, err := cuda.PointerDevice(tc.p)
		if err != nil || ok != tc.device || (ok && dev != 0) {
			t.Errorf("PointerDevice(%s) = %d, %v, %v; want device memory %v on device 0", tc.name, dev, ok, err, tc.device)
		}
	}
}
