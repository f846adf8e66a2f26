package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/engine"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

func newProber(t *testing.T, transports ...string) *engine.Prober {
	t.Helper()
	var trs []transport.Transport
	for _, name := range transports {
		tr, err := transport.OpenTransport(name, transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		trs = append(trs, tr)
	}
	p, err := engine.NewProber(engine.ProberConfig{Transports: trs, Length: 256 << 10, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestProbeTransfersAndVerifies: a prefill rank writes the probe pattern
// into the prober's scratch region over tcp and shm; the prober verifies it
// and the rank counts the probe.
func TestProbeTransfersAndVerifies(t *testing.T) {
	if err := transport.ProbeTransport("shm"); err != nil {
		t.Skipf("shm unusable here: %v", err)
	}
	addr := startBootstrap(t)
	reg := prometheus.NewRegistry()
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, transports: []string{"tcp", "shm"}, metrics: reg})
	p := newProber(t, "tcp", "shm")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; i < 2; i++ { // a second probe reuses the scratch regions
		rep, err := p.Probe(ctx, pre.m.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		if rep.Refused != "" || len(rep.Results) != 2 || !strings.HasPrefix(rep.Rank, "prefill ") {
			t.Fatalf("report %+v", rep)
		}
		for _, r := range rep.Results {
			if r.Err != "" || !r.Verified || r.Handshake <= 0 || r.Transfer <= 0 {
				t.Errorf("probe %d %s: %+v, want verified with both timings", i, r.Transport, r)
			}
		}
	}
	if n := sample(t, reg, engine.MetricProbes, map[string]string{"result": "passed"}); n != 2 {
		t.Errorf("probes passed = %v, want 2", n)
	}
	if n := sample(t, reg, engine.MetricRooms, nil); n != 0 {
		t.Errorf("a probe counted as a room: %v", n)
	}
}

// TestProbeRefusedAndMismatch: --no-probe refuses; a prober whose only
// transport the rank lacks gets "not applicable" naming both sides.
func TestProbeRefusedAndMismatch(t *testing.T) {
	addr := startBootstrap(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	noProbe := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, noProbe: true})
	p := newProber(t, "tcp")
	rep, err := p.Probe(ctx, noProbe.m.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rep.Refused, "--no-probe") || len(rep.Results) != 0 {
		t.Fatalf("probe of a --no-probe rank: %+v", rep)
	}
	if err := transport.ProbeTransport("shm"); err != nil {
		t.Skipf("shm unusable here: %v", err)
	}
	addr2 := startBootstrap(t)
	tcpOnly := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr2})
	ps := newProber(t, "shm")
	rep, err = ps.Probe(ctx, tcpOnly.m.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 1 || !rep.Results[0].NotApplicable || !strings.Contains(rep.Results[0].Err, "no shm transport (it has tcp)") {
		t.Fatalf("probe offering only shm to a tcp rank: %+v", rep)
	}
}

// TestProbeSilentRank: a listener that never answers (not a kvxfer rank)
// fails the probe with a timeout that says where the answer was expected.
func TestProbeSilentRank(t *testing.T) {
	ln := testenv.SilentListener(t)
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	p, err := engine.NewProber(engine.ProberConfig{Transports: []transport.Transport{tr}, Length: 4096, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, err = p.Probe(context.Background(), ln.Addr().String())
	if !errors.Is(err, engine.ErrTimeout) || !strings.Contains(err.Error(), p.Endpoint()) {
		t.Fatalf("probe of a silent listener: %v, want a timeout naming %s", err, p.Endpoint())
	}
}
