//go:build cgo

package cuda_test

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/cuda/gpucheck"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// buildFake compiles testdata/<src> into a shared library in a temp dir with
// the given -D flags and returns its path. It skips (not a GPU gate) when gcc
// is not installed, as on the lent GPU machine.
func buildFake(t *testing.T, src, name string, defines ...string) string {
	t.Helper()
	gcc := testenv.RequireTool(t, "gcc", "the fake CUDA libraries")
	out := filepath.Join(t.TempDir(), name)
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", out, filepath.Join("testdata", src)}, defines...)
	if b, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %v: %v\n%s", args, err, b)
	}
	return out
}

// loadFake loads a fake runtime+driver pair and unloads it at test end.
func loadFake(t *testing.T, rtDefines, drvDefines []string) error {
	t.Helper()
	rt := buildFake(t, "fake_cudart.c", "libcudart.so.13", rtDefines...)
	drv := buildFake(t, "fake_cuda.c", "libcuda.so.1", drvDefines...)
	t.Cleanup(func() { cuda.Close() })
	return cuda.Load(cuda.WithLibraryPath(rt), cuda.WithDriverPath(drv), cuda.WithNVRTCPath(filepath.Join(t.TempDir(), "no-libnvrtc.so")))
}

func TestLoadLibraryMissing(t *testing.T) {
	drv := buildFake(t, "fake_cuda.c", "libcuda.so.1")
	tests := []struct {
		name string
		opts []cuda.Option
	}{
		{"runtime", []cuda.Option{cuda.WithDriverPath(drv), cuda.WithLibraryPath("/nonexistent/libcudart.so.13")}},
		{"driver", []cuda.Option{cuda.WithDriverPath("/nonexistent/libcuda.so.1")}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			defer cuda.Close()
			err := cuda.Load(tc.opts...)
			if !errors.Is(err, cuda.ErrNotSupported) || !errors.Is(err, cuda.ErrLibraryNotFound) {
				t.Fatalf("Load = %v, want ErrNotSupported and ErrLibraryNotFound", err)
			}
			if _, err := cuda.DeviceCount(); !errors.Is(err, cuda.ErrNotLoaded) {
				t.Fatalf("DeviceCount after failed Load = %v, want ErrNotLoaded", err)
			}
			if _, err := cuda.Malloc(0, 4096); !errors.Is(err, cuda.ErrNotLoaded) {
				t.Fatalf("Malloc after failed Load = %v, want ErrNotLoaded", err)
			}
		})
	}
}

func TestLoadRequiredSymbolMissing(t *testing.T) {
	err := loadFake(t, []string{"-DFAKE_NO_COUNT"}, nil)
	if !errors.Is(err, cuda.ErrNotSupported) || !errors.Is(err, cuda.ErrSymbolMissing) {
		t.Fatalf("Load = %v, want ErrNotSupported and ErrSymbolMissing", err)
	}
}

func TestLoadNoDevice(t *testing.T) {
	err := loadFake(t, []string{"-DFAKE_DEVICES=0"}, nil)
	if !errors.Is(err, cuda.ErrNotSupported) || !errors.Is(err, cuda.ErrNoDevice) {
		t.Fatalf("Load = %v, want ErrNotSupported and ErrNoDevice", err)
	}
}

