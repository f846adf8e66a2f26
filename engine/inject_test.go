package engine_test

import (
	"context"
	"encoding/binary"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

func TestRoomMismatchDetected(t *testing.T) {
	addr := startBootstrap(t)
	// Rewrite the bootstrap_room of every record, as a metadata-slot
	// collision would: the KV and the record land, but the record names
	// another request.
	var rewritten atomic.Int64
	rw := &recordEditor{edit: func(rec []byte) {
		room := binary.LittleEndian.Uint64(rec)
		binary.LittleEndian.PutUint64(rec, room^(1<<40|1))
		rewritten.Add(1)
	}}
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport { rw.Transport = tr; return rw }})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})}
	const n = 20
	for i := 0; i < n; i++ {
		room := uint64(i * 7919) // includes room 0
		recvs := transferOneExpectFail(t, addr, pre, dec, room, 3)
		err := recvs.Failure()
		if recvs.Poll() != engine.KVFailed || !errors.Is(err, engine.ErrRoomMismatch) {
			t.Fatalf("room %d: receiver %s %v, want Failed with bootstrap_room mismatch", room, recvs.Poll(), err)
		}
		want := "expected bootstrap_room " + strconv.FormatUint(room, 10) + ", metadata record in slot"
		if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), strconv.FormatUint(room^(1<<40|1), 10)) {
			t.Fatalf("room %d: error does not name both rooms: %v", room, err)
		}
		recvs.Close()
	}
	if got := rewritten.Load(); got != n {
		t.Fatalf("rewrote %d records, want %d", got, n)
	}
}

// transferOneExpectFail runs one request through one prefill and one decode
// rank and returns the decode's receiver once it is terminal.
func transferOneExpectFail(t *testing.T, addr string, pre, dec []*rank, room uint64, pages int) *engine.Receiver {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dp, err := dec[0].pool.Alloc(pages)
	if err != nil {
		t.Fatal(err)
	}
	defer dec[0].pool.Free(dp)
	r, err := dec[0].m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Init(dp); err != nil {
		t.Fatal(err)
	}
	s, err := pre[0].m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s %v", st, s.Failure())
	}
	sp, _ := pre[0].pool.Alloc(pages)
	defer pre[0].pool.Free(sp)
	_ = workload.FillPattern(pre[0].pool, room, sp, 0)
	if err := s.Send(sp, true); err != nil {
		t.Fatal(err)
	}
	s.Wait(ctx, engine.KVSuccess)
	r.Wait(ctx, engine.KVSuccess)
	return r
}

func TestChecksumCatchesCorruptData(t *testing.T) {
	addr := startBootstrap(t)
	var ft *faulty.Transport
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport {
			ft = faulty.Wrap(tr, faulty.CorruptData(1))
			return ft
		}})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, checksum: true})}
	r := transferOneExpectFail(t, addr, pre, dec, 31337, 4)
	if r.Poll() != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrChecksum) {
		t.Fatalf("corrupted KV batch: receiver %s %v, want Failed/ErrChecksum", r.Poll(), r.Failure())
	}
	r.Close()
	// The next request (not corrupted) passes on the same connection.
	r2 := transferOneExpectFail(t, addr, pre, dec, 31338, 4)
	if r2.Poll() != engine.KVSuccess {
		t.Fatalf("clean request after the corrupted one: %s %v", r2.Poll(), r2.Failure())
	}
	r2.Close()
}

func TestSubmitFailureFailsBothSides(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr,
		wrap: func(tr transport.Transport) transport.Transport { return faulty.Wrap(tr, faulty.FailAfter(0)) }})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})}
	r := transferOneExpectFail(t, addr, pre, dec, 55, 2)
	if r.Poll() != engine.KVFailed || !strings.Contains(r.Failure().Error(), "reported Failed") {
		t.Fatalf("failed batch: receiver %s %v, want Failed from the prefill's STATUS", r.Poll(), r.Failure())
	}
	r.Close()
}
