// Package bench is kvxfer's benchmark: it drives engine transports (through
// transport.OpenTransport and segments, never raw sockets) over a matrix of
// transport × block size × batch depth × streams, verifies every byte after
// each timed repetition, runs installed peer tools (iperf3, ucx_perftest,
// ib_write_bw) with matched sizes, and reports a table, JSON and a plot.
//
// Units: sizes in bytes; bandwidth in GB/s = 1e9 bytes per second (peer tools'
// own units are converted: ucx_perftest prints MB/s = 2^20 bytes/s, iperf3
// bits/s); latency in microseconds; message rate in WriteRequests (blocks) per
// second.
package bench

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
	"time"
)

// Stat summarises one metric over repetitions.
type Stat struct {
	// Median of the repetitions.
	Median float64 `json:"median"`
	// Min and Max of the repetitions.
	Min float64 `json:"min"`
	Max float64 `json:"max"`
	// Spread is (Max-Min)/Median, 0 when Median is 0.
	Spread float64 `json:"spread"`
	// N is the number of repetitions.
	N int `json:"n"`
}

// Summarize returns the Stat of xs (zero Stat for an empty slice).
func Summarize(xs []float64) Stat {
	if len(xs) == 0 {
		return Stat{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	st := Stat{Median: Percentile(s, 50), Min: s[0], Max: s[len(s)-1], N: len(s)}
	if st.Median != 0 {
		st.Spread = (st.Max - st.Min) / st.Median
	}
	return st
}

// Percentile returns the p-th percentile (0..100) of sorted xs by linear
// interpolation between closest ranks; NaN for an empty slice.
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	if p <= 0 {
		return sorted[0]
	}
	if p >= 100 {
		return sorted[len(sorted)-1]
	}
	pos := p / 100 * float64(len(sorted)-1)
	lo := int(math.Floor(pos))
	hi := int(math.Ceil(pos))
	f := pos - float64(lo)
	return sorted[lo]*(1-f) + sorted[hi]*f
}

// Rep is one timed repetition of a case.
type Rep struct {
	// Bytes moved in the timed region.
	Bytes uint64 `json:"bytes"`
	// Batches and Messages (WriteRequests) completed in the timed region.
	Batches  int `json:"batches"`
	Messages int `json:"messages"`
	// Seconds is the wall time of the timed region.
	Seconds float64 `json:"seconds"`
}

// GBps returns the repetition's bandwidth in GB/s (1e9 bytes/s).
func (r Rep) GBps() float64 {
	if r.Seconds <= 0 {
		return 0
	}
	return float64(r.Bytes) / r.Seconds / 1e9
}

// MsgsPerSec returns the repetition's message rate (WriteRequests/s).
func (r Rep) MsgsPerSec() float64 {
	if r.Seconds <= 0 {
		return 0
	}
	return float64(r.Messages) / r.Seconds
}

// Case is one point of the matrix.
type Case struct {
	// Transport is the engine registry name ("tcp", "shm", "rdma").
	Transport string `json:"transport"`
	// BlockBytes is the size of one WriteRequest.
	BlockBytes uint64 `json:"block_bytes"`
	// Depth is the number of WriteRequests per transfer batch.
	Depth int `json:"depth"`
	// Streams is transport.Options.Streams (0 = the transport's default: tcp
	// connections, shm copy goroutines).
	Streams int `json:"streams"`
	// Inflight is the number of batches kept submitted at once.
	Inflight int `json:"inflight"`
	// Pair names the (NIC, GPU) pair for hardware runs; empty for host memory.
	Pair string `json:"pair,omitempty"`
	// Op is OpWrite ("", the sender WRITEs into the receiver's region) or
	// OpRead ("read": the sender READs the receiver's region into its own
	// memory, transport.OpRead).
	Op string `json:"op,omitempty"`
}

// Case directions (Case.Op, Config.Ops).
const (
	OpWrite = ""
	OpRead  = "read"
)

// Read reports whether the case is a READ case.
func (c Case) Read() bool { return c.Op == OpRead }

// OpName is "write" or "read".
func (c Case) OpName() string {
	if c.Read() {
		return "read"
	}
	return "write"
}

// Label is a short human name of the case.
func (c Case) Label() string {
	l := fmt.Sprintf("%s %s×%d s%d", c.Transport, FormatSize(c.BlockBytes), c.Depth, c.Streams)
	if c.Read() {
		l += " read"
	}
	return l
}

// WriteTwin is the WRITE case of the same point (transport, block, depth,
// streams, inflight) as read case c.
func (c Case) WriteTwin() Case {
	c.Op = OpWrite
	return c
}

// Result is the outcome of one Case.
type Result struct {
	Case
	// RegionBytes is the receiver region (and source buffer) size: the working
	// set the batches cycle over.
	RegionBytes uint64 `json:"region_bytes"`
	Reps        []Rep  `json:"reps"`
	// GBps and MsgsPerSec summarise the repetitions.
	GBps       Stat `json:"gbps"`
	MsgsPerSec Stat `json:"msgs_per_sec"`
	// LatencyP50us and LatencyP99us are per-batch latencies (Submit to Wait
	// returning, microseconds) over every timed batch of every repetition.
	LatencyP50us float64 `json:"latency_p50_us"`
	LatencyP99us float64 `json:"latency_p99_us"`
	// Verified is true when every byte of the region matched the source after
	// each repetition; false with VerifyErr set on a mismatch, false with
	// VerifyErr empty when verification was disabled.
	Verified  bool   `json:"verified"`
	VerifyErr string `json:"verify_error,omitempty"`
	// MemcpyGBps is a single-goroutine copy of the same block size over the
	// same working set (same buffers), measured in-process right after the
	// case: the ceiling for a same-host copy.
	MemcpyGBps Stat `json:"memcpy_gbps"`
	// MemcpyRatio summarises, over repetitions, the transport's GB/s divided
	// by the memcpy repetition run right after it: pairs taken seconds apart
	// see the same machine load, so this is steadier than the ratio of the
	// two medians on a busy host.
	MemcpyRatio Stat `json:"memcpy_ratio"`
	// WriteRatio (READ cases) is the median GB/s of this READ case divided
	// by that of the WRITE case of the same point in the same run (run right
	// before it); NaN-free: 0 when the WRITE case is missing or failed.
	WriteRatio float64 `json:"write_ratio,omitempty"`
	// Err is why the case could not run (then the metrics are zero).
	Err string `json:"error,omitempty"`
}

// PeerResult is one run of a peer tool.
type PeerResult struct {
	// Tool is "iperf3", "ucx_perftest" or "ib_write_bw".
	Tool string `json:"tool"`
	// Test is the tool's test ("tcp", "tag_bw", "put_bw", "write").
	Test string `json:"test"`
	// Transport is the kvxfer transport it is compared with ("tcp", "shm",
	// "rdma").
	Transport string `json:"transport"`
	// Env is extra environment (UCX_TLS=...).
	Env string `json:"env,omitempty"`
	// BlockBytes is the requested message size; ToolBlockBytes what the tool
	// ran with (iperf3 caps its buffer at 1 MiB).
	BlockBytes     uint64 `json:"block_bytes"`
	ToolBlockBytes uint64 `json:"tool_block_bytes"`
	// GBps is the tool's reported bandwidth converted to 1e9 bytes/s.
	GBps float64 `json:"gbps"`
	// Command is the exact client command line.
	Command string `json:"command"`
	// Err is why the run failed or was skipped.
	Err string `json:"error,omitempty"`
}

// Label names the peer series ("ucx_perftest tag_bw UCX_TLS=tcp").
func (p PeerResult) Label() string {
	l := p.Tool + " " + p.Test
	if p.Env != "" {
		l += " " + p.Env
	}
	return l
}

// Hardware is what the run found for per-(NIC, GPU) measurements.
type Hardware struct {
	NICs  []string `json:"nics"`
	GPUs  []string `json:"gpus"`
	Pairs []string `json:"pairs"`
	// Note says why no pair was measured ("no NIC/GPU: ...").
	Note string `json:"note,omitempty"`
}

// Report is everything one run produced (the --json document).
type Report struct {
	Method  Method       `json:"method"`
	Results []Result     `json:"results"`
	Peers   []PeerResult `json:"peers,omitempty"`
	// KV are the KV-room cases (Config.KVModel), one per transport.
	KV []KVResult `json:"kv,omitempty"`
	// Skipped lists transports that were asked for (or auto-selected) but
	// could not run, with the reason.
	Skipped  []string `json:"skipped,omitempty"`
	Hardware Hardware `json:"hardware"`
	// ElapsedSeconds is the whole run's wall time.
	ElapsedSeconds float64 `json:"elapsed_seconds"`
}

// WriteJSON writes the report, indented, to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("bench: encode report: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	return nil
}

