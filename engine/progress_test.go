package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// logLines is a slog destination that hands each JSON record to a channel
// (records beyond its buffer are dropped, never blocking the logger).
type logLines chan map[string]any

func (l logLines) Write(b []byte) (int, error) {
	var rec map[string]any
	if json.Unmarshal(b, &rec) == nil {
		select {
		case l <- rec:
		default:
		}
	}
	return len(b), nil
}

// waitLog returns the first record with message msg for which ok holds,
// failing the test after a minute.
func waitLog(t *testing.T, l logLines, msg string, ok func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		select {
		case rec := <-l:
			if rec["msg"] == msg && ok(rec) {
				return rec
			}
		case <-deadline:
			t.Fatalf("no %q log line as wanted within a minute", msg)
		}
	}
}

// TestRoomWaitingProgress (issue 26 item 5): a decode room that reaches
// only some of its producers logs, every ProgressInterval, which prefill
// ranks answered and which it waits for, instead of staying silent until
// its timeout: while prefill tp1 has no entry in the directory (resolving),
// and while prefill tp0 wrote its share and tp1 never got the request
// (TRANSFER sent, no Success).
func TestRoomWaitingProgress(t *testing.T) {
	addr := startBootstrap(t)
	logs := make(logLines, 4096)
	mod := func(c *engine.ManagerConfig) {
		c.ProgressInterval = 100 * time.Millisecond
		c.HeartbeatInterval = 100 * time.Millisecond
		c.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	pre0 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 2, tpRank: 0, pp: 1, addr: addr})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, cfgMod: mod})
	has := func(key string, want ...string) func(map[string]any) bool {
		return func(rec map[string]any) bool {
			v, _ := rec[key].(string)
			for _, w := range want {
				if !strings.Contains(v, w) {
					return false
				}
			}
			return true
		}
	}

	// 1. Prefill tp1 not in the directory: the room waits while resolving.
	r, err := dec.m.NewReceiver(addr, 501)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	rec := waitLog(t, logs, "room waiting", has("waiting_for", "bootstrap server at "+addr, "not every prefill rank"))
	if rec["state"] != "Bootstrapping" || rec["room"] != float64(501) || rec["fails_in"] == nil {
		t.Errorf("resolving: %v", rec)
	}
	pre1 := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 2, tpRank: 1, pp: 1, addr: addr})

	// 2. Both resolved, tp0 writes, tp1 never gets the request.
	pg, err := dec.pool.Alloc(2)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.pool.Free(pg)
	if err := r.Init(pg); err != nil {
		t.Fatal(err)
	}
	s, err := pre0.m.NewSender(501)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("prefill tp0: %s %v", st, s.Failure())
	}
	src, err := pre0.pool.Alloc(s.DstPages())
	if err != nil {
		t.Fatal(err)
	}
	defer pre0.pool.Free(src)
	if err := workload.FillPattern(pre0.pool, 501, src, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(src, true); err != nil {
		t.Fatal(err)
	}
	rec = waitLog(t, logs, "room waiting", has("answered", "prefill tp0/pp0 at "+strings.TrimPrefix(pre0.m.Endpoint(), "tcp://")))
	if w, _ := rec["waiting_for"].(string); !strings.Contains(w, "prefill tp1/pp0 at "+strings.TrimPrefix(pre1.m.Endpoint(), "tcp://")) ||
		!strings.Contains(w, "TRANSFER sent, no Success yet") || strings.Contains(w, "tp0") {
		t.Errorf("waiting_for %q, want prefill tp1 only, TRANSFER sent", w)
	}
	if rec["state"] != "Transferring" || rec["step"] != string(engine.StepTransfer) {
		t.Errorf("transferring: %v", rec)
	}
	if r.Poll() != engine.KVTransferring {
		t.Errorf("room %s (%v), want still Transferring", r.Poll(), r.Failure())
	}
}

// TestTimelineBatches (issue 26 item 9): a prefill's room timeline shows
// inside transfer each batch posted and completed (writes, bytes, peer),
// and the writes of its batches are what the room adds to
// kvxfer_write_requests_total; the decode reports its wait before TRANSFER
// apart from its transfer.
func TestTimelineBatches(t *testing.T) {
	addr := startBootstrap(t)
	reg := prometheus.NewRegistry()
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, metrics: reg})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1})}
	room := uint64(9100)
	r := transferOne(t, addr, pre, dec, room, 4)[0]
	if r.Poll() != engine.KVSuccess {
		t.Fatalf("room: %s %v", r.Poll(), r.Failure())
	}
	rm := r.TransferMetric()
	if rm.BootstrapWait <= 0 || rm.TransferStart.IsZero() || rm.Latency <= 0 {
		t.Errorf("receiver metric %+v: want a bootstrap wait, a transfer start and a latency", rm)
	}
	tl, ok := pre[0].m.RoomTimeline(room)
	if !ok {
		t.Fatal("no prefill timeline")
	}
	var posted, completed, writes int
	for _, e := range tl.Events {
		if e.Step != engine.StepTransfer || e.Peer == "" {
			continue
		}
		var n, w int
		var b uint64
		var tr string
		if k, _ := fmt.Sscanf(e.Detail, "batch %d posted: %d writes, %d bytes over %s", &n, &w, &b, &tr); k == 4 {
			posted++
			writes += w
		} else if strings.HasPrefix(e.Detail, fmt.Sprintf("batch %d completed after ", posted)) {
			completed++
		}
	}
	if posted < 2 || posted != completed {
		t.Errorf("timeline: %d batches posted, %d completed; want >= 2 (data, commit word), each completed:\n%s", posted, completed, tl)
	}
	if n := sample(t, reg, engine.MetricWriteRequests, nil); n != float64(writes) {
		t.Errorf("kvxfer_write_requests_total = %v, the timeline's batches carried %d writes", n, writes)
	}
}
