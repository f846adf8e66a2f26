// Command bootstrapload measures the bootstrap directory's GET /route rate
// (per-rank lookups, the decode's hot path) against a minimal Go net/http
// handler that answers the same lookups from the same kind of table, in the
// same run and on the same machine, with wrk (when installed) or a built-in
// keep-alive Go load generator. Each server runs in its own child process;
// rounds alternate between them so that background load affects both alike,
// and besides requests/s it reports requests per server CPU-second (from
// /proc/PID/stat), which background load barely moves. It also times one
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
	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/internal/cluster"
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
	Generator  string    `json:"generator"`
	Command    string    `json:"command"`
	Ours       []float64 `json:"ours_rps"`
	Baseline   []float64 `json:"baseline_rps"`
	OursMedian float64   `json:"ours_median_rps"`
	BaseMedian float64   `json:"baseline_median_rps"`
	Ratio      float64   `json:"ratio"`
	PairRatios []float64 `json:"pair_ratios"`
	PairMedian float64   `json:"pair_ratio_median"`
	// Requests per CPU-second of the server process (robust to background load).
	OursPerCPU       []float64 `json:"ours_req_per_cpu_s"`
	BasePerCPU       []float64 `json:"baseline_req_per_cpu_s"`
	OursPerCPUMedian float64   `json:"ours_req_per_cpu_s_median"`
	BasePerCPUMedian float64   `json:"baseline_req_per_cpu_s_median"`
	CPURatio         float64   `json:"cpu_ratio"`
	QueryRooms       int       `json:"query_rooms"`
	QueryMillis      float64   `json:"query_ms"`
	QueryAnswered    int       `json:"query_answered"`
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
	serve := flag.String("serve", "", "internal: run one server (ours or baseline) as a child process")
	flag.Parse()
	if *serve != "" {
		if err := serveChild(*serve, c.tpSize); err != nil {
			fmt.Fprintln(os.Stderr, "bootstrapload -serve:", err)
			os.Exit(1)
		}
		return
	}
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

	// Each server runs in its own child process so that its CPU time can be
	// read from /proc: requests per server CPU-second is robust to the
	// machine's background load, requests per second is not.
	ours, err := spawn(ctx, "ours", c.tpSize)
	if err != nil {
		return err
	}
	defer ours.stop()
	base, err := spawn(ctx, "baseline", c.tpSize)
	if err != nil {
		return err
	}
	defer base.stop()

	path := "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0"
	if c.tpSize <= 3 {
		path = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
	}
	for _, ch := range []*child{ours, base} {
		if err := check(ch.addr, path); err != nil {
			return err
		}
	}

	res := Result{Generator: gen}
	measure := func(ch *child, cc config) (rps, perCPU float64, err error) {
		cpu0, err := procCPU(ch.proc.PID())
		if err != nil {
			return 0, 0, err
		}
		var n int64
		if gen == "wrk" {
			rps, n, res.Command, err = runWrk(ch.addr, path, cc)
		} else {
			res.Command = fmt.Sprintf("go load generator: %d keep-alive connections, %s per round", cc.connections, cc.duration)
			rps, n, err = runGo(ch.addr, path, cc)
		}
		if err != nil {
			return 0, 0, err
		}
		cpu1, err := procCPU(ch.proc.PID())
		if err != nil {
			return 0, 0, err
		}
		if d := cpu1 - cpu0; d > 0 {
			perCPU = float64(n) / d
		}
		return rps, perCPU, nil
	}
	warm := c
	warm.duration = time.Second
	for _, ch := range []*child{ours, base} {
		if _, _, err := measure(ch, warm); err != nil {
			return err
		}
	}
	for i := 0; i < c.rounds; i++ {
		order := []*child{ours, base}
		if i%2 == 1 { // alternate the order too
			order = []*child{base, ours}
		}
		for _, ch := range order {
			rps, perCPU, err := measure(ch, c)
			if err != nil {
				return err
			}
			if ch == ours {
				res.Ours, res.OursPerCPU = append(res.Ours, rps), append(res.OursPerCPU, perCPU)
			} else {
				res.Baseline, res.BasePerCPU = append(res.Baseline, rps), append(res.BasePerCPU, perCPU)
			}
		}
	}
	res.OursMedian, res.BaseMedian = median(res.Ours), median(res.Baseline)
	res.Ratio = res.OursMedian / res.BaseMedian
	for i := range res.Ours { // adjacent rounds see similar background load
		res.PairRatios = append(res.PairRatios, res.Ours[i]/res.Baseline[i])
	}
	res.PairMedian = median(res.PairRatios)
	res.OursPerCPUMedian, res.BasePerCPUMedian = median(res.OursPerCPU), median(res.BasePerCPU)
	res.CPURatio = res.OursPerCPUMedian / res.BasePerCPUMedian

	// One 10,000-room query_dp_ranks against our server.
	cl, err := bootstrap.NewClient(ours.addr)
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
	fmt.Printf("GET %s  (%d rounds of %s each, alternating; servers in separate processes)\n", path, c.rounds, c.duration)
	fmt.Printf("  kvxfer bootstrap (echo):   %s req/s (median of %s); %s req per server CPU-second (median of %s)\n",
		fmtRPS(res.OursMedian), fmtAll(res.Ours), fmtRPS(res.OursPerCPUMedian), fmtAll(res.OursPerCPU))
	fmt.Printf("  minimal net/http handler:  %s req/s (median of %s); %s req per server CPU-second (median of %s)\n",
		fmtRPS(res.BaseMedian), fmtAll(res.Baseline), fmtRPS(res.BasePerCPUMedian), fmtAll(res.BasePerCPU))
	fmt.Printf("  ratio ours/baseline:       req/s %.2f× of medians, %.2f× median of per-round pairs %s; per CPU-second %.2f×  (goal ≥ 0.80×)\n",
		res.Ratio, res.PairMedian, fmtRatios(res.PairRatios), res.CPURatio)
	fmt.Printf("POST /query_dp_ranks with %d rooms: %.1f ms round trip (%d answered)\n", res.QueryRooms, res.QueryMillis, res.QueryAnswered)
	if c.jsonOut != "" {
		b, _ := json.MarshalIndent(res, "", "  ")
		if err := os.WriteFile(c.jsonOut, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write -json %s: %w", c.jsonOut, err)
		}
	}
	return nil
}

