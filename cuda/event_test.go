//go:build cgo

package cuda_test

import (
	"bytes"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/cuda"
)

// checkEventGate is the stream-ordering check both the fake and a real GPU
// run: on a stream, a gate (the stand-in for a kernel of unknown length),
// then a copy into dst, then an event. Before the gate opens the event is
// pending and dst untouched, however long one waits; once it opens the
// event completes and dst holds the bytes. This is what a prefill relies on
// when it records an event after a layer's KV write and hands it to
// SendLayers.
func checkEventGate(t *testing.T, dev int) {
	t.Helper()
	const size = 1 << 20
	src, err := cuda.AllocMapped(dev, size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*13 + 1)
	}
	dst, err := cuda.Malloc(dev, size)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(dev, dst)
	if err := cuda.Memset(dev, dst, 0, size); err != nil {
		t.Fatal(err)
	}
	s, err := cuda.NewStream(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ev, err := cuda.NewEvent(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	if done, err := ev.Query(); err != nil || !done {
		t.Fatalf("Query of a never-recorded event = %v, %v; want complete (CUDA's definition)", done, err)
	}
	g, err := s.Gate()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := s.MemcpyAsync(uintptr(dst), src.Host(), size, cuda.HostToDevice); err != nil {
		t.Fatal(err)
	}
	if err := s.Record(ev); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // not a timing assertion: nothing may happen, however long
	if done, err := ev.Query(); err != nil || done {
		t.Fatalf("Query behind a closed gate = %v, %v; want pending", done, err)
	}
	if done, err := ev.Handle().Query(); err != nil || done {
		t.Fatalf("EventHandle.Query behind a closed gate = %v, %v; want pending", done, err)
	}
	got := make([]byte, size)
	if err := cuda.CopyFromDevice(dev, got, dst); err != nil {
		t.Fatal(err)
	}
	if bytes.Count(got, []byte{0}) != size {
		t.Fatal("the copy behind the closed gate already ran")
	}
	g.Open()
	if err := ev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := ev.Query(); err != nil || !done {
		t.Fatalf("Query after the gate opened and Synchronize = %v, %v", done, err)
	}
	if err := cuda.CopyFromDevice(dev, got, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, src.Bytes()) {
		t.Fatal("the copy behind the gate did not land")
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Fatalf("second Gate.Close: %v", err)
	}
	h := ev.Handle()
	if err := ev.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ev.Close(); err != nil {
		t.Fatalf("second Event.Close: %v", err)
	}
	if _, err := ev.Query(); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Query after Close = %v, want ErrInvalidValue", err)
	}
	if err := s.Record(ev); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Record of a closed event = %v, want ErrInvalidValue", err)
	}
	if h.Event == 0 || ev.Handle().Event != 0 {
		t.Fatalf("Handle before/after Close = %#x/%#x", h.Event, ev.Handle().Event)
	}
}

func TestEventGateFake(t *testing.T) {
	if err := loadFake(t, nil, nil); err != nil {
		t.Fatal(err)
	}
	checkEventGate(t, 0)
	// A handle CUDA does not know, and a zero handle: typed errors.
	var x [64]byte
	_, err := cuda.EventHandle{Device: 0, Event: uintptrOf(&x[0])}.Query()
	var ce *cuda.Error
	if !errors.As(err, &ce) || ce.Op != "cudaEventQuery" || ce.Code != 400 || !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Query of an unknown handle = %v, want *Error{cudaEventQuery, 400} matching ErrInvalidValue", err)
	}
	if _, err := (cuda.EventHandle{}).Query(); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Query of handle 0 = %v, want ErrInvalidValue", err)
	}
	if _, err := (cuda.EventHandle{Device: 5, Event: 1}).Query(); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("Query on device 5 of 1 = %v, want ErrInvalidValue", err)
	}
}

func TestEventSymbolsMissingFake(t *testing.T) {
	if err := loadFake(t, []string{"-DFAKE_NO_EVENTS"}, nil); err != nil {
		t.Fatal(err)
	}
	_, err := cuda.NewEvent(0)
	if !errors.Is(err, cuda.ErrSymbolMissing) || !errors.Is(err, cuda.ErrNotSupported) {
		t.Fatalf("NewEvent without cudaEventCreateWithFlags = %v, want ErrSymbolMissing", err)
	}
	s, err := cuda.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Gate(); !errors.Is(err, cuda.ErrSymbolMissing) {
		t.Fatalf("Gate without cudaLaunchHostFunc = %v, want ErrSymbolMissing", err)
	}
}

func TestEventNotLoaded(t *testing.T) {
	cuda.Close()
	if _, err := cuda.NewEvent(0); !errors.Is(err, cuda.ErrNotLoaded) {
		t.Fatalf("NewEvent before Load = %v, want ErrNotLoaded", err)
	}
	if _, err := (cuda.EventHandle{Event: 1}).Query(); !errors.Is(err, cuda.ErrNotLoaded) {
		t.Fatalf("EventHandle.Query before Load = %v, want ErrNotLoaded", err)
	}
}

func TestGPUEventGate(t *testing.T) {
	requireGPU(t)
	checkEventGate(t, 0)
}

// uintptrOf is a Go address as a handle value the fake does not know (it is
// only compared, never dereferenced).
func uintptrOf(p *byte) uintptr { return uintptr(unsafe.Pointer(p)) }
