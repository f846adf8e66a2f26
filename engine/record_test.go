package engine_test

import (
	"context"
	"encoding/binary"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// recordEditor is a transport decorator that edits the body of every
// metadata record a sender writes (the 56-byte write at a slot boundary)
// before it goes out: a producer that lies about its record.
type recordEditor struct {
	transport.Transport
	edit func(rec []byte)
}

type editSeg struct {
	transport.Segment
	t *recordEditor
}

// fenceOf forwards a test decorator's Fencer methods to the transport it
// wraps (the decode admits and fences epochs through it).
func fenceOf(t transport.Transport) transport.Fencer {
	if f, ok := t.(transport.Fencer); ok {
		return f
	}
	return nil
}

func (r *recordEditor) AdmitEpoch(peer string, epoch uint64) error {
	return fenceOf(r.Transport).AdmitEpoch(peer, epoch)
}

func (r *recordEditor) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	return fenceOf(r.Transport).FenceEpoch(ctx, peer, epoch)
}

func (r *recordEditor) OpenSegment(ctx context.Context, info transport.SegmentInfo) (transport.Segment, error) {
	s, err := r.Transport.OpenSegment(ctx, info)
	if err != nil {
		return nil, err
	}
	return &editSeg{Segment: s, t: r}, nil
}

func (s *editSeg) Submit(ctx context.Context, b *transport.TransferBatch) (transport.BatchID, error) {
	for _, w := range b.Requests {
		if w.Length == engine.RecordCommitOffset && w.RemoteOffset%engine.RecordSize == 0 && w.Count <= 1 {
			addr := w.Local // registered staging memory (mmap, not Go heap)
			s.t.edit(unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))), engine.RecordSize))
		}
	}
	return s.Segment.Submit(ctx, b)
}

// transferTokens runs one request whose prefill declares ptok tokens and
// decode dtok (0: not declared) and returns both terminal sides.
func transferTokens(t *testing.T, addr string, pre, dec *rank, room uint64, pages, ptok, dtok int) (*engine.Sender, *engine.Receiver) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dp, err := dec.pool.Alloc(pages)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dec.pool.Free(dp) })
	r, err := dec.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if dtok > 0 {
		if err := r.SetTokens(dtok); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Init(dp); err != nil {
		t.Fatal(err)
	}
	s, err := pre.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if ptok > 0 {
		_ = s.SetTokens(ptok) // may fail at once when TRANSFER is already here
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st == engine.KVWaitingForInput {
		sp, _ := pre.pool.Alloc(pages)
		t.Cleanup(func() { pre.pool.Free(sp) })
		_ = workload.FillPattern(pre.pool, room, sp, 0)
		_ = s.Send(sp, true)
	}
	s.Wait(ctx, engine.KVSuccess)
	r.Wait(ctx, engine.KVSuccess)
	return s, r
}

// Case 4 of the fencing issue: prefill and decode disagree on the request's
// token count (same page count). Both sides fail, naming both counts.
func TestTokenCountMismatchFailsBothSides(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	for i, c := range []struct{ ptok, dtok int }{{1, 4}, {5, 8}, {8, 5}} { // page size 4: same page count
		room := uint64(2101 + i)
		s, r := transferTokens(t, addr, pre, dec, room, 2, c.ptok, c.dtok)
		for side, err := range map[string]error{"prefill": s.Failure(), "decode": r.Failure()} {
			if err == nil || !strings.Contains(err.Error(), "token count mismatch") {
				t.Fatalf("room %d %s: %v, want a token count mismatch", room, side, err)
			}
		}
		want := []string{"covers " + strconv.Itoa(c.ptok) + " tokens", "expects " + strconv.Itoa(c.dtok)}
		for _, w := range want {
			if !strings.Contains(r.Failure().Error(), w) {
				t.Fatalf("room %d: decode error %q does not name %q", room, r.Failure(), w)
			}
		}
	}
	// Equal counts, and a side that declares none, still succeed.
	for i, c := range []struct{ ptok, dtok int }{{7, 7}, {0, 7}, {7, 0}} {
		s, r := transferTokens(t, addr, pre, dec, uint64(3100+i), 2, c.ptok, c.dtok)
		if r.Poll() != engine.KVSuccess || s.Poll() != engine.KVSuccess {
			t.Fatalf("tokens %+v: sender %s %v, receiver %s %v", c, s.Poll(), s.Failure(), r.Poll(), r.Failure())
		}
	}
}

// The decode checks the record itself: a producer whose record names another
// token count, or another data-path epoch (a stale writer), never commits the
// slot, whatever its STATUS says.
func TestRecordTokenAndEpochChecked(t *testing.T) {
	cases := []struct {
		name string
		edit func(rec []byte)
		want string
	}{
		{"tokens", func(rec []byte) { binary.LittleEndian.PutUint32(rec[engine.RecordTokenCountOffset:], 3) }, "covered 3 tokens, the decode expects 8"},
		{"epoch", func(rec []byte) {
			e := binary.LittleEndian.Uint64(rec[engine.RecordEpochOffset:])
			binary.LittleEndian.PutUint64(rec[engine.RecordEpochOffset:], e-1)
		}, "stale writer"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr := startBootstrap(t)
			pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
				wrap: func(tr transport.Transport) transport.Transport { return &recordEditor{Transport: tr, edit: c.edit} }})
			dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
			_, r := transferTokens(t, addr, pre, dec, 77, 2, 8, 8)
			if r.Poll() != engine.KVFailed || !strings.Contains(r.Failure().Error(), c.want) {
				t.Fatalf("receiver %s %v, want Failed naming %q", r.Poll(), r.Failure(), c.want)
			}
			if errors.Is(r.Failure(), engine.ErrRoomMismatch) {
				t.Fatalf("not a room mismatch: %v", r.Failure())
			}
		})
	}
}
