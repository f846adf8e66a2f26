package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// checkInLoop checks rank `at` in as instance id every period until stop
// closes.
func checkInLoop(t *testing.T, c *bootstrap.Client, at bootstrap.Coord, id string, period time.Duration, stop <-chan struct{}, wg *sync.WaitGroup) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := c.CheckIn(ctx, at, id)
			cancel()
			if err != nil {
				t.Errorf("check-in %s as %s: %v", at, id, err)
			}
			select {
			case <-stop:
				return
			case <-time.After(period):
			}
		}
	}()
}

// TestSilentRankReportedStale (issue 26 item 10): two ranks declare a
// 200 ms heartbeat and check in; while both do the table is ready. Once
// rank 1 stops, the table reports it stale (and not ready, with the time it
// was last heard from) within the bound, the metric counts it, while
// GET /route still answers its endpoint and the topology (SGLang's wire,
// and a decode judges the rank itself). A check-in by another instance id
// does not revive it; its own does.
func TestSilentRankReportedStale(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	const hb = 200
	bound := bootstrap.StaleAfter(hb * time.Millisecond)
	coords := []bootstrap.Coord{{TP: 0}, {TP: 1}}
	for tp := range 2 {
		r := reg(2, tp, 41000+tp)
		r.InstanceID, r.Epoch, r.HeartbeatMS = fmt.Sprintf("p%d", tp), 1, hb
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	stop0, stop1 := make(chan struct{}), make(chan struct{})
	defer wg.Wait()
	defer close(stop0)
	checkInLoop(t, c, coords[0], "p0", 50*time.Millisecond, stop0, &wg)
	checkInLoop(t, c, coords[1], "p1", 50*time.Millisecond, stop1, &wg)
	for start := time.Now(); time.Since(start) < bound+500*time.Millisecond; time.Sleep(50 * time.Millisecond) {
		if snap := s.Snapshot(); !snap.Ready || snap.Stale != 0 {
			t.Fatalf("ranks checking in every 50 ms (bound %v) reported stale: %+v", bound, snap)
		}
	}
	close(stop1)
	stopped := time.Now()
	var snap bootstrap.TableSnapshot
	for {
		tab, err := c.Table(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if snap = *tab; snap.Stale == 1 {
			break
		}
		if time.Since(stopped) > 10*time.Second {
			t.Fatalf("rank 1 silent for %v, bound %v, not reported stale: %+v", time.Since(stopped), bound, snap)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("silent rank reported stale %v after its last check-in (bound %v)", time.Since(stopped).Round(time.Millisecond), bound)
	if snap.Ready || snap.Ranks[0].Stale || !snap.Ranks[1].Stale || snap.Ranks[1].SilentSince == nil || snap.Ranks[1].HeartbeatMS != hb {
		t.Fatalf("table %+v", snap)
	}
	if code, _, body := raw(t, http.MethodGet, "http://"+s.Addr()+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", ""); code != 200 || !strings.Contains(body, `"rank_port":41001`) {
		t.Fatalf("GET /route for the stale rank: %d %q, want its endpoint", code, body)
	}
	if _, err := c.ServerInfo(ctx); err != nil {
		t.Fatalf("topology with a stale rank: %v", err)
	}
	if _, _, m := raw(t, http.MethodGet, "http://"+s.Addr()+"/metrics", ""); !strings.Contains(m, "kvxfer_bootstrap_stale_ranks 1") {
		t.Errorf("/metrics lacks kvxfer_bootstrap_stale_ranks 1")
	}
	if e, err := c.CheckIn(ctx, coords[1], "intruder"); err != nil || !e.Stale || e.InstanceID != "p1" {
		t.Fatalf("check-in by another instance: %+v %v, want the stale entry unchanged", e, err)
	}
	if e, err := c.CheckIn(ctx, coords[1], "p1"); err != nil || e.Stale || e.SilentSince != nil {
		t.Fatalf("the rank's own check-in: %+v %v, want it live again", e, err)
	}
	if snap := s.Snapshot(); !snap.Ready || snap.Stale != 0 {
		t.Fatalf("after the check-in: %+v", snap)
	}
}

// TestHeartbeatFields: heartbeat_ms needs an instance id and a sane range;
// a rank that declares none is never stale; with a token, a check-in
// without it is refused (401) while a plain read is not.
func TestHeartbeatFields(t *testing.T) {
	s, c := startServer(t, Options{AuthToken: "tok"})
	for _, tc := range []struct{ extra, want string }{
		{`"heartbeat_ms":2000,`, "needs instance_id"},
		{`"instance_id":"p0","heartbeat_ms":0,`, "out of range"},
		{`"instance_id":"p0","heartbeat_ms":"2000",`, "heartbeat_ms"},
	} {
		body := strings.Replace(sglangBody(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 41000), "{", "{"+tc.extra, 1)
		if code, _, text := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", body, "Authorization", "Bearer tok"); code != 400 || !strings.Contains(text, tc.want) {
			t.Errorf("%s: %d %q, want 400 naming %q", tc.extra, code, text, tc.want)
		}
	}
	r := reg(1, 0, 41000)
	r.InstanceID = "p0"
	if err := c.Register(ctxT(t), r); err != nil {
		t.Fatal(err)
	}
	e := s.table[bootstrap.Coord{}]
	e.lastSeen.Store(time.Now().Add(-time.Hour).UnixNano()) // silent for an hour, but promised nothing
	if snap := s.Snapshot(); !snap.Ready || snap.Stale != 0 {
		t.Fatalf("a rank without heartbeat_ms reported stale: %+v", snap)
	}
	anon, err := bootstrap.NewClient(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := anon.CheckIn(ctxT(t), bootstrap.Coord{}, "p0"); !errors.Is(err, bootstrap.ErrUnauthorized) {
		t.Fatalf("check-in without the token: %v, want ErrUnauthorized", err)
	}
	if _, err := anon.Entry(ctxT(t), bootstrap.Coord{}); err != nil {
		t.Fatalf("read without the token: %v", err)
	}
	if _, err := c.CheckIn(ctxT(t), bootstrap.Coord{}, "p0"); err != nil {
		t.Fatalf("check-in with the token: %v", err)
	}
}
