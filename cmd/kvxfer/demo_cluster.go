package main

// kvxfer demo's processes: the embedded bootstrap server, the prefill and
// decode ranks, how they start (with the prefault's progress) and how the
// requests are driven through them.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/internal/hostmem"
	"github.com/kvxfer/kvxfer/metadata"
	"github.com/kvxfer/kvxfer/workload"
)

// demoCluster is a running demo: its bootstrap server, metadata store and
// ranks; close stops them all.
type demoCluster struct {
	addr              string
	prefills, decodes []*child
	children          []*child
	transports        []string
	closers           []func()
}

// close stops the ranks (stdin closed, SIGTERM after 10 s), then the
// metadata publication and the bootstrap server, in reverse start order.
func (c *demoCluster) close() {
	for i := len(c.closers) - 1; i >= 0; i-- {
		c.closers[i]()
	}
}

// startDemoCluster starts the bootstrap server (and the metadata
// publication with --metadata) and the ranks, and waits until every rank
// is ready.
func startDemoCluster(ctx context.Context, f *demoFlags, p *demoPlan) (c *demoCluster, err error) {
	if f.device == "" {
		what, need := demoHostBytes(f, p)
		if err := hostmem.Check(what, need, "use a smaller --pool-mb (or --prefix-cache-mb), or fewer ranks"); err != nil {
			return nil, err
		}
	}
	c = &demoCluster{}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	token := bootstrapToken(f.authToken, os.Getenv)
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0, AuthToken: token})
	sctx, cancelSrv := context.WithCancel(context.Background())
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Start(sctx) }()
	c.closers = append(c.closers, func() { cancelSrv(); <-srvDone })
	select {
	case <-srv.Ready():
	case err := <-srvDone:
		return c, fmt.Errorf("bootstrap server: %w", err)
	}
	c.addr = srv.Addr()
	store, err := openMetadata(ctx, f.metadata, f.metadataTTL)
	if err != nil {
		return c, err
	}
	if store != nil {
		c.closers = append(c.closers, func() { _ = store.Close() })
		pctx, stopPub := context.WithCancel(context.Background())
		pubDone := make(chan struct{})
		go func() { defer close(pubDone); store.PublishInstanceLoop(pctx, c.addr, srv.Snapshot, 0, 0) }()
		c.closers = append(c.closers, func() { stopPub(); <-pubDone })
	}
	if err := c.startRanks(f, p, store, token); err != nil {
		return c, err
	}
	if c.transports, err = waitReady(ctx, f, c.children); err != nil {
		return c, err
	}
	fmt.Fprintf(os.Stderr, "kvxfer demo: bootstrap %s; %d prefill rank(s) (tp %d × pp %d), %d decode rank(s); model %s; %d requests; transports %v\n",
		c.addr, len(c.prefills), f.prefillTP, f.prefillPP, len(c.decodes), p.model.Name, len(p.reqs), c.transports)
	return c, nil
}

// demoHostBytes is the host memory the demo's ranks' KV pools take at most
// (bytes) and what they are in words: --pool-mb for each prefill and decode
// rank, plus each decode rank's prefix cache (--prefix-cache-mb).
func demoHostBytes(f *demoFlags, p *demoPlan) (string, uint64) {
	ranks := f.prefillTP*f.prefillPP + f.decodeTP
	need := uint64(ranks) * uint64(f.poolMB) << 20
	what := fmt.Sprintf("--pool-mb %d for each of the demo's %d ranks (--prefill-tp %d × --prefill-pp %d + --decode-tp %d)", f.poolMB, ranks, f.prefillTP, f.prefillPP, f.decodeTP)
	if p.prefixBlocks > 0 {
		need += uint64(f.decodeTP) * uint64(f.prefixMB) << 20
		what += fmt.Sprintf(" and --prefix-cache-mb %d for each decode rank", f.prefixMB)
	}
	return what + ": their KV pools in host memory", need
}

