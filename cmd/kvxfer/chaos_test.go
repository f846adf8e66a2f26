package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/cluster"
	"github.com/kvxfer/kvxfer/workload"
)

// TestChaosSoakShort runs the fencing soak briefly over tcp and shm: real
// prefill processes (this binary as `kvxfer prefill`) are killed and
// restarted, stopped and continued, given wrong token counts and write
// delays while the in-process decode drops control messages, decides slowly
// and aborts rooms, all on a pool small enough that every room reuses pages
// of earlier, failed rooms. No rank uses --verify or --checksum: the harness
// checks every accepted room's bytes itself. Both sides must agree on every
// room and no accepted room may hold bytes that are not its own.
func TestChaosSoakShort(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills processes")
	}
	f := chaosFlags{rooms: 24, transports: "tcp,shm", faults: strings.Join(chaosFaults, ","), concurrency: 4, prefills: 3, prefillTP: 1, faultRate: 0.5,
		seed: 7, minTokens: 16, maxTokens: 96, poolMB: 1, waiting: 2 * time.Second, fence: 500 * time.Millisecond, peer: 3 * time.Second,
		writeDelay: 50 * time.Millisecond, childLog: "error", quiet: true}
	if transport.ProbeTransport("shm") != nil {
		f.transports = "tcp"
	}
	reps := runShortChaos(t, 4, &f, 5*time.Minute)
	if len(reps) != len(strings.Split(f.transports, ",")) {
		t.Fatalf("%d reports for transports %q", len(reps), f.transports)
	}
	for _, r := range reps {
		faults := 0
		for _, n := range r.Faults {
			faults += n
		}
		switch {
		case r.Rooms != f.rooms:
			t.Errorf("%s: %d rooms recorded, want %d", r.Transport, r.Rooms, f.rooms)
		case r.Disagreements != 0 || r.Corruptions != 0:
			t.Errorf("%s: %d outcome disagreements, %d silent corruptions (want 0 and 0): %v", r.Transport, r.Disagreements, r.Corruptions, r.Examples)
		case faults == 0:
			t.Errorf("%s: no fault was injected", r.Transport)
		case r.DecodeOK == 0:
			t.Errorf("%s: no room succeeded: the soak checked no bytes (%v)", r.Transport, r.FailureExamples)
		}
	}
}

