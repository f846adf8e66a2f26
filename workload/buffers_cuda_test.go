package workload

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// loadFakeCUDA builds the fake CUDA libraries of cuda/testdata with gcc and
// loads them for the test (unloaded at its end). It skips without gcc or cgo.
func loadFakeCUDA(t *testing.T) {
	t.Helper()
	testenv.BuildFakeCUDA(t, nil, nil).Load(t)
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

// TestDeviceKVBuffersFake: device buffers (fake CUDA) describe themselves as
// MemoryCUDA, are zeroed, read and write through host copies with bounds
// checks, carry the test pattern (fill, verify, a flipped byte caught), and
// close once. Both the per-buffer and the contiguous allocation.
func TestDeviceKVBuffersFake(t *testing.T) {
	loadFakeCUDA(t)
	l := testLayout(t, 8)
	for _, contiguous := range []bool{false, true} {
		p, err := NewKVBuffers(l, BufferOptions{Name: "dev", Device: 0, Contiguous: contiguous})
		if err != nil {
			t.Fatal(err)
		}
		a := p.Args()
		if _, err := a.Geometry(); err != nil {
			t.Fatal(err)
		}
		for i, m := range a.KVBuffers {
			if m.Kind != transport.MemoryCUDA || m.Device != 0 || m.FD != -1 || m.Length != l.BufferLen() || m.Addr == 0 || m.ItemLen != l.ItemLen() {
				t.Fatalf("buffer %d = %+v, want MemoryCUDA on device 0, %d bytes", i, m, l.BufferLen())
			}
		}
		if dev, ok := p.Device(); !ok || dev != 0 || p.Bytes(0) != nil || a.GPUID != 0 {
			t.Fatalf("Device() = %d, %v; Bytes(0) non-nil = %v; gpu_id %d", dev, ok, p.Bytes(0) != nil, a.GPUID)
		}
		all := make([]byte, l.BufferLen())
		all[0] = 1
		if err := p.ReadAt(1, all, 0); err != nil || bytes.Count(all, []byte{0}) != len(all) {
			t.Fatalf("fresh device buffer not zeroed (%v)", err)
		}
		if err := p.WriteAt(0, []byte("kv"), l.BufferLen()-1); err == nil || !strings.Contains(err.Error(), "outside") {
			t.Fatalf("WriteAt past the end = %v, want an out-of-range error", err)
		}
		if err := p.ReadAt(0, make([]byte, 4), l.BufferLen()); err == nil {
			t.Fatal("ReadAt at the end accepted")
		}
		pages := []int32{5, 1, 2}
		if err := FillPattern(p, 77, pages, 0); err != nil {
			t.Fatal(err)
		}
		if err := VerifyPattern(p, 77, pages, 0); err != nil {
			t.Fatal(err)
		}
		if err := VerifyPattern(p, 78, pages, 0); err == nil || !strings.Contains(err.Error(), "room 78") {
			t.Fatalf("wrong room verified: %v", err)
		}
		// Flip one byte of buffer 1 (layer 1 K), page 2 on the device.
		off := 2 * l.ItemLen()
		b := make([]byte, 1)
		if err := p.ReadAt(1, b, off+13); err != nil {
			t.Fatal(err)
		}
		b[0] ^= 1
		if err := p.WriteAt(1, b, off+13); err != nil {
			t.Fatal(err)
		}
		err = VerifyPattern(p, 77, pages, 0)
		if err == nil || !strings.Contains(err.Error(), "layer 1 K, token 32 (page 2), head 1, byte 1 ") {
			t.Fatalf("flipped bit: %v", err)
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		if err := p.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		if err := p.ReadAt(0, b, 0); !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("ReadAt after Close = %v, want ErrClosed", err)
		}
		if err := FillPattern(p, 1, pages, 0); !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("FillPattern after Close = %v, want ErrClosed", err)
		}
	}
}

func TestDeviceKVBuffersErrors(t *testing.T) {
	l := testLayout(t, 4)
	t.Run("no CUDA", func(t *testing.T) {
		if err := cuda.Available(); err == nil || !errors.Is(err, cuda.ErrNotSupported) {
			t.Skipf("CUDA is usable here (%v)", err)
		}
		_, err := NewKVBuffers(l, BufferOptions{Name: "none", Device: 0})
		if !errors.Is(err, cuda.ErrNotSupported) || !strings.Contains(err.Error(), "cuda:0") {
			t.Fatalf("NewKVBuffers without CUDA = %v, want ErrNotSupported naming cuda:0", err)
		}
	})
	t.Run("missing device", func(t *testing.T) {
		loadFakeCUDA(t) // one fake device
		_, err := NewKVBuffers(l, BufferOptions{Name: "dev3", Device: 3})
		if err == nil || !strings.Contains(err.Error(), "cuda:3") {
			t.Fatalf("NewKVBuffers(cuda:3) with one device = %v, want an error naming cuda:3", err)
		}
	})
}
