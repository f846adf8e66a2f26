package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
)

// The Mooncake FAST'25 request traces (conversation_trace.jsonl, 12,031
// requests, and synthetic_trace.jsonl, 3,993; Apache-2.0) are published by
// the Mooncake project (github.com/kvcache-ai/Mooncake, folder
// FAST25-release/traces). This repository does not carry them. A TraceShape
// is what this package knows of each: distributions fitted to the published
// files, from which GenerateTrace draws a workload of the same shape when
// the file is not at hand.

// TraceSource says where the real traces come from, for messages.
const TraceSource = "the Mooncake FAST'25 traces (github.com/kvcache-ai/Mooncake, folder FAST25-release/traces, Apache-2.0), not carried in this repository"

// TraceShape describes a Mooncake trace by fitted distributions: prompt and
// output lengths log-normal (ln-space mean Mu and deviation Sigma, clamped
// to [Min, Max] tokens), arrivals in bursts (BurstMean requests at one
// timestamp, bursts GapMS apart on average, exponential), prefix blocks
// (DefaultBlockTokens each) shared with an earlier prompt of the last Window
// with probability Continue, and block 0 shared by every prompt when
// SystemBlock (a common system prompt).
type TraceShape struct {
	// Name is the trace's name ("conversation"); File its file name.
	Name, File string
	// Requests is the published trace's request count.
	Requests int
	// Input and Output are the length distributions (tokens).
	InputMu, InputSigma   float64
	InputMin, InputMax    int
	OutputMu, OutputSigma float64
	OutputMax             int
	// BurstMean is the mean number of requests per arrival timestamp
	// (>= 1); GapMS the mean time between bursts (ms).
	BurstMean, GapMS float64
	// Continue is the probability that a prompt continues an earlier one of
	// the last Window prompts (shares its whole blocks up to the shorter).
	Continue float64
	Window   int
	// SystemBlock: every prompt starts with block 0.
	SystemBlock bool
	// Published figures of the file, for the record and the tests: mean
	// input and output tokens, and the fraction of all prompt blocks that
	// repeat a prefix already seen.
	MeanInput, MeanOutput, PrefixHit float64
}

// TraceShapes are the shapes of the two published traces, fitted to the
// files: lengths log-normal through the median and the mean (conversation
// input: median 6,909, mean 12,035, p99 85,401 → μ 8.840, σ 1.054, whose
// p99 is 80k; synthetic: 11,587 / 15,325 / 66,458 → 9.358, 0.748, p99 66k;
// outputs likewise, except conversation's, which is narrow around its
// median 350 and mean 343: μ 5.77, σ 0.35), burst sizes and gaps of the timestamps (conversation: ~10
// requests per timestamp, 3 s apart; synthetic: Poisson, 256 ms), and
// Continue calibrated so that GenerateTrace's PrefixHitFraction matches
// the file's.
var TraceShapes = []TraceShape{
	{Name: "conversation", File: "conversation_trace.jsonl", Requests: 12031,
		InputMu: 8.840, InputSigma: 1.054, InputMin: 891, InputMax: 126195, OutputMu: 5.770, OutputSigma: 0.35, OutputMax: 4096,
		BurstMean: 10.2, GapMS: 2997, Continue: 0.56, Window: 850, SystemBlock: true,
		MeanInput: 12035, MeanOutput: 343, PrefixHit: 0.366},
	{Name: "synthetic", File: "synthetic_trace.jsonl", Requests: 3993,
		InputMu: 9.358, InputSigma: 0.748, InputMin: 13, InputMax: 191378, OutputMu: 4.234, OutputSigma: 1.24, OutputMax: 4096,
		BurstMean: 1, GapMS: 256, Continue: 0.89, Window: 525,
		MeanInput: 15325, MeanOutput: 149, PrefixHit: 0.640},
}

// LookupTraceShape returns the shape named name ("conversation",
// "synthetic").
func LookupTraceShape(name string) (TraceShape, bool) {
	for _, s := range TraceShapes {
		if s.Name == name {
			return s, true
		}
	}
	return TraceShape{}, false
}

// TraceShapeNames lists the known shapes.
func TraceShapeNames() []string {
	out := make([]string, len(TraceShapes))
	for i, s := range TraceShapes {
		out[i] = s.Name
	}
	return out
}