// The harness's byte check flags a room whose pages hold another room's KV
// (what a stale writer leaves), and an aux row of another room.
func TestChaosCheckFlagsAnotherRoomsBytes(t *testing.T) {
	model, err := workload.LookupModel("llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	l, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: 16, TPSize: 8, PPSize: 1, NumPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "chaos-check-test", Device: -1, Aux: workload.DefaultAux, AuxRows: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pages := []int32{5, 2, 7}
	if err := workload.FillPattern(pool, 11, pages, 0); err != nil {
		t.Fatal(err)
	}
	if err := workload.FillAux(pool, 11, 1); err != nil {
		t.Fatal(err)
	}
	if err := chaosCheck(pool, 11, pages, 1); err != nil {
		t.Fatalf("room 11's own bytes: %v", err)
	}
	if err := chaosCheck(pool, 12, pages, 1); err == nil {
		t.Fatal("room 11's bytes passed as room 12's")
	}
	if err := workload.FillPattern(pool, 12, pages[1:2], 1); err != nil { // one page overwritten by room 12
		t.Fatal(err)
	}
	if err := chaosCheck(pool, 11, pages, 1); err == nil {
		t.Fatal("a page of room 12 inside room 11 passed")
	}
}

func TestChaosFlagsAndPlans(t *testing.T) {
	for _, tc := range []struct {
		t, page, want int
	}{
		{1, 16, 16}, {16, 16, 15}, {17, 16, 32}, {32, 16, 31}, {5, 16, 16},
	} {
		got := otherTokenCount(tc.t, tc.page)
		if got != tc.want || got == tc.t {
			t.Errorf("otherTokenCount(%d, %d) = %d, want %d", tc.t, tc.page, got, tc.want)
		}
		if (got+tc.page-1)/tc.page != (tc.t+tc.page-1)/tc.page {
			t.Errorf("otherTokenCount(%d, %d) = %d fills another page count", tc.t, tc.page, got)
		}
	}
	if _, err := parseChaosFaults("kill,nope"); err == nil || !strings.Contains(err.Error(), `unknown fault "nope"`) {
		t.Errorf("parseChaosFaults(kill,nope) = %v", err)
	}
	if _, err := parseChaosFaults(" , "); err == nil {
		t.Error("parseChaosFaults of no fault accepted")
	}
	base := chaosFlags{rooms: 10, transports: "tcp", faults: "kill", concurrency: 2, prefills: 2, prefillTP: 1, faultRate: 0.5, minTokens: 16, maxTokens: 32,
		poolMB: 16, waiting: time.Second, fence: time.Second, peer: time.Second}
	for _, tc := range []struct {
		name string
		mod  func(*chaosFlags)
		want string
	}{
		{"ok", func(*chaosFlags) {}, ""},
		{"one prefill", func(f *chaosFlags) { f.prefills = 1 }, "--prefills 1"},
		{"prefill tp", func(f *chaosFlags) { f.prefillTP = 0 }, "--prefill-tp 0"},
		{"rate", func(f *chaosFlags) { f.faultRate = 1.5 }, "--fault-rate 1.5"},
		{"layerwise rate", func(f *chaosFlags) { f.layerwiseRate = -0.1 }, "--layerwise-rate -0.1"},
		{"tokens", func(f *chaosFlags) { f.minTokens = 40 }, "--min-tokens 40"},
		{"timeouts", func(f *chaosFlags) { f.fence = 0 }, "--fence-timeout 0s"},
		{"transport", func(f *chaosFlags) { f.transports = "tcp,carrier-pigeon" }, "carrier-pigeon"},
	} {
		f := base
		tc.mod(&f)
		err := validateChaosFlags(&f)
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
	// A seed names the same plan whatever the timing.
	env := &chaosEnv{f: &base, faults: []string{"kill", "tokens"}}
	for i := 0; i < 20; i++ {
		a, b := env.planRoom(99, i), env.planRoom(99, i)
		if a.room != b.room || a.tokens != b.tokens || a.fault != b.fault || a.preTokens != b.preTokens {
			t.Fatalf("room %d planned twice differently: %+v vs %+v", i, a, b)
		}
		if (a.fault == "tokens") != (a.preTokens != a.tokens) {
			t.Fatalf("room %d: fault %q but prefill tokens %d, decode %d", i, a.fault, a.preTokens, a.tokens)
		}
	}
}

// TestChaosHeal: the time to heal of a fault is from it to the next room
// that succeeded on the same prefill process; a fault with none after it
// is counted as not healed.
func TestChaosHeal(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	e := &chaosEnv{okAt: map[int][]time.Time{0: {at(500), at(100), at(900)}, 1: {at(50)}}}
	e.noteFault("kill", 0, at(150))  // healed at 500: 350 ms
	e.noteFault("kill", 0, at(600))  // healed at 900: 300 ms
	e.noteFault("kill", 1, at(60))   // nothing after: not healed
	e.noteFault("stall", 0, at(950)) // nothing after
	e.noteFault("drop", 1, at(10))   // healed at 50 on its own process
	got := e.heal()
	want := map[string]chaosHeal{
		"kill":  {N: 3, MedianMS: 350, MaxMS: 350, Unhealed: 1},
		"stall": {N: 1, Unhealed: 1},
		"drop":  {N: 1, MedianMS: 40, MaxMS: 40},
	}
	if len(got) != len(want) {
		t.Fatalf("heal %+v, want %+v", got, want)
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s: %+v, want %+v", k, got[k], w)
		}
	}
}

// TestChaosDecodeRestartExitRetry runs the soak briefly with only the
// decode-side faults, each forced often: the decode restarts with rooms in
// flight (same or new address), closes right after a room's Success, and
// retries aborted rooms with the same bootstrap_room into the same pages
// (the first attempt carrying another room's bytes). Every kind must have
// been injected, both sides must agree on every attempt, no accepted room
// may hold bytes not its own (a stale write of an old incarnation or of a
// first attempt), and retries must succeed; that includes a Success
// verdict lost across the decode's close (decode ok, prefill failed, the
// decode closed within chaosCloseWindow after; issue 22 case 1: the closing
// decode re-sends the verdicts no prefill acknowledged).
func TestChaosDecodeRestartExitRetry(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills processes")
	}
	f := chaosFlags{rooms: 30, transports: "tcp,shm", faults: "restart,exit,retry", concurrency: 4, prefills: 2, prefillTP: 1, faultRate: 0.6,
		seed: 11, minTokens: 16, maxTokens: 256, poolMB: 2, waiting: 2 * time.Second, fence: 500 * time.Millisecond, peer: 3 * time.Second,
		writeDelay: 50 * time.Millisecond, childLog: "error", quiet: true}
	if transport.ProbeTransport("shm") != nil {
		f.transports = "tcp"
	}
	reps := runShortChaos(t, 4, &f, 5*time.Minute)
	for _, r := range reps {
		injected := func(kind string) int {
			n := 0
			for k, c := range r.Faults {
				if k == kind || k == kind+" (same address)" || k == kind+" (new address)" {
					n += c
				}
			}
			return n
		}
		for _, k := range []string{"restart", "exit", "retry"} {
			if injected(k) == 0 {
				t.Errorf("%s: no %s fault was injected (%v)", r.Transport, k, r.Faults)
			}
		}
		switch {
		case r.Rooms != f.rooms:
			t.Errorf("%s: %d rooms recorded, want %d", r.Transport, r.Rooms, f.rooms)
		case r.Disagreements != 0 || r.Corruptions != 0 || r.LostLines != 0:
			t.Errorf("%s: %d outcome disagreements (%d of them a verdict lost across the decode's close), %d silent corruptions, %d lost lines (want 0, 0, 0): %v", r.Transport, r.Disagreements, r.DisagreementsAtClose, r.Corruptions, r.LostLines, r.Examples)
		case r.Retries == 0 || r.RetryFirstFailed == 0:
			t.Errorf("%s: %d retries, %d with a failed first attempt: the retry fault retried no failed room", r.Transport, r.Retries, r.RetryFirstFailed)
		case r.RetryOK == 0:
			t.Errorf("%s: none of %d retries with the same room succeeded (%v)", r.Transport, r.Retries, r.FailureExamples)
		case r.DecodeOK == 0:
			t.Errorf("%s: no room succeeded (%v)", r.Transport, r.FailureExamples)
		}
	}
}