// startRanks starts the prefill ranks (TP × PP processes) and the decode
// ranks of this binary, with the demo's settings as their flags and the
// secrets (bootstrap token, metadata URL) in their environment.
func (c *demoCluster) startRanks(f *demoFlags, p *demoPlan, store *metadata.Store, token string) error {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	common := []string{"--log-level", f.childLog, "--model", f.model, "--page-size", strconv.Itoa(f.pageSize),
		"--pool-mb", strconv.Itoa(f.poolMB), "--transport", f.transport, "--bootstrap", c.addr,
		"--bootstrap-timeout", f.timeout.String(), "--waiting-timeout", f.timeout.String(), "--prefault=" + strconv.FormatBool(f.prefault),
		"--metrics-addr", "127.0.0.1:0"}
	if f.otlpEndpoint != "" {
		common = append(common, "--otlp-endpoint", f.otlpEndpoint)
	}
	if f.device != "" {
		common = append(common, "--device", f.device)
	}
	var env []string
	if store != nil {
		// Through the environment: the URL may carry credentials one day.
		env = append(env, metadataEnv+"="+f.metadata)
		common = append(common, "--metadata-ttl", f.metadataTTL.String())
	}
	if token != "" {
		env = append(env, "KVXFER_BOOTSTRAP_AUTH_TOKEN="+token)
	}
	c.closers = append(c.closers, func() {
		var wg sync.WaitGroup
		for _, ch := range c.children {
			wg.Go(func() { ch.stop(10 * time.Second) })
		}
		wg.Wait()
	})
	start := func(name string, args []string) (*child, error) {
		if f.fragment { // distinct, non-zero free-list seeds per rank
			args = append(args, "--fragment-seed", strconv.FormatUint(p.seed*0x9e3779b97f4a7c15+uint64(len(c.children))+1|1, 10))
		}
		ch, err := startChild(exe, name, append(append([]string{}, common...), args...), env)
		if err == nil {
			c.children = append(c.children, ch)
		}
		return ch, err
	}
	for tp := 0; tp < f.prefillTP; tp++ {
		for pp := 0; pp < f.prefillPP; pp++ {
			ch, err := start(fmt.Sprintf("prefill tp%d pp%d", tp, pp), []string{"prefill", "--tp-size", strconv.Itoa(f.prefillTP), "--tp-rank", strconv.Itoa(tp),
				"--pp-size", strconv.Itoa(f.prefillPP), "--pp-rank", strconv.Itoa(pp), "--chunk-pages", strconv.Itoa(f.chunkPages)})
			if err != nil {
				return err
			}
			c.prefills = append(c.prefills, ch)
		}
	}
	for tp := 0; tp < f.decodeTP; tp++ {
		args := []string{"decode", "--tp-size", strconv.Itoa(f.decodeTP), "--tp-rank", strconv.Itoa(tp), "--verify", "--checksum=" + strconv.FormatBool(f.checksum)}
		if p.prefixBlocks > 0 {
			args = append(args, "--prefix-cache-blocks", strconv.Itoa(p.prefixBlocks), "--prefix-block-tokens", strconv.Itoa(workload.DefaultBlockTokens))
		}
		ch, err := start(fmt.Sprintf("decode tp%d", tp), args)
		if err != nil {
			return err
		}
		c.decodes = append(c.decodes, ch)
	}
	return nil
}

