package fleetsim_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bench/fleetsim"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
)

// TestSimulateSmall runs the scale simulation at a size CI affords.
func TestSimulateSmall(t *testing.T) {
	c := etcdtest.Start(t, etcdtest.Options{HeartbeatMS: 100, ElectionMS: 1000})
	r, err := fleetsim.Simulate(context.Background(), c.URL("sim"), fleetsim.Options{Ranks: 50, Clients: 5, Resolves: 200, TTL: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", r)
	if r.Watchers != 49 || r.InvalidateAll <= 0 || r.ResolveP50 <= 0 || r.ResolveP99 < r.ResolveP50 {
		t.Fatalf("implausible figures: %+v", r)
	}
}

// BenchmarkFleet is the scale figure of bench/RESULTS.md: 1,000 simulated
// ranks against one local etcd (started here on tmpfs).
//
//	go test ./bench/fleetsim -run '^$' -bench Fleet -benchtime 1x
func BenchmarkFleet(b *testing.B) {
	c := etcdtest.Start(b, etcdtest.Options{HeartbeatMS: 100, ElectionMS: 1000})
	for b.Loop() {
		r, err := fleetsim.Simulate(context.Background(), c.URL("bench"), fleetsim.Options{Ranks: 1000})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(r.RegisterAll.Seconds()*1e3, "register_all_ms")
		b.ReportMetric(float64(r.ResolveP50.Microseconds()), "resolve_p50_us")
		b.ReportMetric(float64(r.ResolveP99.Microseconds()), "resolve_p99_us")
		b.ReportMetric(float64(r.InvalidateAll.Microseconds()), "invalidate_all_us")
		b.Logf("\n%s", r)
	}
}
