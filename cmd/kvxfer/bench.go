package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/internal/hostmem"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

func init() {
	def := bench.DefaultConfig()
	var (
		transports, sizes, depths, streams string
		ops                                string
		noVerify, noMemcpy, peers, quiet   bool
		jsonPath, plotPath, maxRegion      string
		mdPath                             string
		timeout                            time.Duration
	)
	cfg := def
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "measure transport bandwidth, message rate and batch latency; compare with iperf3/UCX/perftest",
		Long: `bench runs a matrix of transport × block size × batch depth × streams through the
engine (transport.OpenTransport, segments, transfer batches) between two transport
instances in this process, verifies every byte after each timed repetition, and
prints a table. --peers runs iperf3, ucx_perftest (UCX_TLS=tcp and UCX_TLS=sm)
and, where an RDMA device exists, ib_write_bw on loopback with the same block
sizes and adds ratio columns. Every point is measured as a WRITE and as a
one-sided READ (--ops); a READ row's ×write is its ratio to the WRITE row of
the same point, measured right before it. The KV-room cases move a request
prefill → decode through the KV managers (push, WRITE) and pull it with the
decode's READs of the prefill's registered KV (segment engine, the
NIXL/vLLM pattern), with the pull/push ratio. GB/s means 1e9 bytes per
second.

Exit status: 0 when every case ran and (unless --no-verify) verified; 1 when
any case failed (could not run, e.g. a failed mmap or transport, or its bytes
did not verify), even if others have figures: a script gets a non-zero status
for any requested case it did not get, and the last line says how many of
how many failed and the first one's reason (the table and JSON are still
written). Transports skipped as unavailable here and peer-tool runs are not
cases: they do not change the status (none of --transports usable is exit 1).`,
		Example: `  kvxfer bench --transports tcp,shm --peers --json out.json --plot out.png
  kvxfer bench --transports shm --sizes 1M --depths 1,16 --streams 1,2,4 --reps 9`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if cfg.Transports, err = checkTransportNames("--transports", transports); err != nil {
				return err
			}
			if cfg.BlockSizes, err = bench.ParseSizes(sizes); err != nil {
				return fmt.Errorf("--sizes: %w", err)
			}
			if cfg.Depths, err = bench.ParseInts(depths, "--depths", 1, 4096); err != nil {
				return err
			}
			if cfg.Streams, err = bench.ParseInts(streams, "--streams", 0, 64); err != nil {
				return err
			}
			cfg.Ops = nil
			for _, o := range strings.Split(ops, ",") {
				if o = strings.TrimSpace(o); o != "" {
					cfg.Ops = append(cfg.Ops, o)
				}
			}
			if cfg.MaxRegionBytes, err = bench.ParseSize(maxRegion); err != nil {
				return fmt.Errorf("--max-region: %w", err)
			}
			cfg.Verify, cfg.Memcpy, cfg.Peers = !noVerify, !noMemcpy, peers
			topts, err := envTransportOptions()
			if err != nil {
				return err
			}
			cfg.SHMStreamMinBytes = topts.SHM.StreamMinBytes
			if plotPath != "" {
				if e := strings.ToLower(plotPath); !strings.HasSuffix(e, ".png") && !strings.HasSuffix(e, ".svg") {
					return fmt.Errorf("--plot %q: want a file name ending in .png or .svg", plotPath)
				}
			}
			for _, out := range []struct{ flag, path string }{{"--json", jsonPath}, {"--plot", plotPath}, {"--markdown", mdPath}} {
				if err := checkOutputFile(out.flag, out.path); err != nil {
					return err
				}
			}
			if cfg.CaseTimeout < 0 {
				return fmt.Errorf("--case-timeout %s: must be >= 0 (0 = each case's own budget)", cfg.CaseTimeout)
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			if err := hostmem.Check(fmt.Sprintf("--sizes %s --max-region %s: the largest case (a sender and a receiver region, or the two KV pools of --kv-model)", sizes, maxRegion),
				cfg.HostBytes(), "lower --max-region, the largest --sizes or --depths, or --kv-tokens"); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			var bar *progressbar.ProgressBar
			progress := func(label string, done, total int) {
				if quiet || !term.IsTerminal(int(os.Stderr.Fd())) {
					return
				}
				if bar == nil {
					bar = progressbar.NewOptions(total,
						progressbar.OptionSetWriter(os.Stderr),
						progressbar.OptionSetWidth(30),
						progressbar.OptionShowCount(),
						progressbar.OptionSetElapsedTime(true),
						progressbar.OptionSetPredictTime(true),
						progressbar.OptionClearOnFinish())
				}
				bar.Describe(fmt.Sprintf("%-34s", label))
				bar.Set(done)
			}
			rep, err := bench.Run(ctx, cfg, progress)
			if bar != nil {
				bar.Finish()
				fmt.Fprintln(os.Stderr)
			}
			if err != nil {
				return err
			}
			// Report the streams each case really used, not 0 = default.
			for i := range rep.Results {
				if r := &rep.Results[i]; r.Streams == 0 {
					r.Streams = bench.EffectiveStreams(r.Transport)
				}
			}
			if err := bench.WriteTable(cmd.OutOrStdout(), rep); err != nil {
				return err
			}
			if err := bench.WriteKVTable(cmd.OutOrStdout(), rep); err != nil {
				return err
			}
			if jsonPath != "" {
				if err := rep.WriteJSON(jsonPath); err != nil {
					return err
				}
			}
			if plotPath != "" {
				if err := bench.WritePlot(rep, plotPath); err != nil {
					return err
				}
			}
			if mdPath != "" {
				rel := func(p string) string {
					if p == "" {
						return ""
					}
					abs, _ := filepath.Abs(p)
					dir, _ := filepath.Abs(filepath.Dir(mdPath))
					if r, err := filepath.Rel(dir, abs); err == nil {
						return r
					}
					return p
				}
				sec, err := bench.RenderMarkdown(rep, rel(plotPath), rel(jsonPath))
				if err != nil {
					return err
				}
				if err := bench.UpdateMarkdown(mdPath, sec); err != nil {
					return err
				}
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "bench: %d cases, %d peer runs in %.1fs\n", len(rep.Results)+len(rep.KV), len(rep.Peers), rep.ElapsedSeconds)
			return benchOutcome(rep)
		},
	}
	f := cmd.Flags()
	f.StringVar(&transports, "transports", strings.Join(def.Transports, ","), "comma-separated transports to measure (tcp, shm, cma, rdma); unavailable ones are skipped with the reason")
	f.StringVar(&sizes, "sizes", "4K,64K,1M,4M,16M,64M", "block sizes (bytes per WriteRequest), e.g. 4K,1M,64M")
	f.StringVar(&depths, "depths", "1,8", "batch depths: WriteRequests per transfer batch")
	f.StringVar(&ops, "ops", strings.Join(def.Ops, ","), "directions at every point: write (the sender WRITEs into the receiver's region) and/or read (one-sided READ of the receiver's region; READ rows show ×write, the ratio to the WRITE row of the same point, measured right before it)")
	f.StringVar(&streams, "streams", "0", "transport.Options.Streams values (tcp connections, shm copy goroutines, rdma QPs; 0 = the transport's default, and the table shows the count used)")
	f.IntVar(&cfg.Inflight, "inflight", def.Inflight, "transfer batches kept submitted at once")
	f.IntVar(&cfg.Reps, "reps", def.Reps, "timed repetitions per case (median and min–max reported)")
	f.StringVar(&cfg.KVModel, "kv-model", def.KVModel, "also measure the KV-room path per transport: prefill and decode KV managers on per-layer buffers of this model (built-in name or config.json), requests of --kv-tokens tokens; \"\" = skip")
	f.IntVar(&cfg.KVTokens, "kv-tokens", def.KVTokens, "tokens per KV-room request (--kv-model)")
	f.IntVar(&cfg.Warmup, "warmup", def.Warmup, "untimed warm-up batches per case")
	f.DurationVar(&cfg.RepTime, "rep-time", def.RepTime, "minimum duration of one repetition (or --rep-bytes, whichever first)")
	f.Uint64Var(&cfg.RepBytes, "rep-bytes", def.RepBytes, "bytes after which a repetition may end early")
	f.StringVar(&maxRegion, "max-region", bench.FormatSize(def.MaxRegionBytes), "largest receiver region per case; deeper batches wrap around it")
	f.BoolVar(&noVerify, "no-verify", false, "skip the byte-for-byte check after each repetition")
	f.BoolVar(&noMemcpy, "no-memcpy", false, "skip the single-goroutine memcpy baseline")
	f.BoolVar(&peers, "peers", false, "also run iperf3, ucx_perftest and ib_write_bw (where installed) on loopback and print ratios")
	f.StringVar(&jsonPath, "json", "", "write the full report (results, peers, method: CPU, kernel, versions, flags) to this JSON file")
	f.StringVar(&plotPath, "plot", "", "write a bandwidth-vs-block-size plot to this .png or .svg file")
	f.StringVar(&mdPath, "markdown", "", "replace the generated section (between the kvxfer bench markers) of this markdown file, e.g. bench/RESULTS.md")
	f.BoolVar(&quiet, "quiet", false, "no progress bar (it is also off when stderr is not a terminal)")
	f.DurationVar(&cfg.CaseTimeout, "case-timeout", 0, "abort a case that runs longer than this; 0 = its own budget: 60 s plus the bytes it must move (warm-up, the repetitions' minimum batches, fill/verify passes) at 0.05 GB/s, so a 1 GiB batch is not cut off")
	f.DurationVar(&timeout, "timeout", 0, "abort the whole run after this long (0 = no limit beyond each case's --case-timeout)")
	rootCmd.AddCommand(cmd)
}

