package tcp

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// fakeDevice treats "device" addresses as host addresses, so the bounce path
// can be tested without a GPU. failTo/failFrom make the next copies fail.
type fakeDevice struct {
	failTo, failFrom atomic.Int32
}

func (*fakeDevice) check(transport.Memory) error { return nil }

func (f *fakeDevice) copyFromDevice(dst []byte, src uintptr, _ int) error {
	if f.failFrom.Add(-1) >= 0 {
		return errors.New("fake cuMemcpyDtoH failure")
	}
	copy(dst, hostSlice(src, uint64(len(dst))))
	return nil
}

func (f *fakeDevice) copyToDevice(dst uintptr, _ int, src []byte) error {
	if f.failTo.Add(-1) >= 0 {
		return errors.New("fake cuMemcpyHtoD failure")
	}
	copy(hostSlice(dst, uint64(len(src))), src)
	return nil
}

// TestDeviceMemoryRefusedWithoutCopier runs with the copier a host without
// the NVIDIA driver gets (noDevice), whatever this host has: on a GPU host
// defaultCopier installs the CUDA copier, which would accept the range.
func TestDeviceMemoryRefusedWithoutCopier(t *testing.T) {
	saved := deviceCopier
	deviceCopier = noDevice{}
	defer func() { deviceCopier = saved }()
	tr, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if tr.Capabilities().Has(transport.CapDeviceMemory) {
		t.Errorf("CapDeviceMemory set without a CUDA copier")
	}
	_, err = tr.RegisterMemory(transport.Memory{Addr: 0x7000_0000_0000, Length: 1 << 20, Kind: transport.MemoryCUDA, Device: 0, FD: -1})
	if !errors.Is(err, transport.ErrUnsupportedMemory) {
		t.Fatalf("RegisterMemory(cuda) = %v, want ErrUnsupportedMemory", err)
	}
	if !strings.Contains(err.Error(), "cuda:0") || !strings.Contains(err.Error(), "use host or pinned memory") {
		t.Errorf("error %q does not name the device or the fix", err)
	}
}

// TestDeviceCapabilityFollowsCopier checks the other side: with a copier
// installed the transport advertises CapDeviceMemory and accepts the range.
func TestDeviceCapabilityFollowsCopier(t *testing.T) {
	saved := deviceCopier
	deviceCopier = &fakeDevice{}
	defer func() { deviceCopier = saved }()
	tr, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if !tr.Capabilities().Has(transport.CapDeviceMemory) {
		t.Errorf("CapDeviceMemory not set with a CUDA copier installed")
	}
	buf, err := transport.AllocHost("cap", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Close()
	m := buf.Memory()
	m.Kind = transport.MemoryCUDA
	d, err := tr.RegisterMemory(m)
	if err != nil {
		t.Fatalf("RegisterMemory(cuda) with a copier: %v", err)
	}
	if err := tr.DeregisterMemory(d.ID); err != nil {
		t.Fatal(err)
	}
}

func TestDeviceBouncePath(t *testing.T) {
	fake, ctx, bufs, descs, seg := devicePair(t)
	if !seg.t.Capabilities().Has(transport.CapDeviceMemory) {
		t.Errorf("CapDeviceMemory not set with a copier installed")
	}
	src, dst := bufs[0].Bytes(), bufs[1].Bytes()
	for i := range src {
		src[i] = byte(i*31 + i>>12)
	}
	run := func(rs ...transport.WriteRequest) transport.BatchStatus {
		t.Helper()
		return runBatch(t, ctx, seg, transport.OpWrite, rs...)
	}
	base := bufs[0].Addr()
	// Contiguous, split into 4 MiB frames, each staged through the bounce buffer.
	if st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 9 << 20}); st.State != transport.BatchCompleted {
		t.Fatalf("device write: %v %v", st.State, st.Err)
	}
	if !bytes.Equal(dst[:9<<20], src[:9<<20]) {
		t.Fatalf("device write: bytes differ")
	}
	// Strided.
	if st := run(transport.WriteRequest{Local: base + 7, Remote: descs[1].ID, RemoteOffset: 9 << 20, Length: 100, Count: 50, LocalStride: 300, RemoteStride: 200}); st.State != transport.BatchCompleted {
		t.Fatalf("strided device write: %v %v", st.State, st.Err)
	}
	for i := 0; i < 50; i++ {
		if !bytes.Equal(dst[9<<20+i*200:][:100], src[7+i*300:][:100]) {
			t.Fatalf("strided device write: block %d differs", i)
		}
	}
	// Receiver-side copy failure: the batch fails naming the copy, the stream stays usable.
	fake.failTo.Store(1)
	st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 4096})
	if st.State != transport.BatchFailed || st.Err == nil || !bytes.Contains([]byte(st.Err.Error()), []byte("cuMemcpyHtoD")) {
		t.Fatalf("receiver copy failure: %v %v, want failed naming the copy", st.State, st.Err)
	}
	fake.failTo.Store(-1 << 30)
	// Sender-side copy failure: same.
	fake.failFrom.Store(1)
	st = run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 4096})
	if st.State != transport.BatchFailed || st.Err == nil || !bytes.Contains([]byte(st.Err.Error()), []byte("cuMemcpyDtoH")) {
		t.Fatalf("sender copy failure: %v %v, want failed naming the copy", st.State, st.Err)
	}
	fake.failFrom.Store(-1 << 30)
	clear(dst[:1<<20])
	if st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 1 << 20}); st.State != transport.BatchCompleted || !bytes.Equal(dst[:1<<20], src[:1<<20]) {
		t.Fatalf("write after copy failures: %v %v", st.State, st.Err)
	}
}

// devicePair installs the fake copier (restored at cleanup) and returns two
// tcp transports with 10 MiB (> bounceSize, so blocks are staged in pieces)
// of "device" memory registered each, and a segment from the first to the
// second.
func devicePair(t *testing.T) (*fakeDevice, context.Context, [2]*transport.HostBuffer, [2]transport.RegionDesc, *segment) {
	t.Helper()
	fake := &fakeDevice{}
	fake.failTo.Store(-1 << 30)
	fake.failFrom.Store(-1 << 30)
	saved := deviceCopier
	deviceCopier = fake
	t.Cleanup(func() { deviceCopier = saved })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	const size = 10 << 20
	var trs [2]*Transport
	var bufs [2]*transport.HostBuffer
	var descs [2]transport.RegionDesc
	for i := range trs {
		tr, err := New(transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		buf, err := transport.AllocHost("dev", size)
		if err != nil {
			tr.Close()
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close(); buf.Close() })
		m := buf.Memory()
		m.Kind, m.Device = transport.MemoryCUDA, i
		d, err := tr.RegisterMemory(m)
		if err != nil {
			t.Fatal(err)
		}
		trs[i], bufs[i], descs[i] = tr, buf, d
	}
	seg, err := trs[0].OpenSegment(ctx, transport.SegmentInfo{Endpoint: []byte(trs[1].Addr()), Regions: []transport.RegionDesc{descs[1]}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { seg.Close() })
	return fake, ctx, bufs, descs, seg.(*segment)
}

// runBatch submits one batch of op on seg, waits, releases it and returns
// its status.
func runBatch(t *testing.T, ctx context.Context, seg transport.Segment, op transport.Op, rs ...transport.WriteRequest) transport.BatchStatus {
	t.Helper()
	id, err := seg.Submit(ctx, &transport.TransferBatch{Op: op, Requests: rs})
	if err != nil {
		t.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	seg.Release(id)
	return st
}