// TestChaosReportChecksEveryAttempt: the report flags a prefill that
// reported a room failed after the decode's Success and exit (the case the
// exit fault exists for), and judges a retried room's first attempt like
// any room: its disagreement, corruption and lost line count.
func TestChaosReportChecksEveryAttempt(t *testing.T) {
	t0 := time.Unix(1000, 0)
	exit := &chaosRoom{room: 1, fault: "exit", decodeOK: true, faultAt: t0, decodeAt: t0,
		pre: &replyLine{Result: cluster.Result{Error: "peer lost: decode gone"}}, preAt: t0.Add(time.Second)}
	var rep chaosReport
	rep.add(exit)
	if rep.Disagreements != 1 || rep.DisagreementsAtClose != 0 || len(rep.Examples) != 1 || !strings.Contains(rep.Examples[0], `fault "exit"`) {
		t.Fatalf("decode ok then exit, prefill failed: %d disagreements (%d at a close) %v, want 1 naming the exit fault", rep.Disagreements, rep.DisagreementsAtClose, rep.Examples)
	}
	// The same room, its decode closed 100 ms after its Success: counted
	// apart as a verdict lost across the close, still a disagreement. A
	// close 4 s after, or before the Success, is not that.
	e := &chaosEnv{closes: []time.Time{t0.Add(-time.Second), t0.Add(100 * time.Millisecond)}}
	late := &chaosRoom{room: 3, decodeOK: true, decodeAt: t0.Add(-5 * time.Second)}
	failed := &chaosRoom{room: 4, decodeAt: t0}
	e.markClosedAfterOK([]*chaosRoom{exit, late, failed})
	if !exit.closedAfterOK || late.closedAfterOK || failed.closedAfterOK {
		t.Fatalf("closed after ok: exit %v (want true), 4 s before %v, failed %v (want false)", exit.closedAfterOK, late.closedAfterOK, failed.closedAfterOK)
	}
	rep = chaosReport{}
	rep.add(exit)
	if rep.Disagreements != 1 || rep.DisagreementsAtClose != 1 {
		t.Fatalf("decode ok, closed 100 ms later, prefill failed: %d disagreements, %d at a close; want 1 and 1", rep.Disagreements, rep.DisagreementsAtClose)
	}
	// The example says how late the prefill failed and when the decode
	// closed (a verdict lost shows as about the prefill's 2 s grace).
	if want := "prefill's line 1000 ms after the decode's Success; decode closed 100 ms after it"; len(rep.Examples) != 1 || !strings.Contains(rep.Examples[0], want) {
		t.Fatalf("example %q, want it to say %q", rep.Examples, want)
	}
	for _, tc := range []struct {
		name  string
		first chaosRoom
		want  func(chaosReport) bool
	}{
		{"disagreement", chaosRoom{decodeOK: false, pre: &replyLine{Result: cluster.Result{OK: true}}}, func(r chaosReport) bool { return r.Disagreements == 1 }},
		{"corruption", chaosRoom{decodeOK: true, corrupt: "at Success: layer 0 differs", pre: &replyLine{Result: cluster.Result{OK: true}}}, func(r chaosReport) bool { return r.Corruptions == 1 }},
		{"lost line", chaosRoom{lost: true}, func(r chaosReport) bool { return r.LostLines == 1 }},
	} {
		first := tc.first
		first.room, first.fault = 2, "retry"
		retry := &chaosRoom{room: 2, fault: "retry", decodeOK: true, pre: &replyLine{Result: cluster.Result{OK: true}}, first: &first}
		var r chaosReport
		r.add(retry)
		if !tc.want(r) || r.Rooms != 1 || r.Retries != 1 || r.RetryOK != 1 || len(r.Examples) > 0 && !strings.Contains(r.Examples[0], "first attempt of room 2") {
			t.Errorf("%s in a first attempt: %+v", tc.name, r)
		}
	}
}

