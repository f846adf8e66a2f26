package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// startServer runs a server on 127.0.0.1 at a kernel-chosen port and stops it
// when the test ends.
func startServer(t *testing.T, opts Options) (*Server, *bootstrap.Client) {
	t.Helper()
	if opts.Host == "" {
		opts.Host = "127.0.0.1"
	}
	if opts.Logger == nil && !testing.Verbose() {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := New(opts)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Start(ctx) }()
	select {
	case <-s.Ready():
	case err := <-done:
		cancel()
		t.Fatalf("Start: %v", err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("server not ready after 10 s")
	}
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Start returned %v after shutdown", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("server did not shut down within 10 s")
		}
	})
	c, err := bootstrap.NewClient(s.Addr(), bootstrap.WithAuthToken(opts.AuthToken), bootstrap.WithRegisterTimeout(5*time.Second),
		bootstrap.WithBackoff(5*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	return s, c
}

func reg(tpSize, tpRank, port int) bootstrap.RegisterRequest {
	return bootstrap.RegisterRequest{
		AttnTPSize: tpSize, AttnTPRank: tpRank, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
		RankIP: "127.0.0.1", RankPort: port, PageSize: 16, KVCacheDtype: ptr("auto"),
		LoadBalanceMethod: "follow_bootstrap_room", PrefillHTTPPort: ptr(30000),
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// raw sends one request and returns status, content type and body.
func raw(t *testing.T, method, url, body string, hdr ...string) (int, string, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Content-Type"), string(b)
}

const topoQuery = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"

func TestReadinessCountsDistinctRanks(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	if _, err := c.ServerInfo(ctx); !errors.Is(err, bootstrap.ErrNotReady) {
		t.Fatalf("ServerInfo on empty table: %v, want bootstrap.ErrNotReady", err)
	}
	// Rank 0 of 2 registers three times (retries): SGLang would count 3 ≥ 2.
	for i := range 3 {
		if err := c.Register(ctx, reg(2, 0, 40000+i)); err != nil {
			t.Fatal(err)
		}
	}
	code, _, body := raw(t, "GET", "http://"+s.Addr()+topoQuery, "")
	if code != 503 || body != "Prefill server not fully registered yet (1 workers registered)." {
		t.Fatalf("after duplicate registrations: %d %q, want 503 with SGLang's text", code, body)
	}
	if _, err := c.RankInfo(ctx, 0, 0, 0, 0); !errors.Is(err, bootstrap.ErrNotReady) {
		t.Fatalf("RankInfo before ready: %v, want bootstrap.ErrNotReady", err)
	}
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	if _, err := c.WaitReady(short, 5*time.Millisecond); !errors.Is(err, bootstrap.ErrNotReady) {
		t.Fatalf("WaitReady with a rank missing: %v, want bootstrap.ErrNotReady", err)
	}
	cancel()
	if err := c.Register(ctx, reg(2, 1, 41000)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitReady(ctx, 0); err != nil {
		t.Fatal(err)
	}
	_, _, metrics := raw(t, "GET", "http://"+s.Addr()+"/metrics", "")
	for _, want := range []string{`kvxfer_bootstrap_registrations_total{result="ok"} 2`, `kvxfer_bootstrap_registrations_total{result="replaced"} 2`,
		"kvxfer_bootstrap_table_size 2", "kvxfer_bootstrap_expected_ranks 2", `kvxfer_bootstrap_lookups_total{kind="topology",result="ok"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if !strings.Contains(metrics, "kvxfer_bootstrap_not_ready_total ") || strings.Contains(metrics, "kvxfer_bootstrap_not_ready_total 0") {
		t.Errorf("/metrics does not count the 503s")
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := bootstrap.PrefillServerInfo{AttnTPSize: 2, AttnCPSize: 1, DPSize: 1, PPSize: 1, PageSize: ptr(16),
		KVCacheDtype: ptr("auto"), FollowBootstrapRoom: true, PrefillHTTPPort: ptr(30000), DecodeAllocationPolicy: ptr("early")}
	if !reflect.DeepEqual(*info, want) {
		t.Fatalf("ServerInfo = %+v, want %+v", *info, want)
	}
	ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
	if err != nil || *ri != (bootstrap.PrefillRankInfo{RankIP: "127.0.0.1", RankPort: 40002}) {
		t.Fatalf("RankInfo(0,0,0,0) = %+v, %v; want the latest registration (port 40002)", ri, err)
	}
	if _, err := c.RankInfo(ctx, 0, 0, 5, 0); !errors.Is(err, bootstrap.ErrNotFound) {
		t.Fatalf("RankInfo of unregistered rank: %v, want bootstrap.ErrNotFound", err)
	}
	code, _, body = raw(t, "GET", "http://"+s.Addr()+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=5&target_pp_rank=0", "")
	if code != 404 || body != "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=5 pp_rank=0" {
		t.Fatalf("404 answer = %d %q", code, body)
	}
}

// TestKeySets pins the exact JSON keys of both answers (spec §2.5, §2.6):
// the newest key set by default (decode_allocation_policy always, no
// dsv41_spec_layout when the ranks registered none), SGLang 0094505's with
// --compat.
func TestKeySets(t *testing.T) {
	for _, tc := range []struct {
		compat string
		extra  []string
	}{{"", []string{"decode_allocation_policy"}}, {bootstrap.CompatSGLangNewest, []string{"decode_allocation_policy"}}, {bootstrap.CompatSGLang0094505, nil}} {
		t.Run("compat="+tc.compat, func(t *testing.T) {
			s, c := startServer(t, Options{Compat: tc.compat})
			r := reg(1, 0, 5000)
			r.KVCacheDtype = nil
			r.PrefillHTTPPort = nil
			if err := c.Register(ctxT(t), r); err != nil {
				t.Fatal(err)
			}
			code, ct, body := raw(t, "GET", "http://"+s.Addr()+topoQuery, "")
			if code != 200 || !strings.HasPrefix(ct, "application/json") {
				t.Fatalf("topology: %d %s %s", code, ct, body)
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(body), &m); err != nil {
				t.Fatal(err)
			}
			want := []string{"attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
				"follow_bootstrap_room", "enable_dsa_cache_layer_split", "prefill_http_port",
				"target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
				"required_dst_info_num", "required_prefill_response_num"}
			want = append(want, tc.extra...)
			got := make([]string, 0, len(m))
			for k := range m {
				got = append(got, k)
			}
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("keys = %v\nwant   %v", got, want)
			}
			for _, k := range []string{"kv_cache_dtype", "prefill_http_port", "target_tp_rank", "target_tp_ranks", "required_prefill_response_num"} {
				if m[k] != nil {
					t.Errorf("%s = %v, want null", k, m[k])
				}
			}
			code, _, body = raw(t, "GET", "http://"+s.Addr()+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", "")
			if code != 200 || body != `{"rank_ip":"127.0.0.1","rank_port":5000}` {
				t.Fatalf("rank answer %d %s", code, body)
			}
		})
	}
}

// TestRestartReregistersWithNewPort: a rank that restarts re-registers the
// same coordinates with a new port; lookups see the new port, the count and
// readiness are unchanged, and the client's Register keeps retrying while
// the server is briefly unavailable.
func TestRestartReregistersWithNewPort(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	for tp := range 2 {
		if err := c.Register(ctx, reg(2, tp, 50000+tp)); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Register(ctx, reg(2, 1, 51001)); err != nil {
		t.Fatal(err)
	}
	ri, err := c.RankInfo(ctx, 0, 0, 1, 0)
	if err != nil || ri.RankPort != 51001 {
		t.Fatalf("after restart RankInfo = %+v, %v; want port 51001", ri, err)
	}
	snap := s.Snapshot()
	if !snap.Ready || snap.Registered != 2 || snap.Expected != 2 || snap.Ranks[1].Reregistrations != 1 {
		t.Fatalf("snapshot after restart: %+v", snap)
	}
}

// TestRegisterRetriesUntilServerAnswers puts a front that answers 503 twice
// before passing requests to the real handler.
func TestRegisterRetriesUntilServerAnswers(t *testing.T) {
	s := New(Options{Logger: quiet})
	var calls atomic.Int32
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		s.Handler().ServeHTTP(w, r)
	}))
	defer front.Close()
	c, err := bootstrap.NewClient(front.Listener.Addr().String(), bootstrap.WithBackoff(time.Millisecond, 5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Register(ctxT(t), reg(1, 0, 7000)); err != nil {
		t.Fatalf("Register: %v", err)
	}
	if n := calls.Load(); n != 3 {
		t.Fatalf("%d PUTs, want 3 (two 503s, then success)", n)
	}
	if snap := s.Snapshot(); snap.Registered != 1 {
		t.Fatalf("registered = %d", snap.Registered)
	}
}

func TestRegisterDeadlineIsNamed(t *testing.T) {
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "down", http.StatusBadGateway)
	}))
	defer front.Close()
	var retries atomic.Int32
	var firstRetryErr atomic.Value
	notify := func(attempt int, err error, next time.Duration) {
		if retries.Add(1) == 1 {
			firstRetryErr.Store(err.Error())
		}
	}
	c, _ := bootstrap.NewClient(front.Listener.Addr().String(), bootstrap.WithRegisterTimeout(time.Second), bootstrap.WithBackoff(time.Millisecond, 10*time.Millisecond),
		bootstrap.WithRetryNotify(notify))
	err := c.Register(ctxT(t), reg(1, 0, 7000))
	if !errors.Is(err, bootstrap.ErrRegisterDeadline) || !strings.Contains(err.Error(), "HTTP 502") || !strings.Contains(err.Error(), "attempts") {
		t.Fatalf("err = %v, want bootstrap.ErrRegisterDeadline naming attempts and the last HTTP 502", err)
	}
	// Every retried failure was told to the caller as it happened.
	if n := retries.Load(); n < 2 {
		t.Fatalf("retry notify called %d times, want one per retried attempt", n)
	}
	if e, _ := firstRetryErr.Load().(string); !strings.Contains(e, "HTTP 502") {
		t.Fatalf("first retry notified %q, want the HTTP 502", e)
	}
	// Nothing listening: the deadline error names the transport failure.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	c, _ = bootstrap.NewClient(addr, bootstrap.WithRegisterTimeout(100*time.Millisecond), bootstrap.WithBackoff(time.Millisecond, 10*time.Millisecond))
	if err := c.Register(ctxT(t), reg(1, 0, 7000)); !errors.Is(err, bootstrap.ErrRegisterDeadline) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("err = %v, want bootstrap.ErrRegisterDeadline naming %s", err, addr)
	}
}

func TestRegisterBadRequestNotRetried(t *testing.T) {
	s, c := startServer(t, Options{})
	r := reg(1, 0, 7000)
	r.AttnTPRank = 3
	err := c.Register(ctxT(t), r)
	if !errors.Is(err, bootstrap.ErrBadRequest) || !strings.Contains(err.Error(), "attn_tp_rank") {
		t.Fatalf("err = %v, want bootstrap.ErrBadRequest naming attn_tp_rank", err)
	}
	if s.Snapshot().Registered != 0 {
		t.Fatal("invalid registration entered the table")
	}
}

func TestValidation(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	if err := c.Register(ctx, reg(2, 0, 6000)); err != nil {
		t.Fatal(err)
	}
	before := s.Snapshot()
	good := `"attn_tp_size":2,"attn_tp_rank":1,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":0,"page_size":16,"kv_cache_dtype":"auto"`
	cases := []struct {
		body  string
		code  int
		field string
	}{
		{``, 400, "body"},
		{`[]`, 400, "body"},
		{`{`, 400, "body"},
		{`"x"`, 400, "body"},
		{`{` + good + `}`, 400, "rank_port"},
		{`{` + good + `,"rank_port":6001}`, 400, "rank_ip"},
		{`{` + good + `,"rank_ip":"127.0.0.1"}`, 400, "rank_port"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":0}`, 400, "rank_port"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":65536}`, 400, "rank_port"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":"6001"}`, 400, "rank_port"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":6001.5}`, 400, "rank_port"},
		{`{` + good + `,"rank_ip":"not a host!","rank_port":6001}`, 400, "rank_ip"},
		{`{` + good + `,"rank_ip":7,"rank_port":6001}`, 400, "rank_ip"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":6001,"prefill_http_port":-2}`, 400, "prefill_http_port"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":6001,"enable_dsa_cache_layer_split":"yes"}`, 400, "enable_dsa_cache_layer_split"},
		{`{` + good + `,"rank_ip":"127.0.0.1","rank_port":6001,"load_balance_method":5}`, 400, "load_balance_method"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"attn_tp_rank":1`, `"attn_tp_rank":2`, 1), 400, "attn_tp_rank"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"pp_size":1`, `"pp_size":0`, 1), 400, "pp_size"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"attn_cp_rank":0`, `"attn_cp_rank":-1`, 1), 400, "attn_cp_rank"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"page_size":16`, `"page_size":null`, 1), 400, "page_size"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `,"kv_cache_dtype":"auto"`, ``, 1), 400, "kv_cache_dtype"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"attn_tp_size":2`, `"attn_tp_size":99999999999999999999`, 1), 400, "attn_tp_size"},
		// Valid shape, conflicting topology → 409 naming the field.
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"page_size":16`, `"page_size":32`, 1), 409, "page_size"},
		{strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"kv_cache_dtype":"auto"`, `"kv_cache_dtype":"fp8_e4m3"`, 1), 409, "kv_cache_dtype"},
		{strings.Replace(strings.Replace(`{`+good+`,"rank_ip":"h","rank_port":1}`, `"attn_tp_size":2`, `"attn_tp_size":4`, 1), `"attn_tp_rank":1`, `"attn_tp_rank":3`, 1), 409, "attn_tp_size"},
	}
	for i, tc := range cases {
		code, _, body := raw(t, "PUT", "http://"+s.Addr()+"/route", tc.body)
		if code != tc.code || !strings.Contains(body, tc.field) {
			t.Errorf("case %d %s: got %d %q, want %d naming %q", i, tc.body, code, body, tc.code, tc.field)
		}
	}
	after := s.Snapshot()
	if !reflect.DeepEqual(before, after) {
		t.Fatalf("table changed by rejected input:\nbefore %+v\nafter  %+v", before, after)
	}
	// The remaining rank, registered with an IPv6 address and a hostname form, is accepted.
	if code, _, body := raw(t, "PUT", "http://"+s.Addr()+"/route", `{`+good+`,"rank_ip":"[fd00::7]","rank_port":6001,"extra_future_key":1}`); code != 200 || body != "OK" {
		t.Fatalf("valid PUT: %d %q", code, body)
	}
	ri, err := c.RankInfo(ctx, 0, 0, 1, 0)
	if err != nil || ri.RankIP != "fd00::7" || ri.Endpoint() != "tcp://[fd00::7]:6001" {
		t.Fatalf("IPv6 rank: %+v %v", ri, err)
	}
}

