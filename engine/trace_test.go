package engine_test

import (
	"testing"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestRoomSpans: with a TracerProvider each side of a room records a
// kvxfer.room span with one child per evidence-chain step, both sides in
// the trace derived from the room; a failed room's span carries the error.
func TestRoomSpans(t *testing.T) {
	addr := startBootstrap(t)
	preRec, decRec := tracetest.NewSpanRecorder(), tracetest.NewSpanRecorder()
	preTP := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(preRec))
	decTP := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(decRec))
	var lie bool
	rw := &recordEditor{edit: func(rec []byte) {
		if lie {
			rec[0] ^= 1
		}
	}}
	pre := []*rank{newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, tracer: preTP,
		wrap: func(tr transport.Transport) transport.Transport { rw.Transport = tr; return rw }})}
	dec := []*rank{newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, tracer: decTP})}
	r := transferOneExpectFail(t, addr, pre, dec, 777, 2)
	if r.Poll() != engine.KVSuccess {
		t.Fatalf("room 777: %s %v", r.Poll(), r.Failure())
	}
	r.Close()
	lie = true
	r = transferOneExpectFail(t, addr, pre, dec, 778, 2)
	r.Close()

	check := func(rec *tracetest.SpanRecorder, role engine.Role) {
		t.Helper()
		rooms := map[string]sdktrace.ReadOnlySpan{}
		steps := map[string][]string{}
		for _, s := range rec.Ended() {
			if s.Name() == "kvxfer.room" {
				rooms[s.SpanContext().TraceID().String()] = s
			} else {
				steps[s.SpanContext().TraceID().String()] = append(steps[s.SpanContext().TraceID().String()], s.Name())
			}
		}
		ok, failed := engine.RoomTraceID(777).String(), engine.RoomTraceID(778).String()
		if s := rooms[ok]; s == nil || s.Status().Code != codes.Ok {
			t.Fatalf("%s: no successful room span in trace %s: %v", role, ok, rooms)
		}
		if want := len(engine.Steps(role)) - 1; len(steps[ok]) != want { // register is the span's start
			t.Errorf("%s: step spans %v, want %d", role, steps[ok], want)
		}
		if role == engine.RoleDecode {
			s := rooms[failed]
			if s == nil || s.Status().Code != codes.Error {
				t.Fatalf("decode: failed room span %v", s)
			}
			var step string
			for _, a := range s.Attributes() {
				if a.Key == "kvxfer.failed_step" {
					step = a.Value.AsString()
				}
			}
			if step != string(engine.StepVerify) {
				t.Errorf("decode: failed room span names step %q, want verify", step)
			}
		}
	}
	check(preRec, engine.RolePrefill)
	check(decRec, engine.RoleDecode)
}