// ReadJSON reads a report written by WriteJSON.
func ReadJSON(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("bench: read %s: %w", path, err)
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("bench: %s is not a kvxfer bench report: %w", path, err)
	}
	return &r, nil
}

// Best returns, for each transport and block size, the WRITE result with
// the highest median bandwidth (over depth, streams and inflight), keyed
// transport → block bytes. READ cases are left out: the peers and targets
// it serves are WRITE figures.
func (r *Report) Best() map[string]map[uint64]Result {
	out := map[string]map[uint64]Result{}
	for _, res := range r.Results {
		if res.Err != "" || res.Read() {
			continue
		}
		m := out[res.Transport]
		if m == nil {
			m = map[uint64]Result{}
			out[res.Transport] = m
		}
		if cur, ok := m[res.BlockBytes]; !ok || res.GBps.Median > cur.GBps.Median {
			m[res.BlockBytes] = res
		}
	}
	return out
}

// SetWriteRatios fills Result.WriteRatio of every READ result from the
// WRITE result of the same point.
func (r *Report) SetWriteRatios() {
	writes := map[Case]Result{}
	for _, res := range r.Results {
		if !res.Read() && res.Err == "" {
			writes[res.Case] = res
		}
	}
	for i := range r.Results {
		res := &r.Results[i]
		if !res.Read() || res.Err != "" {
			continue
		}
		if w, ok := writes[res.WriteTwin()]; ok && w.GBps.Median > 0 {
			res.WriteRatio = res.GBps.Median / w.GBps.Median
		}
	}
}

// PeerFor returns the successful peer result of the given label at block
// size n, if any.
func (r *Report) PeerFor(label string, n uint64) (PeerResult, bool) {
	for _, p := range r.Peers {
		if p.Err == "" && p.Label() == label && p.BlockBytes == n {
			return p, true
		}
	}
	return PeerResult{}, false
}

// PeerLabels returns the distinct peer series compared with transport, in
// first-seen order.
func (r *Report) PeerLabels(transport string) []string {
	var out []string
	seen := map[string]bool{}
	for _, p := range r.Peers {
		if p.Transport == transport && !seen[p.Label()] {
			seen[p.Label()] = true
			out = append(out, p.Label())
		}
	}
	return out
}

// Ratio returns ours/peer, or NaN when the peer figure is missing or zero.
func Ratio(ours, peer float64) float64 {
	if peer <= 0 {
		return math.NaN()
	}
	return ours / peer
}

// durationMicros converts a duration to float microseconds.
func durationMicros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