func TestFakeDevicePresent(t *testing.T) {
	if err := loadFake(t, []string{"-DFAKE_DEVICES=2"}, nil); err != nil {
		t.Fatalf("Load: %v", err)
	}
	if err := cuda.Load(); err != nil { // idempotent while loaded
		t.Fatalf("second Load: %v", err)
	}
	n, err := cuda.DeviceCount()
	if err != nil || n != 2 {
		t.Fatalf("DeviceCount = %d, %v; want 2", n, err)
	}
	p, err := cuda.Device(1)
	if err != nil {
		t.Fatalf("Device(1): %v", err)
	}
	want := cuda.DeviceProps{Ordinal: 1, Name: "Fake H200", PCIBusID: "0000:19:00.0", TotalMemory: 141 << 30,
		FreeMemory: 1 << 30, ComputeMajor: 9, ComputeMinor: 0, DmaBuf: true}
	if p != want {
		t.Fatalf("Device(1) = %+v\nwant %+v", p, want)
	}
	if _, err := cuda.Device(2); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Device(2) = %v, want ErrInvalidValue", err)
	}
	if rt, drv := cuda.Versions(); rt != 13000 || drv != 13000 {
		t.Fatalf("Versions = %d, %d", rt, drv)
	}

	// Device memory round trip through every copy flavour.
	const size = 8192
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i * 7)
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
	for i, b := range pinned.Bytes() {
		if b != 0 {
			t.Fatalf("AllocMapped byte %d = %#x, want zeroed memory", i, b)
		}
	}
	s, err := cuda.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.MemcpyAsync(pinned.Host(), uintptr(d2), size, cuda.DeviceToHost); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Stream.Close: %v", err)
	}
	if err := s.Synchronize(); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Synchronize after Close = %v, want ErrInvalidValue", err)
	}
	got := make([]byte, size)
	if err := cuda.CopyFromDevice(0, got, d2); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(src) || string(pinned.Bytes()) != string(src) {
		t.Fatal("copied bytes differ from the source")
	}
	if err := cuda.Memset(0, d1, 0xab, 16); err != nil {
		t.Fatal(err)
	}
	if err := cuda.CopyFromDevice(0, got[:16], d1); err != nil || got[0] != 0xab || got[15] != 0xab {
		t.Fatalf("Memset then copy: %v %x", err, got[:16])
	}

	// Pointer attributes.
	for _, tc := range []struct {
		name string
		p    uintptr
		want cuda.MemoryType
	}{
		{"device", uintptr(d1) + 100, cuda.MemoryDevice},
		{"mapped host", pinned.Host(), cuda.MemoryHost},
		{"go heap", uintptr(unsafe.Pointer(&src[0])), cuda.MemoryUnregistered},
	} {
		info, err := cuda.PointerAttributes(tc.p)
		if err != nil || info.Type != tc.want {
			t.Errorf("PointerAttributes(%s) = %+v, %v; want type %s", tc.name, info, err, tc.want)
		}
		if tc.want == cuda.MemoryUnregistered && info.Device != -1 {
			t.Errorf("PointerAttributes(%s).Device = %d, want -1", tc.name, info.Device)
		}
		// The driver's answer (cuPointerGetAttribute) agrees: only device
		// memory is a device pointer.
		dev, ok, err := cuda.PointerDevice(tc.p)
		if err != nil || ok != (tc.want == cuda.MemoryDevice) || (ok && dev != 0) || (!ok && dev != -1) {
			t.Errorf("PointerDevice(%s) = %d, %v, %v; want device memory %v on device 0", tc.name, dev, ok, err, tc.want == cuda.MemoryDevice)
		}
	}

	// Optional symbols absent from this fake: typed error, no crash.
	_, err = cuda.IPCGetHandle(0, d1)
	var ce *cuda.Error
	if !errors.As(err, &ce) || ce.Op != "cudaIpcGetMemHandle" || ce.Code != cuda.CodeSymbolMissing ||
		!errors.Is(err, cuda.ErrSymbolMissing) || !errors.Is(err, cuda.ErrNotSupported) {
		t.Fatalf("IPCGetHandle on a runtime without it = %v, want *Error{cudaIpcGetMemHandle, symbol missing}", err)
	}
	pg := uintptr(os.Getpagesize())
	big, err := cuda.Malloc(0, uint64(3*pg))
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, big)
	if _, err := cuda.DmaBufFD((uintptr(big)+pg-1)&^(pg-1), uint64(pg)); !errors.Is(err, cuda.ErrNotSupported) {
		t.Fatalf("DmaBufFD without cuMemGetHandleForAddressRange = %v, want ErrNotSupported", err)
	}

	// Errors carry the library's own message.
	_, err = cuda.Malloc(0, 1<<41)
	if !errors.Is(err, cuda.ErrOutOfMemory) || !errors.As(err, &ce) || ce.Code != 2 {
		t.Fatalf("huge Malloc = %v, want ErrOutOfMemory code 2", err)
	}
	if msg := err.Error(); !contains(msg, "fake: out of memory") {
		t.Fatalf("error text %q lacks the library's message", msg)
	}

	if err := pinned.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pinned.Close(); err != nil {
		t.Fatalf("second HostMem.Close: %v", err)
	}
}

