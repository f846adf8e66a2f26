package engine_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// Issue 22 case 1, the lost verdict (kvxfer chaos: a dropped STATUS or a
// control reset, then the decode's restart or exit): the decode's Success
// verdict never reaches the prefill, and the decode closes right after
// Success, before the prefill's next ask for the verdict (every second).
// The closing decode must re-send the verdict until the prefill
// acknowledges it. Before: nothing confirmed delivery, the decode closed
// at once, and the prefill failed the room "peer lost" after its grace
// while the decode had reported Success.
func TestLostVerdictDeliveredAtDecodeClose(t *testing.T) {
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr})
	for i := range uint64(3) {
		var statuses atomic.Int32
		dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1,
			controlFault: func(_, typ string) bool { return typ == engine.MsgStatus && statuses.Add(1) == 1 }})
		closeAfterSuccessOn(t, addr, pre, dec, 1500+i)
		if statuses.Load() < 2 {
			t.Fatalf("room %d: the decode sent its verdict %d times, want the dropped one and a re-send", 1500+i, statuses.Load())
		}
		if n := engine.UnackedVerdicts(dec.m); n != 0 {
			t.Fatalf("room %d: %d verdicts left unacknowledged after the close", 1500+i, n)
		}
	}
}

// The prefill acknowledges every copy of a verdict, duplicates included
// (its first acknowledgement may be lost, as here), also once its sender
// succeeded and was closed; the closing decode re-sends until one arrives.
func TestVerdictAckLostIsResent(t *testing.T) {
	var acks atomic.Int32
	addr, pre, dec := verdictPair(t, rankOpts{controlFault: func(_, typ string) bool { return typ == engine.MsgVerdictAck && acks.Add(1) == 1 }}, rankOpts{})
	const room = 1600
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	sendSucceeded(ctx, t, "room", r, s, src)
	s.Close() // the prefill's caller is done with the room
	if n := engine.UnackedVerdicts(dec.m); n != 1 {
		t.Fatalf("%d unacknowledged verdicts before the close, want 1 (its acknowledgement was dropped)", n)
	}
	dec.m.Close()
	if n := engine.UnackedVerdicts(dec.m); n != 0 {
		t.Fatalf("%d verdicts left unacknowledged after the close: the prefill did not acknowledge the re-sent copy", n)
	}
	if n := acks.Load(); n < 2 {
		t.Fatalf("the prefill sent %d VERDICT_ACKs, want the dropped one and one for the re-sent copy", n)
	}
}

// README: a decode that closes sends ABORT for its unfinished rooms, so
// their producers fail them at once naming the close, also a producer that
// wrote everything and waits only for the verdict (which otherwise waits
// out its verdict grace after the decode's connection dropped). Before:
// Close marked the manager closed first, the ABORTs were refused ("KV
// manager closed"), and the prefill failed the room "peer lost", after the
// grace when it had written the room.
func TestDecodeCloseAbortsUnfinishedRooms(t *testing.T) {
	for _, written := range []bool{false, true} {
		name := "bootstrapped"
		if written {
			name = "written, verdict pending"
		}
		t.Run(name, func(t *testing.T) {
			addr, pre, dec := verdictPair(t, rankOpts{}, rankOpts{})
			room := uint64(1700)
			if written {
				room++
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
			if written {
				// The prefill's STATUS Success waits in the decode's control
				// loop until the close has failed the room: the decode does
				// not decide it first.
				release := make(chan struct{})
				held := holdStatuses(dec.m, release)
				var rel sync.Once
				engine.SetAfterVerdictFlush(dec.m, func() { rel.Do(func() { close(release) }) })
				if err := s.Send(src, true); err != nil {
					t.Fatal(err)
				}
				select {
				case <-held:
				case <-ctx.Done():
					t.Fatal("the prefill's STATUS never reached the decode")
				}
			}
			start := time.Now()
			dec.m.Close()
			if st := r.Poll(); st != engine.KVFailed || !errors.Is(r.Failure(), engine.ErrManagerClosed) {
				t.Fatalf("decode %s (%v), want Failed with ErrManagerClosed", st, r.Failure())
			}
			if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
				t.Fatalf("prefill %s", st)
			}
			took := time.Since(start)
			err := s.Failure()
			if !errors.Is(err, engine.ErrAborted) || !strings.Contains(err.Error(), "decode closed") {
				t.Fatalf("prefill failed with %v, want the decode's ABORT naming its close", err)
			}
			// The verdict grace is 2 s after the drop; the ABORT comes
			// before the close's socket linger.
			if took > 2*time.Second {
				t.Fatalf("prefill failed %v after the decode's close began, want it at once (the ABORT), not after the grace", took)
			}
		})
	}
}