// GenerateTrace draws n requests shaped like s (see TraceShape); the same
// seed gives the same requests. Prefix sharing follows the chain rule of
// the Mooncake traces: a prompt that continues an earlier one repeats its
// whole leading blocks (ids) up to the shorter prompt's whole blocks; every
// other block gets a fresh id.
func GenerateTrace(s TraceShape, n int, seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, seed^0x7472616365))
	out := make([]Request, n)
	next := int64(0)
	if s.SystemBlock {
		next = 1
	}
	var ts float64
	burst := 0
	for i := range out {
		if burst == 0 {
			if i > 0 {
				ts += rng.ExpFloat64() * s.GapMS
			}
			burst = 1
			if s.BurstMean > 1 { // geometric with mean BurstMean
				for rng.Float64() < 1-1/s.BurstMean {
					burst++
				}
			}
		}
		burst--
		in := clampInt(int(math.Exp(s.InputMu+s.InputSigma*rng.NormFloat64())), max(s.InputMin, 1), s.InputMax)
		o := clampInt(int(math.Exp(s.OutputMu+s.OutputSigma*rng.NormFloat64())), 1, max(s.OutputMax, 1))
		blocks := (in + DefaultBlockTokens - 1) / DefaultBlockTokens
		ids := make([]int64, 0, blocks)
		if s.SystemBlock {
			ids = append(ids, 0)
		}
		if i > 0 && rng.Float64() < s.Continue {
			// A later turn of an earlier conversation: of a few prompts of
			// the window, the longest that fits in this one (a turn adds to
			// its history), else the shortest.
			prev := -1
			for range 8 {
				c := i - 1 - rng.IntN(min(i, max(s.Window, 1)))
				switch {
				case prev < 0:
					prev = c
				case out[c].InputLength <= in && (out[prev].InputLength > in || out[c].InputLength > out[prev].InputLength):
					prev = c
				case out[prev].InputLength > in && out[c].InputLength < out[prev].InputLength:
					prev = c
				}
			}
			shared := min(out[prev].InputLength, in) / DefaultBlockTokens
			if shared > len(ids) {
				ids = append(ids[:0], out[prev].HashIDs[:shared]...)
			}
		}
		for len(ids) < blocks {
			ids = append(ids, next)
			next++
		}
		out[i] = Request{Timestamp: int64(ts), InputLength: in, OutputLength: o, HashIDs: ids[:blocks]}
	}
	return out
}

func clampInt(x, lo, hi int) int {
	if hi > 0 && x > hi {
		x = hi
	}
	return max(x, lo)
}

// PrefixHitFraction is the fraction of all prompt blocks of rs that lie on
// a prefix already seen in an earlier prompt (how much a prefix cache of
// unbounded size would hold), the figure TraceShape.PrefixHit records.
func PrefixHitFraction(rs []Request) float64 {
	seen := map[int64]bool{}
	var total, hit int
	for _, r := range rs {
		total += len(r.HashIDs)
		k := 0
		for k < len(r.HashIDs) && seen[r.HashIDs[k]] {
			k++
		}
		hit += k
		for _, id := range r.HashIDs {
			seen[id] = true
		}
	}
	if total == 0 {
		return 0
	}
	return float64(hit) / float64(total)
}

// TraceFile is a resolved trace: the file when one was found, else the
// shape to generate from, and where it looked.
type TraceFile struct {
	// Path is the trace file ("" when none was found).
	Path string
	// Shape is the named trace's shape (zero for a path argument).
	Shape TraceShape
	// Looked lists the paths tried for a named trace.
	Looked []string
}

// ResolveTrace resolves a --trace argument: a known shape name
// ("conversation", "synthetic") is looked for as <dir>/<File> in each of
// dirs, in order (the first existing file wins; none: Path is empty and the
// caller generates from Shape); anything else is a file path, which must
// exist (its error says where the real traces come from and which names
// work without a file).
func ResolveTrace(arg string, dirs []string) (TraceFile, error) {
	if s, ok := LookupTraceShape(arg); ok {
		tf := TraceFile{Shape: s}
		for _, d := range dirs {
			if d == "" {
				continue
			}
			p := filepath.Join(d, s.File)
			tf.Looked = append(tf.Looked, p)
			if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
				tf.Path = p
				return tf, nil
			}
		}
		return tf, nil
	}
	if _, err := os.Stat(arg); err != nil {
		return TraceFile{}, fmt.Errorf("workload: trace %s: %w; the real traces are %s: get conversation_trace.jsonl or synthetic_trace.jsonl from there, "+
			"or pass --trace %s to read it from the trace directory when present and else generate requests of its shape",
			arg, err, TraceSource, strings.Join(TraceShapeNames(), " or --trace "))
	}
	return TraceFile{Path: arg}, nil
}
