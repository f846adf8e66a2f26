package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/spf13/pflag"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/debugsrv"
)

// obsFlags are a rank's observability flags (prefill, decode).
type obsFlags struct {
	metricsAddr   string
	otlpEndpoint  string
	timelineRooms int
}

// otlpEnv are the environment variables that turn spans on when
// --otlp-endpoint is not given (OpenTelemetry's standard names).
var otlpEnv = []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"}

func addObsFlags(fs *pflag.FlagSet, f *obsFlags) {
	fs.StringVar(&f.metricsAddr, "metrics-addr", envOr("KVXFER_METRICS_ADDR", ""),
		"serve Prometheus metrics (GET /metrics) and room timelines (GET /debug/rooms[/ROOM]) on this host:port (port 0: a free port, printed in the ready line); empty: off (env KVXFER_METRICS_ADDR)")
	fs.StringVar(&f.otlpEndpoint, "otlp-endpoint", "",
		"send OpenTelemetry spans (one per room, one per evidence-chain step) to this OTLP/HTTP endpoint (http://host:4318 or host:4318); default: env "+
			strings.Join(otlpEnv, " or ")+"; unset: no spans")
	fs.IntVar(&f.timelineRooms, "timeline-rooms", engine.DefaultTimelineRooms, "finished rooms whose timelines this rank keeps for GET /debug/rooms and kvxfer room (0: active rooms only)")
}

// otlpEndpoint returns the flag, else the first non-empty otlpEnv variable.
func otlpEndpoint(flag string, getenv func(string) string) string {
	return flagOrEnv(flag, getenv, otlpEnv)
}

// newRegistry returns a registry with the Go runtime and process collectors,
// for one process's kvxfer_* metrics.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// newTracerProvider returns an OpenTelemetry tracer provider exporting over
// OTLP/HTTP, and its shutdown (flushes pending spans, bounded by 5 s).
// endpoint is the --otlp-endpoint flag: a base URL ("http(s)://host:port";
// spans go to /v1/traces under it unless the URL has a path) or
// "host:port" (plain HTTP). An empty flag with otlpEnv set lets the
// exporter read the OTEL_EXPORTER_OTLP_* variables itself (the
// OpenTelemetry rules); with neither, it returns nil: no spans.
func newTracerProvider(ctx context.Context, endpoint, service string) (trace.TracerProvider, func(), error) {
	fromEnv := endpoint == "" && otlpEndpoint("", os.Getenv) != ""
	if endpoint == "" && !fromEnv {
		return nil, func() {}, nil
	}
	var opts []otlptracehttp.Option
	switch u, err := url.Parse(endpoint); {
	case fromEnv:
	case err == nil && (u.Scheme == "http" || u.Scheme == "https"):
		if u.Path == "" || u.Path == "/" {
			opts = append(opts, otlptracehttp.WithEndpoint(u.Host), otlptracehttp.WithURLPath("/v1/traces"))
			if u.Scheme == "http" {
				opts = append(opts, otlptracehttp.WithInsecure())
			}
		} else {
			opts = append(opts, otlptracehttp.WithEndpointURL(endpoint))
		}
	default:
		opts = append(opts, otlptracehttp.WithEndpoint(endpoint), otlptracehttp.WithInsecure())
	}
	if fromEnv {
		endpoint = otlpEndpoint("", os.Getenv)
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("--otlp-endpoint %q: %w", endpoint, err)
	}
	res := resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(service))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	slog.Info("OpenTelemetry spans enabled", "endpoint", endpoint, "service", service)
	return tp, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			slog.Warn("flushing OpenTelemetry spans failed", "endpoint", endpoint, "err", err)
		}
	}, nil
}

// rankObservability is what runRole sets up from obsFlags: the registry
// (always; the engine counts either way), the tracer provider (nil: none)
// and, once started, the debug server.
type rankObservability struct {
	reg      *prometheus.Registry
	tracer   trace.TracerProvider
	stopOTel func()
	srv      *debugsrv.Server
}

func setupObservability(ctx context.Context, role engine.Role, f *obsFlags) (*rankObservability, error) {
	if f.timelineRooms < 0 {
		return nil, fmt.Errorf("--timeline-rooms %d: must be >= 0", f.timelineRooms)
	}
	o := &rankObservability{reg: newRegistry()}
	tp, stop, err := newTracerProvider(ctx, f.otlpEndpoint, "kvxfer-"+role.String())
	if err != nil {
		return nil, err
	}
	o.tracer, o.stopOTel = tp, stop
	return o, nil
}

// serve starts the debug server on --metrics-addr (nothing when empty).
func (o *rankObservability) serve(addr string, rooms debugsrv.RoomSource) error {
	if addr == "" {
		return nil
	}
	srv, err := debugsrv.Start(addr, o.reg, rooms, slog.Default())
	if err != nil {
		return fmt.Errorf("--metrics-addr: %w", err)
	}
	o.srv = srv
	slog.Info("serving metrics and room timelines", "addr", srv.Addr(), "routes", "/metrics /debug/rooms /debug/rooms/{room}")
	return nil
}

// addr is the debug server's bound address ("" when off).
func (o *rankObservability) addr() string {
	if o.srv == nil {
		return ""
	}
	return o.srv.Addr()
}

func (o *rankObservability) close() {
	if o.srv != nil {
		_ = o.srv.Close()
	}
	o.stopOTel()
}

// timelineRooms turns the flag into ManagerConfig.TimelineRooms (the flag's
// 0 keeps none; the engine's 0 means its default).
func timelineRooms(flag int) int {
	if flag == 0 {
		return -1
	}
	return flag
}

// scrapeMetrics GETs http://addr/metrics and returns its kvxfer_* series as
// "name{label="value",…}" → value (histograms as name_count and name_sum).
func scrapeMetrics(ctx context.Context, addr string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", addr, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", addr, err)
	}
	out := map[string]float64{}
	for name, mf := range fams {
		if !strings.HasPrefix(name, "kvxfer_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, lp := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%q", lp.GetName(), lp.GetValue()))
			}
			sort.Strings(ls)
			key := func(n string) string {
				if len(ls) == 0 {
					return n
				}
				return n + "{" + strings.Join(ls, ",") + "}"
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[key(name)] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[key(name)] = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[key(name+"_count")] = float64(m.GetHistogram().GetSampleCount())
				out[key(name+"_sum")] = m.GetHistogram().GetSampleSum()
			}
		}
	}
	return out, nil
}

// sumSeries adds the values of the series of name whose labels contain
// every `key="value"` in want.
func sumSeries(samples map[string]float64, name string, want ...string) float64 {
	var n float64
next:
	for k, v := range samples {
		if k != name && !strings.HasPrefix(k, name+"{") {
			continue
		}
		for _, w := range want {
			if !strings.Contains(k, w) {
				continue next
			}
		}
		n += v
	}
	return n
}