// child is a server process started by spawn.
type child struct {
	proc *cluster.Proc
	addr string
}

// spawn re-executes this program with -serve kind and reads the address it
// prints. The child exits when its stdin closes (stop, or this process dying).
func spawn(ctx context.Context, kind string, tp int) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	line := make(chan string, 1)
	p, err := cluster.Start(cluster.Spec{Name: kind + " server process", Exe: exe, Args: []string{"-serve", kind, "-tp", strconv.Itoa(tp)},
		OnLine: func(b []byte) {
			select {
			case line <- string(b):
			default: // only the first line (the address) is read
			}
		}})
	if err != nil {
		return nil, err
	}
	ch := &child{proc: p}
	select {
	case l := <-line:
		if !strings.HasPrefix(l, "ADDR ") {
			ch.stop()
			return nil, fmt.Errorf("%s server process did not report its address (got %q)", kind, l)
		}
		ch.addr = strings.TrimPrefix(l, "ADDR ")
	case <-p.Exited():
		return nil, fmt.Errorf("%s server process did not report its address: %v", kind, p.Err())
	case <-time.After(10 * time.Second):
		ch.stop()
		return nil, fmt.Errorf("%s server process did not start within 10 s", kind)
	case <-ctx.Done():
		ch.stop()
		return nil, ctx.Err()
	}
	return ch, nil
}

func (ch *child) stop() { ch.proc.Stop(10 * time.Second) }

// serveChild is the child side: serve until stdin reaches EOF.
func serveChild(kind string, tp int) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var addr string
	errc := make(chan error, 1)
	switch kind {
	case "ours":
		srv := server.New(server.Options{Host: "127.0.0.1", Logger: slog.New(slog.DiscardHandler)})
		go func() { errc <- srv.Start(ctx) }()
		select {
		case <-srv.Ready():
		case err := <-errc:
			return err
		}
		dtype := "auto"
		for r := 0; r < tp; r++ {
			if err := srv.Register(bootstrap.RegisterRequest{AttnTPSize: tp, AttnTPRank: r, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1,
				SystemDPSize: 1, RankIP: "10.0.0.1", RankPort: 20000 + r, PageSize: 16, KVCacheDtype: &dtype}); err != nil {
				return err
			}
		}
		addr = srv.Addr()
	case "baseline":
		base, err := startBaseline(tp)
		if err != nil {
			return err
		}
		defer base.Close()
		addr = base.Addr
	default:
		return fmt.Errorf("-serve %q: want ours or baseline", kind)
	}
	fmt.Printf("ADDR %s\n", addr)
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// procCPU returns the user+system CPU seconds of process pid (all threads),
// from /proc/pid/stat (fields 14 and 15, in USER_HZ = 100 ticks per second).
func procCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read CPU time of server process %d: %w", pid, err)
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime/stime", pid)
	}
	return (ut + st) / 100, nil
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
var wrkReqs = regexp.MustCompile(`(\d+) requests in`)
var wrkErrs = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)

func runWrk(addr, path string, c config) (float64, int64, string, error) {
	args := []string{"-t", strconv.Itoa(c.threads), "-c", strconv.Itoa(c.connections), "-d", fmt.Sprintf("%ds", max(1, int(c.duration.Seconds()))), "http://" + addr + path}
	cmdline := "wrk " + strings.Join(args, " ")
	out, err := exec.Command("wrk", args...).CombinedOutput()
	if err != nil {
		return 0, 0, cmdline, fmt.Errorf("wrk: %w: %s", err, out)
	}
	if m := wrkErrs.FindSubmatch(out); m != nil {
		return 0, 0, cmdline, fmt.Errorf("wrk saw %s non-2xx answers from %s", m[1], addr)
	}
	m, mn := wrkRPS.FindSubmatch(out), wrkReqs.FindSubmatch(out)
	if m == nil || mn == nil {
		return 0, 0, cmdline, fmt.Errorf("wrk output has no Requests/sec or request count line: %s", out)
	}
	rps, err := strconv.ParseFloat(string(m[1]), 64)
	n, _ := strconv.ParseInt(string(mn[1]), 10, 64)
	return rps, n, cmdline, err
}

// runGo drives addr with c.connections keep-alive clients for c.duration.
func runGo(addr, path string, c config) (float64, int64, error) {
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
		return 0, 0, fmt.Errorf("%d failed requests to %s", b, addr)
	}
	return float64(n.Load()) / time.Since(start).Seconds(), n.Load(), nil
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

func fmtRatios(xs []float64) string {
	out := "["
	for i, x := range xs {
		if i > 0 {
			out += " "
		}
		out += strconv.FormatFloat(x, 'f', 2, 64)
	}
	return out + "]"
}
