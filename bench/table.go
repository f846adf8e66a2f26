package bench

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
)

// WriteTable prints one row per result: the case, median GB/s with the
// min–max spread over repetitions, messages/s, p50/p99 batch latency, the
// verification outcome, the median per-repetition ratio to the
// single-goroutine memcpy baseline (Result.MemcpyRatio), for READ rows the
// ratio to the WRITE row of the same point (Result.WriteRatio), and for
// WRITE rows the ratio to each peer series compared with the row's transport (at the
// same block size). Then the peer runs, the targets this run could evaluate
// (Report.Targets) and the hardware note.
func WriteTable(w io.Writer, r *Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	peerCols := map[string][]string{}
	var allPeers []string
	for _, t := range r.Method.Config.Transports {
		peerCols[t] = r.PeerLabels(t)
		allPeers = append(allPeers, peerCols[t]...)
	}
	hdr := []string{"transport", "op", "block", "depth", "streams", "GB/s", "min–max", "msg/s", "p50 µs", "p99 µs", "verified", "×memcpy", "×write"}
	if len(allPeers) > 0 {
		hdr = append(hdr, "×peer (series)")
	}
	fmt.Fprintln(tw, strings.Join(hdr, "\t")+"\t")
	for _, res := range r.Results {
		if res.Err != "" {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\tfailed (below)\t\n", res.Transport, res.OpName(), FormatSize(res.BlockBytes), res.Depth, res.Streams)
			continue
		}
		ver := "off"
		switch {
		case res.VerifyErr != "":
			ver = "MISMATCH"
		case res.Verified:
			ver = "ok"
		}
		wr := ""
		if res.Read() {
			wr = fmtRatio(res.WriteRatio)
		}
		row := []string{res.Transport, res.OpName(), FormatSize(res.BlockBytes), fmt.Sprint(res.Depth), fmt.Sprint(res.Streams),
			fmt.Sprintf("%.3f", res.GBps.Median), fmt.Sprintf("%.3f–%.3f", res.GBps.Min, res.GBps.Max),
			fmtRate(res.MsgsPerSec.Median), fmt.Sprintf("%.1f", res.LatencyP50us), fmt.Sprintf("%.1f", res.LatencyP99us),
			ver, fmtRatio(res.MemcpyRatio.Median), wr}
		if len(allPeers) > 0 && !res.Read() {
			var parts []string
			for _, l := range peerCols[res.Transport] {
				if p, ok := r.PeerFor(l, res.BlockBytes); ok {
					parts = append(parts, fmt.Sprintf("%s (%s)", fmtCheckedRatio(Ratio(res.GBps.Median, p.GBps)), shortPeer(l)))
				}
			}
			row = append(row, strings.Join(parts, " "))
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, res := range r.Results {
		if res.Err != "" {
			fmt.Fprintf(w, "%s failed: %s\n", res.Label(), res.Err)
		}
	}
	if len(r.Peers) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "peer\tvs\tblock\tGB/s\tbest kvxfer GB/s\tratio\t")
		best := r.Best()
		for _, p := range r.Peers {
			if p.Err != "" {
				fmt.Fprintf(tw, "%s\t%s\t%s\tfailed (below)\t\t\t\n", p.Label(), p.Transport, FormatSize(p.BlockBytes))
				continue
			}
			ours := best[p.Transport][p.BlockBytes].GBps.Median
			blk := FormatSize(p.BlockBytes)
			if p.ToolBlockBytes != p.BlockBytes {
				blk += " (tool: " + FormatSize(p.ToolBlockBytes) + ")"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%.3f\t%.3f\t%s\t\n", p.Label(), p.Transport, blk, p.GBps, ours, fmtCheckedRatio(Ratio(ours, p.GBps)))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		for _, p := range r.Peers {
			if p.Err != "" {
				fmt.Fprintf(w, "peer %s at %s failed: %s\n", p.Label(), FormatSize(p.BlockBytes), p.Err)
			}
		}
	}
	if ts := r.Targets(); slices.ContainsFunc(ts, func(t Target) bool { return t.Missing == "" }) {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "target\tkvxfer GB/s\treference GB/s\tratio\twant\t")
		for _, t := range ts {
			if t.Missing != "" {
				continue
			}
			verdict := t.Verdict()
			if verdict == "missed" {
				verdict = "MISSED"
			}
			fmt.Fprintf(tw, "%s\t%.3f\t%.3f\t%s%s\t≥ %.1f× %s\t\n", t.What, t.Ours, t.Theirs, fmtRatio(t.Ratio()), t.pairedNote(), t.Want, verdict)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(w, "skipped: %s\n", s)
	}
	if r.Hardware.Note != "" {
		fmt.Fprintf(w, "per (NIC, GPU) pair: %s\n", r.Hardware.Note)
	}
	if warn := r.Method.LoadWarning(); warn != "" {
		fmt.Fprintf(w, "WARNING: %s\n", warn)
	}
	return nil
}

// fmtRatio prints a ratio as "1.23×", or "–" when there is none: NaN, Inf, or
// not positive (e.g. the memcpy baseline was skipped with --no-memcpy).
func fmtRatio(x float64) string {
	if math.IsNaN(x) || math.IsInf(x, 0) || x <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", x)
}

func fmtRate(x float64) string {
	switch {
	case x >= 1e6:
		return fmt.Sprintf("%.2fM", x/1e6)
	case x >= 1e3:
		return fmt.Sprintf("%.1fk", x/1e3)
	}
	return fmt.Sprintf("%.0f", x)
}

// shortPeer abbreviates a peer label for the table.
func shortPeer(l string) string {
	l = strings.Replace(l, "ucx_perftest ", "ucx ", 1)
	return strings.Replace(l, "UCX_TLS=", "", 1)
}