func TestAloneRankMayChangeTopology(t *testing.T) {
	_, c := startServer(t, Options{})
	ctx := ctxT(t)
	if err := c.Register(ctx, reg(2, 0, 6000)); err != nil {
		t.Fatal(err)
	}
	r := reg(1, 0, 6001) // the only rank restarts with TP 1
	if err := c.Register(ctx, r); err != nil {
		t.Fatalf("re-registration of the only rank with a new topology: %v", err)
	}
	if info, err := c.ServerInfo(ctx); err != nil || info.AttnTPSize != 1 {
		t.Fatalf("ServerInfo = %+v, %v", info, err)
	}
	// With two ranks registered, a change is a conflict.
	if err := c.Register(ctx, reg(1, 0, 6002)); err != nil {
		t.Fatal(err)
	}
	r2 := reg(2, 1, 6003)
	r2.AttnTPSize = 2
	if err := c.Register(ctx, reg(2, 1, 6003)); err != nil {
		// tp size 2 rank 1 vs table tp 1 (one rank): conflict because coordinates differ.
		if !errors.Is(err, bootstrap.ErrConflict) {
			t.Fatalf("err = %v, want bootstrap.ErrConflict", err)
		}
	} else {
		t.Fatal("conflicting registration accepted")
	}
}

func TestRouteQueryErrors(t *testing.T) {
	s, c := startServer(t, Options{})
	if err := c.Register(ctxT(t), reg(1, 0, 6000)); err != nil {
		t.Fatal(err)
	}
	base := "http://" + s.Addr()
	cases := []struct {
		method, path string
		code         int
		body         string
	}{
		// SGLang's text, then the missing parameters by name.
		{"GET", "/route", 400, "Missing inputs for bootstrap server. Missing: prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank (GET /route takes all of"},
		{"GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1", 400, "Missing inputs for bootstrap server. Missing: target_pp_rank ("},
		{"GET", "/route?prefill_dp_rank=&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", 400, "Missing inputs for bootstrap server. Missing: prefill_dp_rank ("},
		{"GET", "/route?prefill_dp_rank=x&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", 400, "prefill_dp_rank"},
		{"GET", "/route?prefill_dp_rank=0&prefill_cp_rank=-1&target_tp_rank=0&target_pp_rank=0", 400, "prefill_cp_rank"},
		{"GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=-7&target_pp_rank=0", 400, "target_tp_rank"},
		{"POST", "/route", 405, "Method not allowed"},
		{"PATCH", "/route", 405, "Method not allowed"},
		{"GET", "/health", 200, "OK"},
		{"GET", "/nope", 404, "Not Found"},
		{"GET", "/metrics", 200, "kvxfer_bootstrap_table_size 1"},
		{"GET", "/v1/table", 200, `"ready":true`},
		{"POST", "/query_dp_ranks", 400, "body"},
		{"POST", "/query_dp_ranks", 400, "bootstrap_rooms"},
		{"POST", "/register_dp_rank", 400, "bootstrap_room"},
		{"DELETE", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", 400, "prefill_dp_rank"},
		{"DELETE", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0", 404, "tp_rank=3"},
		// HEAD: aiohttp answers it on every add_get route (SGLang's /health,
		// which load balancers probe); /route is add_route("*"), whose
		// handler answers 405 to anything but GET/PUT.
		{"HEAD", "/health", 200, ""},
		{"HEAD", "/v1/table", 200, ""},
		{"HEAD", "/route", 405, ""},
	}
	bodies := map[int]string{13: `{}`, 14: `{"dp_rank":0}`}
	for i, tc := range cases {
		code, _, body := raw(t, tc.method, base+tc.path, bodies[i])
		if code != tc.code || !strings.Contains(body, tc.body) {
			t.Errorf("%s %s: %d %q, want %d containing %q", tc.method, tc.path, code, body, tc.code, tc.body)
		}
	}
}

func TestDeregister(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	for tp := range 2 {
		if err := c.Register(ctx, reg(2, tp, 6000+tp)); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Deregister(ctx, bootstrap.Coord{DP: 0, CP: 0, TP: 1, PP: 0}, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ServerInfo(ctx); !errors.Is(err, bootstrap.ErrNotReady) {
		t.Fatalf("after deregistration: %v, want bootstrap.ErrNotReady", err)
	}
	if err := c.Deregister(ctx, bootstrap.Coord{DP: 0, CP: 0, TP: 1, PP: 0}, ""); !errors.Is(err, bootstrap.ErrNotFound) {
		t.Fatalf("second deregistration: %v, want bootstrap.ErrNotFound", err)
	}
	if err := c.Deregister(ctx, bootstrap.Coord{DP: 0, CP: 0, TP: 0, PP: 0}, ""); err != nil {
		t.Fatal(err)
	}
	// Empty table: a new topology is accepted.
	if err := c.Register(ctx, reg(1, 0, 6100)); err != nil {
		t.Fatal(err)
	}
	if snap := s.Snapshot(); !snap.Ready || snap.Expected != 1 {
		t.Fatalf("snapshot %+v", snap)
	}
}

func TestAuth(t *testing.T) {
	s, c := startServer(t, Options{AuthToken: "s3cret"})
	ctx := ctxT(t)
	base := "http://" + s.Addr()
	body, _ := json.Marshal(reg(1, 0, 6000))
	for _, h := range [][]string{nil, {"Authorization", "Bearer wrong"}, {"Authorization", "s3cret"}, {"Authorization", "Basic s3cret"}} {
		if code, _, msg := raw(t, "PUT", base+"/route", string(body), h...); code != 401 || msg != "Unauthorized" {
			t.Errorf("PUT with %v: %d %q, want 401 Unauthorized", h, code, msg)
		}
	}
	if code, _, _ := raw(t, "POST", base+"/register_dp_rank", `{"bootstrap_room":1,"dp_rank":0}`); code != 401 {
		t.Errorf("register_dp_rank without token: %d, want 401", code)
	}
	if code, _, _ := raw(t, "DELETE", base+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", ""); code != 401 {
		t.Errorf("DELETE without token: %d, want 401", code)
	}
	if code, _, msg := raw(t, "PUT", base+"/route", string(body), "Authorization", "bEaReR s3cret"); code != 200 {
		t.Fatalf("PUT with lower-case scheme: %d %q", code, msg)
	}
	if err := c.Register(ctx, reg(1, 0, 6001)); err != nil {
		t.Fatal(err)
	}
	noTok, _ := bootstrap.NewClient(s.Addr())
	if _, err := noTok.ServerInfo(ctx); err != nil { // read routes stay open
		t.Fatal(err)
	}
	err := noTok.Register(ctx, reg(1, 0, 6002))
	if !errors.Is(err, bootstrap.ErrUnauthorized) || !strings.Contains(err.Error(), "the directory requires a token") ||
		!strings.Contains(err.Error(), "KVXFER_BOOTSTRAP_AUTH_TOKEN") {
		t.Fatalf("Register without token: %v, want bootstrap.ErrUnauthorized saying the directory requires a token and naming KVXFER_BOOTSTRAP_AUTH_TOKEN", err)
	}
	wrong, _ := bootstrap.NewClient(s.Addr(), bootstrap.WithAuthToken("guess"))
	err = wrong.Deregister(ctx, bootstrap.Coord{DP: 0, CP: 0, TP: 0, PP: 0}, "")
	if !errors.Is(err, bootstrap.ErrUnauthorized) || !strings.Contains(err.Error(), "refused this rank's bearer token") {
		t.Fatalf("Deregister with a wrong token: %v, want ErrUnauthorized saying the token was refused", err)
	}
}

func TestDPRankRegistry(t *testing.T) {
	s, c := startServer(t, Options{EntryTTL: time.Hour})
	ctx := ctxT(t)
	r := reg(1, 0, 6000)
	r.AttnDPSize = 4
	r.LoadBalanceMethod = "round_robin"
	for dp := range 4 {
		r.AttnDPRank = dp
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	info, err := c.ServerInfo(ctx)
	if err != nil || info.FollowBootstrapRoom || info.DPSize != 4 {
		t.Fatalf("info %+v %v", info, err)
	}
	if _, ok := bootstrap.SelectDPRank(*info, 5); ok {
		t.Fatal("SelectDPRank must defer to the registry when the prefill does not follow the room")
	}
	const n = 10000
	rooms := make([]uint64, n)
	for i := range rooms {
		rooms[i] = uint64(1<<62) + uint64(i)*7919
		switch {
		case i%2 == 1:
		case i < 400: // through HTTP
			if err := c.RegisterDPRank(ctx, rooms[i], i%4); err != nil {
				t.Fatal(err)
			}
		default: // directly, to keep the test fast under -race
			s.roomMu.Lock()
			s.rooms[rooms[i]] = roomEntry{dp: i % 4, at: time.Now()}
			s.roomMu.Unlock()
		}
	}
	if err := c.RegisterDPRank(ctx, 1<<63-1, 3); err != nil {
		t.Fatal(err)
	}
	got, err := c.QueryDPRanks(ctx, append(rooms, 1<<63-1))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != n/2+1 || got[1<<63-1] != 3 {
		t.Fatalf("query answered %d rooms (max room → %d), want %d", len(got), got[1<<63-1], n/2+1)
	}
	for i, room := range rooms {
		dp, ok := got[room]
		if ok != (i%2 == 0) || (ok && dp != i%4) {
			t.Fatalf("room %d: %d, %v", room, dp, ok)
		}
	}
	base := "http://" + s.Addr()
	for _, b := range []string{`{"bootstrap_room":-1,"dp_rank":0}`, `{"bootstrap_room":9223372036854775808,"dp_rank":0}`,
		`{"bootstrap_room":"5","dp_rank":0}`, `{"bootstrap_room":5,"dp_rank":4}`, `{"bootstrap_room":5}`} {
		if code, _, msg := raw(t, "POST", base+"/register_dp_rank", b); code != 400 || !(strings.Contains(msg, "bootstrap_room") || strings.Contains(msg, "dp_rank")) {
			t.Errorf("register_dp_rank %s: %d %q, want 400 naming the field", b, code, msg)
		}
	}
	if code, _, msg := raw(t, "POST", base+"/query_dp_ranks", `{"bootstrap_rooms":[1,2,"x"]}`); code != 400 || !strings.Contains(msg, "bootstrap_rooms[2]") {
		t.Errorf("query with bad element: %d %q", code, msg)
	}
	if code, _, msg := raw(t, "POST", base+"/query_dp_ranks", `{"bootstrap_rooms":[]}`); code != 200 || msg != "{}" {
		t.Errorf("empty query: %d %q", code, msg)
	}
}

func TestDPRankEntriesExpire(t *testing.T) {
	s, c := startServer(t, Options{EntryTTL: 20 * time.Millisecond})
	ctx := ctxT(t)
	if err := c.RegisterDPRank(ctx, 42, 1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := c.QueryDPRanks(ctx, []uint64{42})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := got[42]; !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("room 42 still answered 10 s after a 20 ms TTL")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The sweeper also removes it from the map.
	for s.Snapshot().DPRooms != 0 {
		if time.Now().After(deadline) {
			t.Fatal("expired room never swept")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestCheckLeader(t *testing.T) {
	leader, _ := startServer(t, Options{DistInitAddr: "10.0.0.1:5000"})
	other, _ := startServer(t, Options{})
	ctx := ctxT(t)
	c, _ := bootstrap.NewClient(leader.Addr())
	if err := c.CheckLeader(ctx, "10.0.0.1:5000"); err != nil {
		t.Fatalf("CheckLeader on the leader: %v", err)
	}
	if err := c.CheckLeader(ctx, "10.0.0.2:5000"); !errors.Is(err, bootstrap.ErrWrongLeader) || !strings.Contains(err.Error(), "10.0.0.1:5000") {
		t.Fatalf("CheckLeader with another dist-init-addr: %v", err)
	}
	c2, _ := bootstrap.NewClient(other.Addr()) // a follower that was given the wrong port
	if err := c2.CheckLeader(ctx, "10.0.0.1:5000"); !errors.Is(err, bootstrap.ErrWrongLeader) || !strings.Contains(err.Error(), other.Addr()) {
		t.Fatalf("CheckLeader on a non-leader: %v", err)
	}
	// The address a follower derives from dist-init-addr + the leader's port.
	_, port, _ := net.SplitHostPort(leader.Addr())
	var p int
	fmt.Sscan(port, &p)
	addr, err := bootstrap.LeaderBootstrapAddr("127.0.0.1:29500", p)
	if err != nil || addr != leader.Addr() {
		t.Fatalf("LeaderBootstrapAddr = %q, %v; want %q", addr, err, leader.Addr())
	}
}

func TestStartErrors(t *testing.T) {
	s, _ := startServer(t, Options{})
	_, port, _ := net.SplitHostPort(s.Addr())
	var p int
	fmt.Sscan(port, &p)
	ctx := ctxT(t)
	err := New(Options{Host: "127.0.0.1", Port: p, Logger: quiet}).Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "listen on 127.0.0.1:"+port) {
		t.Fatalf("second server on the same port: %v, want a listen error naming the address", err)
	}
	if err := New(Options{Compat: "sglang-9", Logger: quiet}).Start(ctx); err == nil || !strings.Contains(err.Error(), "sglang-9") {
		t.Fatalf("bad compat: %v", err)
	}
	if err := s.Start(ctx); err == nil {
		t.Fatal("second Start on one server succeeded")
	}
}

func TestIPv6Listener(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	ln.Close()
	s, c := startServer(t, Options{Host: "::1"})
	if !strings.HasPrefix(s.Addr(), "[::1]:") {
		t.Fatalf("Addr = %q", s.Addr())
	}
	r := reg(1, 0, 6000)
	r.RankIP = "::1"
	if err := c.Register(ctxT(t), r); err != nil {
		t.Fatal(err)
	}
	if err := c.Health(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// TestEndToEndResolve walks a decode's discovery: topology, mapping, per-rank
// lookups for a TP 4 prefill and a TP 2 MLA decode.
func TestEndToEndResolve(t *testing.T) {
	_, c := startServer(t, Options{})
	ctx := ctxT(t)
	for tp := range 4 {
		if err := c.Register(ctx, reg(4, tp, 7000+tp)); err != nil {
			t.Fatal(err)
		}
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dp, ok := bootstrap.SelectDPRank(*info, 99)
	if !ok || dp != 0 {
		t.Fatalf("SelectDPRank = %d, %v", dp, ok)
	}
	d := bootstrap.DecodeRank{AttnTPSize: 2, AttnTPRank: 1, AttnCPSize: 1, PPSize: 1, IsMLA: true, PageSize: 16, KVCacheDtype: "auto"}
	tg, err := bootstrap.TargetRanks(*info, d, dp)
	if err != nil {
		t.Fatal(err)
	}
	var ports []int
	for _, r := range tg.Ranks {
		ri, err := c.RankInfo(ctx, r.DP, r.CP, r.TP, r.PP)
		if err != nil {
			t.Fatal(err)
		}
		ports = append(ports, ri.RankPort)
	}
	if !slices.Equal(ports, []int{7002, 7003}) || tg.RequiredPrefillResponseNum != 1 || !tg.Ranks[1].Dummy {
		t.Fatalf("ports %v targets %+v", ports, tg)
	}
}

var quiet = slog.New(slog.DiscardHandler)

// TestConcurrentRegistrations registers 64 ranks from 64 goroutines, each
// twice, while readers poll: the count is exact and readiness comes once
// every distinct rank is in.
func TestConcurrentRegistrations(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	const n = 64
	errs := make(chan error, 2*n)
	stop := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := c.ServerInfo(ctx); err != nil && !errors.Is(err, bootstrap.ErrNotReady) {
				errs <- err
				return
			}
		}
	}()
	done := make(chan struct{})
	for tp := range n {
		go func() {
			defer func() { done <- struct{}{} }()
			for k := range 2 {
				if err := c.Register(ctx, reg(n, tp, 10000+tp*2+k)); err != nil {
					errs <- err
				}
			}
		}()
	}
	for range n {
		<-done
	}
	close(stop)
	<-readerDone
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	snap := s.Snapshot()
	if !snap.Ready || snap.Registered != n || len(snap.Missing) != 0 {
		t.Fatalf("ready=%v registered=%d missing=%d", snap.Ready, snap.Registered, len(snap.Missing))
	}
	for _, r := range snap.Ranks {
		if r.RankPort != 10000+r.TP*2+1 || r.Reregistrations != 1 {
			t.Fatalf("rank %+v: want the second registration's port", r)
		}
	}
}

func TestNewFollowerClient(t *testing.T) {
	leader, _ := startServer(t, Options{DistInitAddr: "127.0.0.1:29500"})
	other, _ := startServer(t, Options{DistInitAddr: "127.0.0.1:29600"})
	ctx := ctxT(t)
	port := func(s *Server) int {
		_, p, _ := net.SplitHostPort(s.Addr())
		var n int
		fmt.Sscan(p, &n)
		return n
	}
	c, err := bootstrap.NewFollowerClient(ctx, "127.0.0.1:29500", port(leader))
	if err != nil || c.Addr() != leader.Addr() {
		t.Fatalf("follower client: %v, %v", c, err)
	}
	if err := c.Register(ctx, reg(1, 0, 6000)); err != nil {
		t.Fatal(err)
	}
	// A follower given another instance's port.
	if _, err := bootstrap.NewFollowerClient(ctx, "127.0.0.1:29500", port(other)); !errors.Is(err, bootstrap.ErrWrongLeader) {
		t.Fatalf("wrong port: %v, want bootstrap.ErrWrongLeader", err)
	}
	// A follower given a port nobody serves.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	_, p, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	var dead int
	fmt.Sscan(p, &dead)
	_, err = bootstrap.NewFollowerClient(ctx, "127.0.0.1:29500", dead, bootstrap.WithRegisterTimeout(100*time.Millisecond), bootstrap.WithBackoff(time.Millisecond, 10*time.Millisecond))
	if err == nil || !strings.Contains(err.Error(), "no leader bootstrap server") || !strings.Contains(err.Error(), p) {
		t.Fatalf("dead port: %v", err)
	}
}

func TestRoomRegistryBound(t *testing.T) {
	s, c := startServer(t, Options{MaxRooms: 2})
	ctx := ctxT(t)
	for room := range uint64(2) {
		if err := c.RegisterDPRank(ctx, room, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.RegisterDPRank(ctx, 1, 0); err != nil { // an update is not a new entry
		t.Fatal(err)
	}
	code, _, body := raw(t, "POST", "http://"+s.Addr()+"/register_dp_rank", `{"bootstrap_room":7,"dp_rank":0}`)
	if code != 429 || !strings.Contains(body, "registry full") {
		t.Fatalf("third room: %d %q, want 429", code, body)
	}
}

func ptr[T any](v T) *T { return &v }