// TestChaosLayerwise runs the soak briefly with every room layer by layer
// (--layerwise-rate 1) and the faults that hit a prefill or its control
// path mid-pass: both sides must agree on every room, no accepted room may
// hold another's bytes, and the prefill lines that succeeded must say they
// were sent layer-wise (the request key reached the prefill).
func TestChaosLayerwise(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills processes")
	}
	f := chaosFlags{rooms: 16, transports: "tcp", faults: "kill,stall,abort,drop,tokens", concurrency: 4, prefills: 2, prefillTP: 1, faultRate: 0.5, layerwiseRate: 1,
		seed: 5, minTokens: 16, maxTokens: 96, poolMB: 2, waiting: 2 * time.Second, fence: 500 * time.Millisecond, peer: 3 * time.Second,
		writeDelay: 20 * time.Millisecond, childLog: "error", quiet: true}
	// 32 layers: a 64 ms forward pass for the faults to land in.
	reps := runShortChaos(t, 32, &f, 3*time.Minute)
	r := reps[0]
	switch {
	case r.Rooms != f.rooms || r.Layerwise != f.rooms:
		t.Errorf("%d rooms recorded, %d layer-wise; want %d and %d", r.Rooms, r.Layerwise, f.rooms, f.rooms)
	case r.Disagreements != 0 || r.Corruptions != 0 || r.LostLines != 0:
		t.Errorf("%d outcome disagreements, %d silent corruptions, %d lost lines (want 0, 0, 0): %v", r.Disagreements, r.Corruptions, r.LostLines, r.Examples)
	case r.LayerwiseFaulted == 0:
		t.Errorf("no layer-wise room drew a fault (%v)", r.Faults)
	case r.LayerwiseOK == 0 || r.LayerwiseSent != r.PrefillOK:
		t.Errorf("%d layer-wise rooms ok on the decode, %d of %d ok prefill lines say layer-wise: want some, and all", r.LayerwiseOK, r.LayerwiseSent, r.PrefillOK)
	}
}

