// Command bootstrapload measures the bootstrap directory's GET /route rate
// (per-rank lookups, the decode's hot path) against a minimal Go net/http
// handler that answers the same lookups from the same kind of table, in the
// same run and on the same machine, with wrk (when installed) or a built-in
// keep-alive Go load generator. Rounds alternate between the two servers so
// that background load affects both alike. It also times one
// POST /query_dp_ranks of 10,000 rooms.
//
// Usage:
//
//	go run ./bench/bootstrapload -duration 5s -rounds 3 -connections 32 -threads 2
//	go run ./bench/bootstrapload -gen go      # without wrk
//	go run ./bench/bootstrapload -json out.json
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

type config struct {
	duration    time.Duration
	rounds      int
	connections int
	threads     int
	gen         string
	tpSize      int
	jsonOut     string
}

// Result is one benchmark run's numbers (requests per second per round).
type Result struct {
	Generator     string    `json:"generator"`
	Command       string    `json:"command"`
	Ours          []float64 `json:"ours_rps"`
	Baseline      []float64 `json:"baseline_rps"`
	OursMedian    float64   `json:"ours_median_rps"`
	BaseMedian    float64   `json:"baseline_median_rps"`
	Ratio         float64   `json:"ratio"`
	QueryRooms    int       `json:"query_rooms"`
	QueryMillis   float64   `json:"query_ms"`
	QueryAnswered int       `json:"query_answered"`
}

func main() {
	var c config
	flag.DurationVar(&c.duration, "duration", 5*time.Second, "length of each measured round")
	flag.IntVar(&c.rounds, "rounds", 3, "rounds per server (alternating)")
	flag.IntVar(&c.connections, "connections", 32, "concurrent keep-alive connections")
	flag.IntVar(&c.threads, "threads", 2, "wrk threads")
	flag.StringVar(&c.gen, "gen", "auto", "load generator: auto (wrk if installed), wrk, go")
	flag.IntVar(&c.tpSize, "tp", 8, "registered prefill TP size (lookups cycle over the ranks)")
	flag.StringVar(&c.jsonOut, "json", "", "also write the result as JSON to this file")
	flag.Parse()
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "bootstrapload:", err)
		os.Exit(1)
	}
}

func run(c config) error {
	if c.rounds < 1 || c.connections < 1 || c.threads < 1 || c.tpSize < 1 || c.duration <= 0 {
		return errors.New("-rounds, -connections, -threads, -tp and -duration must be positive")
	}
	gen := c.gen
	if gen == "auto" {
		gen = "go"
		if _, err := exec.LookPath("wrk"); err == nil {
			gen = "wrk"
		}
	}
	if gen != "wrk" && gen != "go" {
		return fmt.Errorf("-gen %q: want auto, wrk or go", c.gen)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Our server, with a complete TP table.
	srv := bootstrap.NewServer(bootstrap.Options{Host: "127.0.0.1", Logger: slog.New(slog.DiscardHandler)})
	errc := make(chan error, 1)
	go func() { errc <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-errc:
		return err
	}
	dtype := "auto"
	for tp := 0; tp < c.tpSize; tp++ {
		if err := srv.Register(bootstrap.RegisterRequest{AttnTPSize: c.tpSize, AttnTPRank: tp, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1,
			SystemDPSize: 1, RankIP: "10.0.0.1", RankPort: 20000 + tp, PageSize: 16, KVCacheDtype: &dtype}); err != nil {
			return err
		}
	}

	// The baseline: a minimal net/http handler doing the same lookup.
	base, err := startBaseline(c.tpSize)
	if err != nil {
		return err
	}
	defer base.Close()
	baseAddr := base.Addr

	path := "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0"
	if c.tpSize <= 3 {
		path = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
	}
	for _, a := range []string{srv.Addr(), baseAddr} {
		if err := check(a, path); err != nil {
			return err
		}
	}

	res := Result{Generator: gen}
	measure := func(addr string) (float64, error) {
		if gen == "wrk" {
			rps, cmd, err := runWrk(addr, path, c)
			res.Command = cmd
			return rps, err
		}
		res.Command = fmt.Sprintf("go load generator: %d keep-alive connections, %s per round", c.connections, c.duration)
		return runGo(addr, path, c)
	}
	// Warm up both, then alternate rounds.
	warm := c
	warm.duration = time.Second
	for _, a := range []string{srv.Addr(), baseAddr} {
		if gen == "wrk" {
			_, _, _ = runWrk(a, path, warm)
		} else {
			_, _ = runGo(a, path, warm)
		}
	}
	for i := 0; i < c.rounds; i++ {
		for j, a := range []string{srv.Addr(), baseAddr} {
			if i%2 == 1 { // alternate the order too
				a = []string{baseAddr, srv.Addr()}[j]
			}
			rps, err := measure(a)
			if err != nil {
				return err
			}
			if a == srv.Addr() {
				res.Ours = append(res.Ours, rps)
			} else {
				res.Baseline = append(res.Baseline, rps)
			}
		}
	}
	res.OursMedian, res.BaseMedian = median(res.Ours), median(res.Baseline)
	res.Ratio = res.OursMedian / res.BaseMedian

	// One 10,000-room query_dp_ranks.
	cl, err := bootstrap.NewClient(srv.Addr())
	if err != nil {
		return err
	}
	rooms := make([]uint64, 10000)
	for i := range rooms {
		rooms[i] = uint64(i)*104729 + 1
		if i%2 == 0 {
			if err := cl.RegisterDPRank(ctx, rooms[i], 0); err != nil {
				return err
			}
		}
	}
	t0 := time.Now()
	got, err := cl.QueryDPRanks(ctx, rooms)
	if err != nil {
		return err
	}
	res.QueryRooms, res.QueryMillis, res.QueryAnswered = len(rooms), float64(time.Since(t0).Microseconds())/1000, len(got)

	fmt.Printf("generator: %s\ncommand:   %s\n", res.Generator, res.Command)
	fmt.Printf("GET %s\n", path)
	fmt.Printf("  kvxfer bootstrap (echo):   %s req/s (median of %v)\n", fmtRPS(res.OursMedian), fmtAll(res.Ours))
	fmt.Printf("  minimal net/http handler:  %s req/s (median of %v)\n", fmtRPS(res.BaseMedian), fmtAll(res.Baseline))
	fmt.Printf("  ratio ours/baseline:       %.2f×  (goal ≥ 0.80×)\n", res.Ratio)
	fmt.Printf("POST /query_dp_ranks with %d rooms: %.1f ms round trip (%d answered)\n", res.QueryRooms, res.QueryMillis, res.QueryAnswered)
	if c.jsonOut != "" {
		b, _ := json.MarshalIndent(res, "", "  ")
		if err := os.WriteFile(c.jsonOut, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write -json %s: %w", c.jsonOut, err)
		}
	}
	return nil
}

// startBaseline serves GET /route with the least a Go handler must do: read
// the four parameters, look the rank up under a read lock, write its JSON.
func startBaseline(tpSize int) (*http.Server, error) {
	type coord struct{ dp, cp, tp, pp int }
	var mu sync.RWMutex
	table := map[coord][]byte{}
	for tp := 0; tp < tpSize; tp++ {
		table[coord{0, 0, tp, 0}] = []byte(fmt.Sprintf(`{"rank_ip":"10.0.0.1","rank_port":%d}`, 20000+tp))
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/route" || r.Method != http.MethodGet {
			http.NotFound(w, r)
			return
		}
		q := r.URL.Query()
		var v [4]int
		for i, n := range [4]string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"} {
			x, err := strconv.Atoi(q.Get(n))
			if err != nil {
				http.Error(w, "Missing inputs for bootstrap server.", http.StatusBadRequest)
				return
			}
			v[i] = x
		}
		mu.RLock()
		b := table[coord{v[0], v[1], v[2], v[3]}]
		mu.RUnlock()
		if b == nil {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		_, _ = w.Write(b)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.Serve(ln) }()
	s.Addr = ln.Addr().String()
	return s, nil
}