// benchOutcome is bench's exit status as an error: nil when every case
// (transport point, KV-room case) ran and, with verification on, verified;
// otherwise it says how many of how many cases failed, all or some, and
// the first failure's reason. Peer-tool runs and transports skipped as
// unavailable are not counted: the table reports them.
func benchOutcome(rep *bench.Report) error {
	var failed []string
	for _, r := range rep.Results {
		switch {
		case r.Err != "":
			failed = append(failed, fmt.Sprintf("%s: %s", r.Label(), r.Err))
		case r.VerifyErr != "":
			failed = append(failed, fmt.Sprintf("%s: verification failed: %s", r.Label(), r.VerifyErr))
		}
	}
	for _, k := range rep.KV {
		if k.Err != "" {
			mode := k.Mode
			if mode == "" {
				mode = "push"
			}
			failed = append(failed, fmt.Sprintf("%s kv %s %s: %s", k.Transport, mode, k.Model, k.Err))
		}
	}
	total := len(rep.Results) + len(rep.KV)
	switch {
	case len(failed) == 0:
		return nil
	case len(failed) == total:
		return fmt.Errorf("bench: all %d cases failed, no figures (first: %s); each case's reason is under the table", total, failed[0])
	}
	return fmt.Errorf("bench: %d of %d cases failed (first: %s); the table has the other cases' figures and each failure's reason", len(failed), total, failed[0])
}