// TestChaosReportJudgesEveryProducer: with two producer ranks per room
// (--prefill-tp 2), a room whose decode failed while one rank reported ok
// is one disagreement, named by that rank; each rank's line counts, and a
// line one rank never wrote is a lost line.
func TestChaosReportJudgesEveryProducer(t *testing.T) {
	ok, failed := &replyLine{Result: cluster.Result{OK: true}}, &replyLine{Result: cluster.Result{Error: "aborted by decode"}}
	var rep chaosReport
	rep.add(&chaosRoom{room: 1, fault: "kill", target: 0, pre: nil, others: []chaosRankLine{{pre: ok}}})
	rep.add(&chaosRoom{room: 2, decodeOK: true, pre: ok, others: []chaosRankLine{{pre: ok}}})
	rep.add(&chaosRoom{room: 3, fault: "stall", target: 1, pre: failed, others: []chaosRankLine{{lost: true}}})
	if rep.Disagreements != 1 || len(rep.Examples) != 1 || !strings.Contains(rep.Examples[0], "room 1 ") || !strings.Contains(rep.Examples[0], "prefill tp 1 (the fault hit tp 0) ok=true") {
		t.Fatalf("decode failed, tp 0 killed, tp 1 ok: %d disagreements %q; want 1 naming tp 1", rep.Disagreements, rep.Examples)
	}
	if rep.PrefillOK != 3 || rep.PrefillFailed != 1 || rep.PrefillUnknown != 2 || rep.LostLines != 1 {
		t.Fatalf("lines: %d ok, %d failed, %d unknown, %d lost; want 3, 1, 2 (tp 0 killed, tp 1 lost) and 1", rep.PrefillOK, rep.PrefillFailed, rep.PrefillUnknown, rep.LostLines)
	}
}

// TestChaosPrefillTP2 runs the soak briefly with two producer ranks per
// room (--prefill-tp 2 → the decode's TP 1, each rank writing its KV head
// of every token), whole and layer by layer, with the faults that hit one
// producer: a kill, a stall, the other token count on one rank, an abort.
// The decode must fail or succeed each room and both ranks' result lines
// must agree with it; no accepted room may hold bytes not its own.
func TestChaosPrefillTP2(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills processes")
	}
	f := chaosFlags{rooms: 16, transports: "tcp", faults: "kill,stall,tokens,abort", concurrency: 4, prefills: 2, prefillTP: 2, faultRate: 0.5, layerwiseRate: 0.5,
		seed: 9, minTokens: 16, maxTokens: 96, poolMB: 2, waiting: 2 * time.Second, fence: 500 * time.Millisecond, peer: 3 * time.Second,
		writeDelay: 20 * time.Millisecond, childLog: "error", quiet: true}
	reps := runShortChaos(t, 8, &f, 3*time.Minute)
	r := reps[0]
	faults := 0
	for k, n := range r.Faults {
		if k != "delay" {
			faults += n
		}
	}
	switch {
	case r.Rooms != f.rooms || r.PrefillTP != 2:
		t.Errorf("%d rooms recorded at prefill TP %d; want %d at 2", r.Rooms, r.PrefillTP, f.rooms)
	case r.PrefillOK+r.PrefillFailed+r.PrefillUnknown != 2*f.rooms:
		t.Errorf("%d ok + %d failed + %d unknown prefill lines; want 2 per room, %d", r.PrefillOK, r.PrefillFailed, r.PrefillUnknown, 2*f.rooms)
	case r.Disagreements != 0 || r.Corruptions != 0 || r.LostLines != 0:
		t.Errorf("%d outcome disagreements, %d silent corruptions, %d lost lines (want 0, 0, 0): %v", r.Disagreements, r.Corruptions, r.LostLines, r.Examples)
	case faults == 0:
		t.Errorf("no fault was injected (%v)", r.Faults)
	case r.DecodeOK == 0:
		t.Errorf("no room succeeded: the soak checked no bytes (%v)", r.FailureExamples)
	}
}

// runShortChaos runs a short soak (runChaos) with f's flags on a tiny
// GQA model of the given layer count (8 heads, 2 KV heads of 64, bf16,
// written to a temporary config.json) within timeout, with this process's
// log kept to errors (the faults make the engine log by design, as kvxfer
// chaos does), and returns its per-transport reports; a run error fails
// the test.
func runShortChaos(t *testing.T, layers int, f *chaosFlags, timeout time.Duration) []chaosReport {
	t.Helper()
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
	f.model = filepath.Join(t.TempDir(), "tiny.json")
	cfg := fmt.Sprintf(`{"num_hidden_layers": %d, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"}`, layers)
	if err := os.WriteFile(f.model, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	var out strings.Builder
	reps, err := runChaos(ctx, f, &out)
	t.Logf("%s(%s)", out.String(), time.Since(start).Round(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return reps
}
