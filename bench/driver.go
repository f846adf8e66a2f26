package bench

import (
	"context"
	"fmt"
	"slices"
	"time"

	// The transports the benchmark measures register themselves.
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// PeerTimeout bounds one peer-tool run (server and client).
const PeerTimeout = 60 * time.Second

// ProgressFunc is told about each step before it runs: label names it, done
// counts finished steps out of total (cases plus peer runs).
type ProgressFunc func(label string, done, total int)

// Run measures the matrix in cfg and, when cfg.Peers is set, the peer tools,
// and returns the report. Transports that are unknown or unavailable on this
// host are listed in Report.Skipped rather than failing the run; an error is
// returned only for an invalid cfg or when no transport can run.
func Run(ctx context.Context, cfg Config, progress ProgressFunc) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	rep := &Report{}
	var usable []string
	for _, t := range cfg.Transports {
		if err := transport.ProbeTransport(t); err != nil {
			rep.Skipped = append(rep.Skipped, fmt.Sprintf("%s: %v", t, err))
			continue
		}
		usable = append(usable, t)
	}
	if len(usable) == 0 {
		return nil, fmt.Errorf("bench: none of the transports %v can run here: %v", cfg.Transports, rep.Skipped)
	}
	cfg.Transports = usable
	rep.Hardware = DiscoverHardware(slices.Contains(usable, "rdma"))
	rep.Method = CollectMethod(cfg)
	var peers []PeerSpec
	if cfg.Peers {
		peers = DefaultPeers(usable, rep.Hardware.NICs)
		rep.Method.PeerVersions = PeerVersions()
	}
	// Block-major order: at each block size every transport case and then
	// every peer run, so each ratio compares figures taken minutes apart at
	// most, under similar machine load. Results are reported in Cases() order.
	cases := cfg.Cases()
	total := len(cases) + len(peers)*len(cfg.BlockSizes)
	if cfg.KVModel != "" {
		total += 2 * len(cfg.Transports)
	}
	step := 0
	tell := func(label string) {
		if progress != nil {
			progress(label, step, total)
		}
		step++
	}
	results := make([]Result, len(cases))
	peerRes := make([]PeerResult, len(peers)*len(cfg.BlockSizes))
	for bi, b := range cfg.BlockSizes {
		for i, c := range cases {
			if c.BlockBytes != b {
				continue
			}
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("bench: interrupted: %w", err)
			}
			tell(c.Label())
			results[i] = RunCase(ctx, cfg, c)
		}
		for pi, p := range peers {
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("bench: interrupted: %w", err)
			}
			tell(fmt.Sprintf("peer %s %s", shortPeer(p.Label()), FormatSize(b)))
			pctx, cancel := context.WithTimeout(ctx, PeerTimeout)
			peerRes[pi*len(cfg.BlockSizes)+bi] = RunPeer(pctx, p, b)
			cancel()
		}
	}
	rep.Results, rep.Peers = results, peerRes
	rep.SetWriteRatios()
	if cfg.KVModel != "" {
		for _, t := range cfg.Transports {
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("bench: interrupted: %w", err)
			}
			tell(fmt.Sprintf("%s kv %s %d tokens", t, cfg.KVModel, cfg.KVTokens))
			rep.KV = append(rep.KV, RunKV(ctx, cfg, t))
			tell(fmt.Sprintf("%s kv pull %s %d tokens", t, cfg.KVModel, cfg.KVTokens))
			rep.KV = append(rep.KV, RunKVPull(ctx, cfg, t))
		}
		setPushRatios(rep.KV)
	}
	if progress != nil {
		progress("done", total, total)
	}
	rep.ElapsedSeconds = time.Since(start).Seconds()
	rep.Method.LoadAvgEnd = ReadLoadAvg()
	return rep, nil
}
