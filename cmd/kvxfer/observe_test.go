package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// TestOTLPExport: --otlp-endpoint sends the spans over OTLP/HTTP (POST
// /v1/traces, protobuf) when the provider shuts down; no endpoint, no
// provider.
func TestOTLPExport(t *testing.T) {
	var posts atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/v1/traces" && strings.Contains(r.Header.Get("Content-Type"), "protobuf") {
			posts.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	tp, stop, err := newTracerProvider(context.Background(), srv.URL, "kvxfer-test")
	if err != nil {
		t.Fatal(err)
	}
	_, span := tp.Tracer("test").Start(context.Background(), "kvxfer.room")
	span.End()
	stop()
	if posts.Load() == 0 {
		t.Fatal("no OTLP export reached the endpoint")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	if tp, _, err := newTracerProvider(context.Background(), "", "x"); tp != nil || err != nil {
		t.Fatalf("empty endpoint: %v %v, want no provider", tp, err)
	}
	if got := otlpEndpoint("", func(n string) string { return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "h:4318"}[n] }); got != "h:4318" {
		t.Fatalf("endpoint from the environment: %q", got)
	}
	// From the environment (OpenTelemetry's own variable, base URL).
	before := posts.Load()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	tp, stop, err = newTracerProvider(context.Background(), "", "kvxfer-test")
	if err != nil || tp == nil {
		t.Fatalf("provider from OTEL_EXPORTER_OTLP_ENDPOINT: %v %v", tp, err)
	}
	_, span = tp.Tracer("test").Start(context.Background(), "kvxfer.room")
	span.End()
	stop()
	if posts.Load() == before {
		t.Fatal("no OTLP export reached the endpoint named by OTEL_EXPORTER_OTLP_ENDPOINT")
	}
}
