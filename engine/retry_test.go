package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine"
)

// TestRetrySameRoomAfterEarlyAbort: a decode fails room R before the
// prefill created it (its ABORT reaches the prefill first). A router's retry
// of R on that prefill (same bootstrap_room), from another decode or from
// the same one, is served (before: NewSender failed at once with the first
// attempt's abort, for up to the bootstrap timeout); the aborted attempt's
// own sender, which no decode sends TRANSFER, still fails, naming the
// decode's reason and saying the room is usable again.
func TestRetrySameRoomAfterEarlyAbort(t *testing.T) {
	addr := startBootstrap(t)
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})}
	reg := prometheus.NewRegistry()
	d1 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, metrics: reg})
	d2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	acks := 0.0
	abortEarly := func(room uint64) {
		t.Helper()
		r, err := d1.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		r.Refuse(errors.New("no KV pages free"))
		// The prefill acknowledges the ABORT once it has recorded it.
		labels := map[string]string{"role": "decode", "event": "abort_ack_received"}
		deadline := time.Now().Add(20 * time.Second)
		for sample(t, reg, engine.MetricFencingEvents, labels) <= acks {
			if time.Now().After(deadline) {
				t.Fatalf("room %d: no ABORT_ACK from the prefill", room)
			}
			time.Sleep(5 * time.Millisecond)
		}
		acks = sample(t, reg, engine.MetricFencingEvents, labels)
		r.Close()
	}

	// Retry from another decode.
	abortEarly(9)
	if r := transferOne(t, addr, pre, []*rank{d2}, 9, 4); r[0].Poll() != engine.KVSuccess {
		t.Fatalf("retry of room 9 from another decode: %s %v", r[0].Poll(), r[0].Failure())
	}
	// Retry on the same decode: its first receiver was closed, so the
	// room is usable there at once.
	abortEarly(10)
	if r := transferOne(t, addr, pre, []*rank{d1}, 10, 4); r[0].Poll() != engine.KVSuccess {
		t.Fatalf("retry of room 10 on the same decode: %s %v", r[0].Poll(), r[0].Failure())
	}

	// The aborted attempt's own sender: no TRANSFER comes, it fails.
	abortEarly(11)
	s, err := pre[0].m.NewSender(11)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("the aborted attempt's sender: %s, want Failed", st)
	}
	if msg := s.Failure().Error(); !errors.Is(s.Failure(), engine.ErrAborted) || !strings.Contains(msg, "no KV pages free") || !strings.Contains(msg, "usable again") {
		t.Fatalf("the aborted attempt's failure %q: want ErrAborted naming the decode's reason and that the room is usable again", msg)
	}
}

// TestReceiverActiveSaysWhenUsable: a second NewReceiver for a room whose
// receiver is still open says why and when the room becomes usable.
func TestReceiverActiveSaysWhenUsable(t *testing.T) {
	addr := startBootstrap(t)
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})
	r, err := d.m.NewReceiver(addr, 12)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.Refuse(errors.New("no KV pages free"))
	_, err = d.m.NewReceiver(addr, 12)
	if !errors.Is(err, engine.ErrRoomActive) || !strings.Contains(err.Error(), "no KV pages free") || !strings.Contains(err.Error(), "usable once") {
		t.Fatalf("second receiver while the failed one is open: %v, want ErrRoomActive saying when the room is usable", err)
	}
	r.Close()
	r2, err := d.m.NewReceiver(addr, 12)
	if err != nil {
		t.Fatalf("receiver after Close: %v", err)
	}
	r2.Close()
}
