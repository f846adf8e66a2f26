package engine

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// OpenTelemetry spans (optional: ManagerConfig.TracerProvider; nil, the
// default, creates none and costs nothing). Each room gets one span per rank
// ("kvxfer.room", attributes kvxfer.room, kvxfer.role, kvxfer.rank), with one
// child span per evidence-chain step ("kvxfer.step.resolve_rank", …) from
// the previous step's end to this one's. Both sides of a room share a trace
// without any change to the control protocol: the room span's parent is a
// remote span context whose trace ID is derived from the bootstrap_room
// (RoomTraceID), so every rank's spans of one room land in one trace.

// tracerName is the instrumentation scope of the engine's spans.
const tracerName = "github.com/kvxfer/kvxfer/engine"

// RoomTraceID is the OpenTelemetry trace ID of a room's spans on every
// rank: the first 16 bytes of SHA-256("kvxfer-room/" + room as 8
// little-endian bytes).
func RoomTraceID(room uint64) trace.TraceID {
	var b [20]byte
	copy(b[:], "kvxfer-room/")
	binary.LittleEndian.PutUint64(b[12:], room)
	sum := sha256.Sum256(b[:])
	var id trace.TraceID
	copy(id[:], sum[:16])
	return id
}

// roomParent is the remote span context the room spans hang from.
func roomParent(room uint64) trace.SpanContext {
	id := RoomTraceID(room)
	var sid trace.SpanID
	copy(sid[:], id[8:16])
	sid[0] |= 1 // never the invalid all-zero ID
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: id, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
}

// roomSpan is a room's span; the zero value (no tracer) does nothing.
type roomSpan struct {
	ctx    context.Context
	span   trace.Span
	tracer trace.Tracer
}

func (m *Manager) startRoomSpan(room uint64, at time.Time) roomSpan {
	if m.tracer == nil {
		return roomSpan{}
	}
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), roomParent(room))
	ctx, span := m.tracer.Start(ctx, "kvxfer.room", trace.WithTimestamp(at), trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(attribute.Int64("kvxfer.room", int64(room&control.MaxRoom)), attribute.String("kvxfer.role", m.cfg.Role.String()),
			attribute.String("kvxfer.rank", m.rankName), attribute.String("kvxfer.endpoint", m.endpoint)))
	return roomSpan{ctx: ctx, span: span, tracer: m.tracer}
}

// step records a completed step as a child span [from, to].
func (s roomSpan) step(step Step, from, to time.Time) {
	if s.span == nil {
		return
	}
	_, c := s.tracer.Start(s.ctx, "kvxfer.step."+string(step), trace.WithTimestamp(from))
	c.End(trace.WithTimestamp(to))
}

// end closes the room span with its outcome.
func (s roomSpan) end(p KVPoll, err error, step Step, reason string, at time.Time) {
	if s.span == nil {
		return
	}
	if p == KVFailed {
		s.span.SetAttributes(attribute.String("kvxfer.failed_step", string(step)), attribute.String("kvxfer.reason", reason))
		if err != nil {
			s.span.RecordError(err, trace.WithTimestamp(at))
			s.span.SetStatus(codes.Error, err.Error())
		}
	} else {
		s.span.SetStatus(codes.Ok, "")
	}
	s.span.End(trace.WithTimestamp(at))
}