func TestFakeDmaBuf(t *testing.T) {
	if err := loadFake(t, nil, []string{"-DFAKE_DMABUF"}); err != nil {
		t.Fatalf("Load: %v", err)
	}
	pg := uint64(os.Getpagesize())
	d, err := cuda.Malloc(0, 4*pg)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d)
	aligned := (uintptr(d) + uintptr(pg) - 1) &^ (uintptr(pg) - 1)
	fd, err := cuda.DmaBufFD(aligned, 2*pg)
	if err != nil {
		t.Fatalf("DmaBufFD: %v", err)
	}
	if err := syscall.Close(fd); err != nil {
		t.Fatalf("close dma-buf fd %d: %v", fd, err)
	}
	for _, tc := range []struct {
		name string
		p    uintptr
		n    uint64
	}{
		{"unaligned address", aligned + 1, pg},
		{"unaligned size", aligned, pg + 1},
		{"zero size", aligned, 0},
	} {
		if _, err := cuda.DmaBufFD(tc.p, tc.n); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("DmaBufFD(%s) = %v, want ErrInvalidValue", tc.name, err)
		}
	}
	fd, off, err := cuda.DmaBufRange(aligned+100, pg)
	if err != nil || off != 100 {
		t.Fatalf("DmaBufRange(unaligned) = fd %d off %d, %v; want offset 100", fd, off, err)
	}
	syscall.Close(fd)
	host := make([]byte, 64)
	if _, err := cuda.DmaBufFD(uintptr(unsafe.Pointer(&host[0])), pg); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("DmaBufFD(host memory) = %v, want ErrInvalidValue", err)
	}
}

// TestFakeModule drives the binding's module calls through the fake driver
// (which knows one kernel, kvx_check_room: out[0] = *slot, out[1] =
// *slot == expected): load, launch with three parameters in order, a missing
// kernel and a closed module refused, Close idempotent.
func TestFakeModule(t *testing.T) {
	if err := loadFake(t, nil, nil); err != nil {
		t.Fatalf("Load: %v", err)
	}
	if _, err := cuda.LoadModule(0, "not ptx"); err == nil {
		t.Fatal("LoadModule(garbage) succeeded")
	}
	if _, err := cuda.LoadModule(7, gpucheck.ProofPTX); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("LoadModule(device 7) = %v, want ErrInvalidValue", err)
	}
	mod, err := cuda.LoadModule(0, gpucheck.ProofPTX)
	if err != nil {
		t.Fatalf("LoadModule: %v", err)
	}
	mem, err := cuda.AllocMapped(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	binary.LittleEndian.PutUint64(mem.Bytes(), 42)
	out := mem.DevicePtr() + 16
	if err := mod.Launch3(gpucheck.ProofKernelName, uint64(mem.DevicePtr()), 42, uint64(out)); err != nil {
		t.Fatalf("Launch3: %v", err)
	}
	if got, ok := binary.LittleEndian.Uint64(mem.Bytes()[16:]), binary.LittleEndian.Uint64(mem.Bytes()[24:]); got != 42 || ok != 1 {
		t.Fatalf("kernel wrote %d, %d; want 42, 1", got, ok)
	}
	if err := mod.Launch3("no_such_kernel", 0, 0, 0); err == nil || !strings.Contains(err.Error(), "cuModuleGetFunction") {
		t.Fatalf("Launch3(missing kernel) = %v, want a cuModuleGetFunction error", err)
	}
	if err := mod.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := mod.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := mod.Launch3(gpucheck.ProofKernelName, 0, 0, 0); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Launch3 after Close = %v, want ErrInvalidValue", err)
	}
	if _, err := cuda.CompileNVRTC(0, gpucheck.ProofSource, "k.cu"); !errors.Is(err, cuda.ErrLibraryNotFound) {
		t.Fatalf("CompileNVRTC without NVRTC = %v, want ErrLibraryNotFound", err)
	}
}