// waitReady waits for every rank's ready line (recording its metrics
// address) and returns the transports the last one opened. Prefaulting
// makes every page of the pools resident and warm before a rank is ready
// (about one memory pass per rank: well under a second per GiB on bare
// metal, a minute or more in some VMs), so with --prefault it allows 10
// minutes, else 60 s, and shows the progress (startProgress) meanwhile.
func waitReady(ctx context.Context, f *demoFlags, children []*child) ([]string, error) {
	readyLimit := 60 * time.Second
	if f.prefault {
		readyLimit = 10 * time.Minute
	}
	prog := newStartProgress(os.Stderr, f, children)
	defer prog.stop()
	deadline := time.NewTimer(readyLimit)
	defer deadline.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var transports []string
	for i, c := range children {
		for ready := false; !ready; {
			select {
			case r := <-c.ready:
				ready = true
				transports, c.metrics = r.Transports, r.Metrics
				prog.ready(i)
			case <-tick.C:
				prog.update()
			case <-c.exit():
				return nil, fmt.Errorf("%s exited before it was ready: %v", c.name, c.proc.Err())
			case <-deadline.C:
				return nil, fmt.Errorf("%s not ready within %s", c.name, readyLimit)
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
	return transports, nil
}

// startProgress shows how far the ranks' start got: the bytes of KV
// buffers they have made resident (each rank's RssShmem, the memfd pages
// of its pool, against its --pool-mb) and the ranks ready. On a terminal
// it is a progress bar (schollz/progressbar); otherwise a line every 5 s
// once the start takes longer than that (nothing for a quick start).
type startProgress struct {
	w        io.Writer
	children []*child
	isReady  []bool
	poolB    int64 // per rank; 0: not measured (--prefault=false, --device)
	bar      *progressbar.ProgressBar
	began    time.Time
	lastLine time.Time
	// every is how often a line is printed without a terminal.
	every time.Duration
}

func newStartProgress(w io.Writer, f *demoFlags, children []*child) *startProgress {
	p := &startProgress{w: w, children: children, isReady: make([]bool, len(children)), began: time.Now(), every: 5 * time.Second}
	p.lastLine = p.began
	if f.prefault && f.device == "" {
		p.poolB = int64(f.poolMB) << 20
	}
	if p.poolB > 0 && !f.noProgress && isTerminal(w) {
		p.bar = progressbar.NewOptions64(p.poolB*int64(len(children)), progressbar.OptionSetWriter(w), progressbar.OptionSetDescription("prefault KV buffers"),
			progressbar.OptionShowBytes(true), progressbar.OptionSetWidth(30), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(200*time.Millisecond),
			progressbar.OptionSetPredictTime(true))
	}
	return p
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

func (p *startProgress) ready(i int) {
	p.isReady[i] = true
	p.update()
}

// resident is the KV buffer bytes made resident so far, over all ranks
// (a ready rank counts whole).
func (p *startProgress) resident() int64 {
	var n int64
	for i, c := range p.children {
		if p.isReady[i] {
			n += p.poolB
			continue
		}
		n += min(rssShmem(c.proc.PID()), p.poolB)
	}
	return n
}

func (p *startProgress) update() {
	nReady := 0
	for _, r := range p.isReady {
		if r {
			nReady++
		}
	}
	if p.bar != nil {
		_ = p.bar.Set64(p.resident())
		p.bar.Describe(fmt.Sprintf("prefault KV buffers, %d of %d ranks ready", nReady, len(p.children)))
		return
	}
	if nReady == len(p.children) || time.Since(p.lastLine) < p.every {
		return
	}
	p.lastLine = time.Now()
	msg := fmt.Sprintf("kvxfer demo: ranks starting, %d of %d ready after %.0f s", nReady, len(p.children), time.Since(p.began).Seconds())
	if p.poolB > 0 {
		total, res := p.poolB*int64(len(p.children)), p.resident()
		msg += fmt.Sprintf("; KV buffers prefaulted %.2f of %.2f GiB (%.0f%%): each rank makes its pool resident and warm so the first request runs at the later ones' speed (--prefault=false skips it)",
			float64(res)/(1<<30), float64(total)/(1<<30), 100*float64(res)/float64(total))
		if res == total {
			msg += "; now warming and registering them (the rest of the rank's start)"
		}
	}
	fmt.Fprintln(p.w, msg)
}

func (p *startProgress) stop() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}

// rssShmem is process pid's resident shared memory (its memfd-backed KV
// buffers), bytes; 0 when unknown.
func rssShmem(pid int) int64 {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "RssShmem:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// demoInterrupted is the error of a request a stop signal kept from
// starting.
const demoInterrupted = "interrupted"

// stoppedByDrain reports whether a rank's error says a stop signal ended
// the room: a line refused while draining (drainRefusal), or a room
// cancelled by a second signal or the drain timeout (rank.drain).
func stoppedByDrain(err string) bool {
	return strings.Contains(err, "the rank is draining") || strings.Contains(err, "stop signal")
}

// runRequests drives the requests through the ranks, --concurrency at a
// time (the warm-up ones first, then the timed ones on a warm system), and
// returns their results and the timed requests' wall time.
func (c *demoCluster) runRequests(ctx context.Context, f *demoFlags, p *demoPlan) ([]demoResult, time.Duration) {
	var bar *progressbar.ProgressBar
	// No bar when stderr is not a terminal (make demo > log, CI): its \r
	// frames would fill the log and run into the summary.
	if !f.noProgress && isTerminal(os.Stderr) {
		bar = progressbar.NewOptions(len(p.reqs), progressbar.OptionSetWriter(os.Stderr), progressbar.OptionSetDescription("transfer+verify"),
			progressbar.OptionShowCount(), progressbar.OptionSetWidth(30), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
	}
	results := make([]demoResult, len(p.reqs))
	sem := make(chan struct{}, f.concurrency)
	var decodeOrder sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for i, rq := range p.reqs {
		if i == p.nWarm && p.nWarm > 0 {
			wg.Wait() // the timed requests start on a warm system
			start = time.Now()
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			results[i] = demoResult{Room: p.rooms[i], Tokens: min(rq.InputLength, p.capTokens), Capped: rq.InputLength > p.capTokens, Error: demoInterrupted, Interrupted: true}
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			r := c.runOne(p, p.rooms[i], rq, &decodeOrder)
			// The ranks got the stop signal too (Ctrl-C reaches the whole
			// process group): a room they refused or cancelled while
			// draining was interrupted, not failed.
			r.Interrupted = !r.OK && ctx.Err() != nil && stoppedByDrain(r.Error)
			results[i] = r
			if bar != nil {
				_ = bar.Add(1)
			}
		})
	}
	wg.Wait()
	wall := time.Since(start)
	if bar != nil {
		_ = bar.Finish()
	}
	return results, wall
}

// runOne sends one request to every rank (the decode ranks in the same
// order for every request, so their prefix caches decide alike, as
// SGLang's TP ranks do) and gathers their results.
func (c *demoCluster) runOne(p *demoPlan, room uint64, rq workload.Request, decodeOrder *sync.Mutex) demoResult {
	res := demoResult{Room: room, Tokens: min(rq.InputLength, p.capTokens), Capped: rq.InputLength > p.capTokens}
	q := requestLine{Room: room, Tokens: res.Tokens}
	dq := q
	if p.prefixBlocks > 0 {
		dq.HashIDs = rq.HashIDs
	}
	var chs []<-chan replyLine
	decodeOrder.Lock()
	for _, ch := range c.decodes {
		chs = append(chs, ch.submit(dq))
	}
	decodeOrder.Unlock()
	for _, ch := range c.prefills {
		chs = append(chs, ch.submit(q))
	}
	res.OK = true
	for k, ch := range chs {
		res.add(<-ch, k < len(c.decodes))
	}
	return res
}

// add folds one rank's result line into the request's result: a decode
// rank's received bytes, pages and prefix; a prefill rank's sent bytes,
// writes, transfer interval and transports (a dummy rank, MLA with
// prefill TP > decode TP, sends nothing and is only recorded as such).
func (res *demoResult) add(r replyLine, decode bool) {
	if !r.OK {
		res.OK = false
		if res.Error == "" {
			res.Error = fmt.Sprintf("%s tp%d pp%d: %s", r.Role, r.TPRank, r.PPRank, r.Error)
		}
	}
	if decode {
		res.Bytes += r.Bytes
		res.SkippedBytes += r.SkippedBytes
		res.PrefixTokens = max(res.PrefixTokens, r.PrefixTokens)
		res.Pages += r.Pages
		res.DecodeMS = max(res.DecodeMS, float64(r.TransferUS)/1000)
		res.BootstrapWaitMS = max(res.BootstrapWaitMS, float64(r.BootstrapWaitUS)/1000)
		res.SuccessUnixNS = max(res.SuccessUnixNS, r.SuccessUnixNS)
		return
	}
	if r.ComputeStartUnixNS > 0 && (res.ComputeStartUnixNS == 0 || r.ComputeStartUnixNS < res.ComputeStartUnixNS) {
		res.ComputeStartUnixNS = r.ComputeStartUnixNS
	}
	res.ComputeEndUnixNS = max(res.ComputeEndUnixNS, r.ComputeEndUnixNS)
	res.SentBytes += r.Bytes
	res.Writes += r.Writes
	res.ExtraWrites += r.ExtraWrites
	if r.Dummy {
		res.DummyRanks = append(res.DummyRanks, fmt.Sprintf("tp%d pp%d", r.TPRank, r.PPRank))
		return
	}
	if r.StartUnixNS > 0 {
		if res.StartUnixNS == 0 || r.StartUnixNS < res.StartUnixNS {
			res.StartUnixNS = r.StartUnixNS
		}
		res.EndUnixNS = max(res.EndUnixNS, r.EndUnixNS)
	}
	res.TransferMS = max(res.TransferMS, float64(r.TransferUS)/1000)
	if len(r.Transports) > 0 {
		res.Transport = strings.Join(r.Transports, ",")
	}
}
