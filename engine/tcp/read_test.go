package tcp

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestHeaderReadSizes: a read frame carries no payload from the sender; its
// size is what the receiver sends back.
func TestHeaderReadSizes(t *testing.T) {
	for _, c := range []struct {
		h                    header
		size, payload, table uint64
		read, scattered      bool
	}{
		{header{Kind: kindWrite, Count: 3, Length: 100}, 300, 300, 0, false, false},
		{header{Kind: kindScatter, Count: 3, Length: 300}, 300, 300, 48, false, true},
		{header{Kind: kindRead, Count: 3, Length: 100}, 300, 0, 0, true, false},
		{header{Kind: kindReadScatter, Count: 3, Length: 300}, 300, 0, 48, true, true},
	} {
		if c.h.size() != c.size || c.h.payload() != c.payload || uint64(c.h.tableBytes()) != c.table || c.h.read() != c.read || c.h.scattered() != c.scattered {
			t.Errorf("%+v: size %d payload %d table %d read %v scattered %v; want %d %d %d %v %v",
				c.h, c.h.size(), c.h.payload(), c.h.tableBytes(), c.h.read(), c.h.scattered(), c.size, c.payload, c.table, c.read, c.scattered)
		}
	}
}

// TestSplitRead: a strided read is cut into frames of at most chunkSize
// bytes that cover every block exactly once, in order.
func TestSplitRead(t *testing.T) {
	for _, r := range []transport.WriteRequest{
		{Length: 128, Count: 2048, LocalStride: 256, RemoteStride: 384},           // 256 KiB: one frame
		{Length: 1 << 20, Count: 9, LocalStride: 2 << 20, RemoteStride: 3 << 20},  // 4 blocks per frame
		{Length: 3 << 20, Count: 3, LocalStride: 3 << 20, RemoteStride: 4 << 20},  // 1 block per frame
		{Length: 9 << 20, Count: 2, LocalStride: 10 << 20, RemoteStride: 9 << 20}, // blocks over chunkSize
		{Length: 5, Count: 1 << 20, LocalStride: 5, RemoteStride: 7},              // many tiny blocks
	} {
		fs := splitRead(r)
		if len(fs) != readFrames(r) {
			t.Errorf("%+v: %d frames, readFrames says %d", r, len(fs), readFrames(r))
		}
		// Rebuild the byte ranges the frames read and write.
		type span struct{ local, remote, n uint64 }
		var got, want []span
		for _, f := range fs {
			if uint64(f.count)*f.length > chunkSize {
				t.Errorf("%+v: frame %+v carries %d bytes, over %d", r, f, uint64(f.count)*f.length, chunkSize)
			}
			if f.count > 1 && f.stride != r.RemoteStride {
				t.Errorf("%+v: frame %+v stride %d, want %d", r, f, f.stride, r.RemoteStride)
			}
			for i := uint64(0); i < uint64(f.count); i++ {
				got = append(got, span{f.localOff + i*r.LocalStride, f.remoteOff + i*f.stride, f.length})
			}
		}
		for i := uint64(0); i < r.Blocks(); i++ {
			for done := uint64(0); done < r.Length; done += chunkSize {
				n := r.Length - done
				if r.Length > chunkSize {
					n = min(chunkSize, n)
				}
				want = append(want, span{i*r.LocalStride + done, i*r.RemoteStride + done, n})
				if r.Length <= chunkSize {
					break
				}
			}
		}
		if len(got) != len(want) {
			t.Fatalf("%+v: frames cover %d pieces, want %d", r, len(got), len(want))
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%+v: piece %d = %+v, want %+v", r, i, got[i], want[i])
			}
		}
	}
}

// TestDeviceReadPath: reads of a device region (staged on the serving side
// before the ack) into device memory (staged on the reading side), and a
// failing copy on either side fails the batch naming the copy while the
// stream stays usable.
func TestDeviceReadPath(t *testing.T) {
	fake, ctx, bufs, descs, seg := devicePair(t)
	local, remote := bufs[0].Bytes(), bufs[1].Bytes()
	for i := range remote {
		remote[i] = byte(i*29 + i>>13)
	}
	run := func(rs ...transport.WriteRequest) transport.BatchStatus {
		t.Helper()
		return runBatch(t, ctx, seg, transport.OpRead, rs...)
	}
	base := bufs[0].Addr()
	if st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 9 << 20}); st.State != transport.BatchCompleted {
		t.Fatalf("device read: %v %v", st.State, st.Err)
	}
	if !bytes.Equal(local[:9<<20], remote[:9<<20]) {
		t.Fatalf("device read: bytes differ")
	}
	if st := run(transport.WriteRequest{Local: base + 7, Remote: descs[1].ID, RemoteOffset: 9 << 20, Length: 100, Count: 50, LocalStride: 300, RemoteStride: 200}); st.State != transport.BatchCompleted {
		t.Fatalf("strided device read: %v %v", st.State, st.Err)
	}
	for i := 0; i < 50; i++ {
		if !bytes.Equal(local[7+i*300:][:100], remote[9<<20+i*200:][:100]) {
			t.Fatalf("strided device read: block %d differs", i)
		}
	}
	// Serving-side copy failure: refused before any byte is sent.
	fake.failFrom.Store(1)
	clear(local[:4096])
	st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 4096})
	if st.State != transport.BatchFailed || st.Err == nil || !strings.Contains(st.Err.Error(), "cuMemcpyDtoH") {
		t.Fatalf("serving copy failure: %v %v, want failed naming the copy", st.State, st.Err)
	}
	if !bytes.Equal(local[:4096], make([]byte, 4096)) {
		t.Fatalf("a refused device read changed local memory")
	}
	fake.failFrom.Store(-1 << 30)
	// Reading-side copy failure.
	fake.failTo.Store(1)
	st = run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 4096})
	if st.State != transport.BatchFailed || st.Err == nil || !strings.Contains(st.Err.Error(), "cuMemcpyHtoD") {
		t.Fatalf("reading copy failure: %v %v, want failed naming the copy", st.State, st.Err)
	}
	fake.failTo.Store(-1 << 30)
	clear(local[:1<<20])
	if st := run(transport.WriteRequest{Local: base, Remote: descs[1].ID, Length: 1 << 20}); st.State != transport.BatchCompleted || !bytes.Equal(local[:1<<20], remote[:1<<20]) {
		t.Fatalf("read after copy failures: %v %v", st.State, st.Err)
	}
}
