package shm

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// openFDs is the number of descriptors this process holds.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	return len(ents)
}

// TestRegionsOfOneMemfdShareADescriptor: 200 regions registered in one
// memfd cost the receiver one descriptor and the sender, opening a segment
// over all of them, a few (its pidfd, the control memfd, the pipe, the one
// region memfd), not one per region (before: one each, and 10,000 regions
// ran a process out of descriptors). Every region is still written where it
// lies, and the descriptor closes with its last region.
func TestRegionsOfOneMemfdShareADescriptor(t *testing.T) {
	const n, each = 200, 4096
	snd, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	rcv, err := New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer rcv.Close()
	src, err := transport.AllocHost("src", each)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := transport.AllocHost("dst", n*each)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if _, err := snd.RegisterMemory(src.Memory()); err != nil {
		t.Fatal(err)
	}
	before := openFDs(t)
	var descs []transport.RegionDesc
	for i := range n {
		m := dst.Memory()
		m.Addr += uintptr(i * each)
		m.FDOffset += uint64(i * each)
		m.Length = each
		d, err := rcv.RegisterMemory(m)
		if err != nil {
			t.Fatal(err)
		}
		descs = append(descs, d)
	}
	if got := openFDs(t) - before; got > 1 {
		t.Fatalf("registering %d regions of one memfd took %d descriptors, want 1", n, got)
	}
	ep, err := rcv.Endpoint(context.Background(), "snd")
	if err != nil {
		t.Fatal(err)
	}
	before = openFDs(t)
	seg, err := snd.OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: descs})
	if err != nil {
		t.Fatal(err)
	}
	if got := openFDs(t) - before; got > 6 {
		t.Fatalf("a segment over %d regions of one memfd took %d descriptors, want a few", n, got)
	}
	copy(src.Bytes(), bytes.Repeat([]byte{0xA5}, each))
	for _, i := range []int{0, 137, n - 1} {
		id, err := seg.Submit(context.Background(), &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr(), Remote: descs[i].ID, Length: each}}})
		if err != nil {
			t.Fatal(err)
		}
		if st := waitOK(t, seg, id); st.State != transport.BatchCompleted {
			t.Fatalf("write to region %d: %+v", i, st)
		}
		if !bytes.Equal(dst.Bytes()[i*each:(i+1)*each], src.Bytes()) {
			t.Fatalf("region %d does not hold the bytes written to it", i)
		}
	}
	seg.Close()
	before = openFDs(t)
	for _, d := range descs {
		if err := rcv.DeregisterMemory(d.ID); err != nil {
			t.Fatal(err)
		}
	}
	if got := before - openFDs(t); got != 1 {
		t.Fatalf("deregistering every region closed %d descriptors, want the shared one", got)
	}
}