func check(addr, path string) error {
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return fmt.Errorf("GET %s%s: %d %s", addr, path, resp.StatusCode, b)
	}
	return nil
}

var wrkRPS = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
var wrkErrs = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)

func runWrk(addr, path string, c config) (float64, string, error) {
	args := []string{"-t", strconv.Itoa(c.threads), "-c", strconv.Itoa(c.connections), "-d", fmt.Sprintf("%ds", max(1, int(c.duration.Seconds()))), "http://" + addr + path}
	cmdline := "wrk " + strings.Join(args, " ")
	out, err := exec.Command("wrk", args...).CombinedOutput()
	if err != nil {
		return 0, cmdline, fmt.Errorf("wrk: %w: %s", err, out)
	}
	if m := wrkErrs.FindSubmatch(out); m != nil {
		return 0, cmdline, fmt.Errorf("wrk saw %s non-2xx answers from %s", m[1], addr)
	}
	m := wrkRPS.FindSubmatch(out)
	if m == nil {
		return 0, cmdline, fmt.Errorf("wrk output has no Requests/sec line: %s", out)
	}
	rps, err := strconv.ParseFloat(string(m[1]), 64)
	return rps, cmdline, err
}

// runGo drives addr with c.connections keep-alive clients for c.duration.
func runGo(addr, path string, c config) (float64, error) {
	tr := &http.Transport{MaxIdleConnsPerHost: c.connections, MaxConnsPerHost: c.connections, Proxy: nil}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	url := "http://" + addr + path
	var n, bad atomic.Int64
	stop := time.Now().Add(c.duration)
	var wg sync.WaitGroup
	start := time.Now()
	for range c.connections {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				resp, err := hc.Get(url)
				if err != nil {
					bad.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					bad.Add(1)
					continue
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	if b := bad.Load(); b > 0 {
		return 0, fmt.Errorf("%d failed requests to %s", b, addr)
	}
	return float64(n.Load()) / time.Since(start).Seconds(), nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtRPS(x float64) string { return strconv.FormatFloat(x, 'f', 0, 64) }

func fmtAll(xs []float64) string {
	out := "["
	for i, x := range xs {
		if i > 0 {
			out += " "
		}
		out += fmtRPS(x)
	}
	return out + "]"
}