// TestFakeProofKernel runs gpucheck.CheckRoom through the fake driver, whose launch
// executes the kernel's logic on the host: it checks the slot pointer,
// expected room and result buffer reach the kernel in order.
func TestFakeProofKernel(t *testing.T) {
	if err := loadFake(t, nil, nil); err != nil {
		t.Fatalf("Load: %v", err)
	}
	ring, err := cuda.AllocMapped(0, 4*64)
	if err != nil {
		t.Fatal(err)
	}
	defer ring.Close()
	const room = uint64(0x7abc_def0_1234_5678)
	binary.LittleEndian.PutUint64(ring.Bytes()[2*64:], room)
	slot := ring.DevicePtr() + 2*64

	got, mode, err := gpucheck.CheckRoom(0, slot, room, gpucheck.ProofAuto)
	if err != nil || got != room || mode != gpucheck.ProofBuiltinPTX {
		t.Fatalf("CheckRoom(auto, no NVRTC) = %#x, %s, %v; want %#x via ptx", got, mode, err, room)
	}
	got, _, err = gpucheck.CheckRoom(0, slot, room+1, gpucheck.ProofBuiltinPTX)
	if !errors.Is(err, gpucheck.ErrRoomMismatch) || got != room {
		t.Fatalf("CheckRoom(wrong room) = %#x, %v; want ErrRoomMismatch reading %#x", got, err, room)
	}
	if _, _, err := gpucheck.CheckRoom(0, slot, room, gpucheck.ProofNVRTC); !errors.Is(err, cuda.ErrLibraryNotFound) {
		t.Fatalf("CheckRoom(nvrtc) without NVRTC = %v, want ErrLibraryNotFound", err)
	}
	if _, _, err := gpucheck.CheckRoom(0, slot, room, "bogus"); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("CheckRoom(bogus mode) = %v, want ErrInvalidValue", err)
	}
}

func TestCloseIdempotent(t *testing.T) {
	if err := cuda.Close(); err != nil {
		t.Fatal(err)
	}
	if err := cuda.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cuda.Device(0); !errors.Is(err, cuda.ErrNotLoaded) {
		t.Fatalf("Device after Close = %v, want ErrNotLoaded", err)
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

func TestFakeRegisterHost(t *testing.T) {
	if err := loadFake(t, nil, nil); err != nil {
		t.Fatalf("Load: %v", err)
	}
	b, err := syscall.Mmap(-1, 0, 8192, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(b)
	d, err := cuda.RegisterHost(0, b)
	if err != nil || d == 0 {
		t.Fatalf("RegisterHost = %#x, %v", d, err)
	}
	if info, err := cuda.PointerAttributes(uintptr(unsafe.Pointer(&b[100]))); err != nil || info.Type != cuda.MemoryHost {
		t.Fatalf("PointerAttributes(registered) = %+v, %v; want host", info, err)
	}
	if _, err := cuda.RegisterHost(0, b); err == nil {
		t.Fatal("registering the same range twice succeeded")
	}
	if _, err := cuda.RegisterHost(0, nil); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("RegisterHost(empty) = %v, want ErrInvalidValue", err)
	}
	if err := cuda.UnregisterHost(0, b); err != nil {
		t.Fatal(err)
	}
	if info, _ := cuda.PointerAttributes(uintptr(unsafe.Pointer(&b[0]))); info.Type != cuda.MemoryUnregistered {
		t.Fatalf("after UnregisterHost: %+v", info)
	}
}