// A copy of a Success verdict that reaches the prefill after it closed the
// room's sender (its first acknowledgement was lost, the closing decode
// re-sends) is acknowledged as accepted, also when the prefill keeps the
// memo of a failed earlier attempt of the same bootstrap_room (a retry):
// that memo says nothing about the attempt the verdict is for. Before:
// the prefill answered from the memo that the room had failed, and both
// sides logged a disagreement that did not exist (kvxfer chaos, retry
// fault).
func TestVerdictCopyAfterRetryAccepted(t *testing.T) {
	logs := make(logLines, 4096)
	withLog := func(c *engine.ManagerConfig) {
		c.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelError}))
	}
	var dropAcks atomic.Bool
	addr, pre, dec := verdictPair(t, rankOpts{cfgMod: withLog, controlFault: func(_, typ string) bool { return typ == engine.MsgVerdictAck && dropAcks.Load() }},
		rankOpts{cfgMod: withLog})
	const room = 1800
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Attempt 1 fails (the decode's caller aborts it) and both sides
	// close it: the prefill keeps its memo.
	r1, s1, _ := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	r1.Abort()
	if st := s1.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
		t.Fatalf("attempt 1: sender %s, want Failed", st)
	}
	s1.Close()
	r1.Close()
	// Attempt 2 succeeds; its acknowledgement is lost.
	dropAcks.Store(true)
	r2, s2, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	sendSucceeded(ctx, t, "attempt 2", r2, s2, src)
	s2.Close()
	dropAcks.Store(false)
	dec.m.Close() // re-sends attempt 2's verdict
	if n := engine.UnackedVerdicts(dec.m); n != 0 {
		t.Fatalf("%d verdicts left unacknowledged after the close", n)
	}
	for len(logs) > 0 {
		if rec := <-logs; rec["level"] == "ERROR" {
			t.Errorf("logged: %v", rec)
		}
	}
}

// TestUnackedVerdictAtCloseWording: a verdict no acknowledgement answers
// (here the prefill's are all lost; in kvxfer chaos the prefill was
// killed and the decode had not noticed yet) is logged at Error when the
// decode's Close gives up on it, in words true in both cases: the prefill
// may be gone; if alive it reports the room failed by peer lost after its
// grace. Before, it said the prefill fails the room, also of a prefill
// already dead.
func TestUnackedVerdictAtCloseWording(t *testing.T) {
	logs := make(logLines, 4096)
	addr, pre, dec := verdictPair(t, rankOpts{controlFault: func(_, typ string) bool { return typ == engine.MsgVerdictAck }},
		rankOpts{cfgMod: func(c *engine.ManagerConfig) {
			c.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelError}))
		}})
	const room = 1900
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, s, src := bootstrappedRoom(ctx, t, pre, dec, addr, room)
	sendSucceeded(ctx, t, "room", r, s, src)
	dec.m.Close()
	var got []string
	for len(logs) > 0 {
		rec := <-logs
		msg, _ := rec["msg"].(string)
		if rec["level"] == "ERROR" && strings.Contains(msg, "never acknowledged") {
			if !strings.Contains(msg, "may already be gone") || !strings.Contains(msg, "if it is alive") || !strings.Contains(msg, "peer lost") {
				t.Errorf("Close logged %q: want it to say the prefill may already be gone and, if alive, reports the room failed (peer lost)", msg)
			}
			return
		}
		got = append(got, msg)
	}
	t.Fatalf("Close logged no Error for the unacknowledged verdict of room %d (logged at Error: %q)", room, got)
}
