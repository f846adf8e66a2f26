package engine

import (
	"bytes"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
)

// loadFakeCUDA builds the fake CUDA libraries of cuda/testdata with gcc and
// loads them for the test (unloaded at its end). It skips without gcc or cgo.
func loadFakeCUDA(t *testing.T) {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("fake CUDA libraries need gcc: %v", err)
	}
	dir := t.TempDir()
	for src, name := range map[string]string{"fake_cudart.c": "libcudart.so.13", "fake_cuda.c": "libcuda.so.1"} {
		if out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", filepath.Join(dir, name), filepath.Join("..", "cuda", "testdata", src)).CombinedOutput(); err != nil {
			t.Fatalf("gcc %s: %v\n%s", src, err, out)
		}
	}
	cuda.Close()
	if err := cuda.Load(cuda.WithLibraryPath(filepath.Join(dir, "libcudart.so.13")), cuda.WithDriverPath(filepath.Join(dir, "libcuda.so.1")),
		cuda.WithNVRTCPath(filepath.Join(dir, "none.so"))); err != nil {
		if errors.Is(err, cuda.ErrNoCgo) {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { cuda.Close() })
}

func testLayout(t *testing.T, pages int) *Layout {
	t.Helper()
	m := ModelConfig{Name: "t", NumLayers: 2, NumKVHeads: 2, HeadDim: 6, DtypeBytes: 2}
	l, err := NewLayout(m, LayoutOptions{PageSize: 16, TPSize: 1, PPSize: 1, NumPages: pages})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestDeviceKVPoolFake: a device pool (fake CUDA) describes itself as
// MemoryCUDA, is zeroed, reads and writes through host copies with bounds
// checks, carries the test pattern (fill, verify, a flipped byte caught),
// extends a CRC32C like a host pool with the same bytes, and closes once.
func TestDeviceKVPoolFake(t *testing.T) {
	loadFakeCUDA(t)
	l := testLayout(t, 8)
	p, err := NewDeviceKVPool(l, "dev-pool", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	m := p.Memory()
	if m.Kind != MemoryCUDA || m.Device != 0 || m.FD != -1 || m.Length != l.PoolBytes() || m.Addr == 0 || m.Addr != p.Addr() {
		t.Fatalf("Memory() = %+v, want MemoryCUDA on device 0, %d bytes", m, l.PoolBytes())
	}
	if dev, ok := p.Device(); !ok || dev != 0 || p.Bytes() != nil {
		t.Fatalf("Device() = %d, %v; Bytes() non-nil = %v", dev, ok, p.Bytes() != nil)
	}
	all := make([]byte, l.PoolBytes())
	all[0] = 1
	if err := p.ReadAt(all, 0); err != nil || bytes.Count(all, []byte{0}) != len(all) {
		t.Fatalf("fresh device pool not zeroed (%v)", err)
	}
	if err := p.WriteAt([]byte("kv"), l.PoolBytes()-1); err == nil || !strings.Contains(err.Error(), "outside") {
		t.Fatalf("WriteAt past the end = %v, want an out-of-range error", err)
	}
	if err := p.ReadAt(make([]byte, 4), l.PoolBytes()); err == nil {
		t.Fatal("ReadAt at the end accepted")
	}

	pages := []int32{5, 1, 2}
	if err := FillPattern(p, 77, pages); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 77, pages); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPattern(p, 78, pages); err == nil || !strings.Contains(err.Error(), "room 78") {
		t.Fatalf("wrong room verified: %v", err)
	}
	// The same bytes in a host pool give the same CRC32C.
	h, err := NewKVPool(l, "host-pool")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := FillPattern(h, 77, pages); err != nil {
		t.Fatal(err)
	}
	var scratch []byte
	off, n := p.ItemOffset(1, 2), l.ItemLen()
	dc, err := p.crcUpdate(0, off, n, &scratch)
	if err != nil {
		t.Fatal(err)
	}
	if hc, _ := h.crcUpdate(0, off, n, &scratch); dc != hc || dc == 0 {
		t.Fatalf("device CRC32C %#x, host %#x", dc, hc)
	}
	// Flip one byte of buffer 1 (layer 1 K), page 2 on the device.
	b := make([]byte, 1)
	if err := p.ReadAt(b, off+13); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 1
	if err := p.WriteAt(b, off+13); err != nil {
		t.Fatal(err)
	}
	err = VerifyPattern(p, 77, pages)
	if err == nil || !strings.Contains(err.Error(), "layer 1 K, token 32 (page 2), head 1, byte 1 ") {
		t.Fatalf("flipped bit: %v", err)
	}

	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := p.ReadAt(b, 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("ReadAt after Close = %v, want ErrClosed", err)
	}
	if err := FillPattern(p, 1, pages); !errors.Is(err, ErrClosed) {
		t.Fatalf("FillPattern after Close = %v, want ErrClosed", err)
	}
}

func TestDeviceKVPoolErrors(t *testing.T) {
	l := testLayout(t, 4)
	if _, err := NewDeviceKVPool(l, "neg", -1); err == nil {
		t.Fatal("device -1 accepted")
	}
	t.Run("no CUDA", func(t *testing.T) {
		if err := cuda.Available(); err == nil || !errors.Is(err, cuda.ErrNotSupported) {
			t.Skipf("CUDA is usable here (%v)", err)
		}
		_, err := NewDeviceKVPool(l, "none", 0)
		if !errors.Is(err, cuda.ErrNotSupported) || !strings.Contains(err.Error(), "cuda:0") {
			t.Fatalf("NewDeviceKVPool without CUDA = %v, want ErrNotSupported naming cuda:0", err)
		}
	})
	t.Run("missing device", func(t *testing.T) {
		loadFakeCUDA(t) // one fake device
		_, err := NewDeviceKVPool(l, "dev3", 3)
		if err == nil || !strings.Contains(err.Error(), "cuda:3") {
			t.Fatalf("NewDeviceKVPool(cuda:3) with one device = %v, want an error naming cuda:3", err)
		}
	})
}
