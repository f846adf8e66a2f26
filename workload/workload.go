// Package workload supplies request lengths for kvxfer's demo and
// benchmarks: a reader of Mooncake-format JSONL traces and a built-in
// generator of chat-like prompt lengths.
//
// Mooncake trace format (one JSON object per line, as published with the
// Mooncake traces, e.g. conversation_trace.jsonl): "timestamp" (ms since the
// trace start), "input_length" and "output_length" (tokens), "hash_ids"
// (prefix-cache block ids, 512 tokens per block).
package workload

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strings"
)

// Request is one request of a workload.
type Request struct {
	// Timestamp is the arrival time in ms since the start of the trace.
	Timestamp int64 `json:"timestamp"`
	// InputLength is the prompt length in tokens (the KV that moves).
	InputLength int `json:"input_length"`
	// OutputLength is the number of generated tokens.
	OutputLength int `json:"output_length"`
	// HashIDs are the prompt's prefix-cache block ids.
	HashIDs []int64 `json:"hash_ids"`
}

// maxLineBytes bounds one trace line (hash_ids of a 1M-token prompt fit).
const maxLineBytes = 16 << 20

// ReadMooncake parses a Mooncake JSONL trace, reading at most limit requests
// (all when limit ≤ 0). Blank lines are skipped. Errors name the line and the
// bad field: invalid JSON, a field of the wrong type (and the type it
// wants), a missing or negative input_length, a negative output_length or
// timestamp.
func ReadMooncake(r io.Reader, limit int) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLineBytes)
	var out []Request
	line := 0
	for sc.Scan() {
		line++
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		var raw struct {
			Timestamp    *float64 `json:"timestamp"`
			InputLength  *int     `json:"input_length"`
			OutputLength *int     `json:"output_length"`
			HashIDs      []int64  `json:"hash_ids"`
		}
		if err := json.Unmarshal([]byte(text), &raw); err != nil {
			return nil, fmt.Errorf("workload: trace line %d: %s", line, traceJSONError(err))
		}
		switch {
		case raw.InputLength == nil:
			return nil, fmt.Errorf("workload: trace line %d: no \"input_length\" (is this a Mooncake trace?)", line)
		case *raw.InputLength <= 0:
			return nil, fmt.Errorf("workload: trace line %d: input_length %d must be > 0", line, *raw.InputLength)
		case raw.OutputLength != nil && *raw.OutputLength < 0:
			return nil, fmt.Errorf("workload: trace line %d: output_length %d must be >= 0", line, *raw.OutputLength)
		case raw.Timestamp != nil && (*raw.Timestamp < 0 || math.IsNaN(*raw.Timestamp)):
			return nil, fmt.Errorf("workload: trace line %d: timestamp %v must be >= 0", line, *raw.Timestamp)
		}
		q := Request{InputLength: *raw.InputLength, HashIDs: raw.HashIDs}
		if raw.OutputLength != nil {
			q.OutputLength = *raw.OutputLength
		}
		if raw.Timestamp != nil {
			q.Timestamp = int64(*raw.Timestamp)
		}
		out = append(out, q)
		if limit > 0 && len(out) >= limit {
			return out, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("workload: trace line %d: %w", line+1, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("workload: trace has no requests")
	}
	return out, nil
}

// traceFieldTypes is what each Mooncake trace field holds, for errors.
var traceFieldTypes = map[string]string{
	"timestamp":     "a number (ms since the trace start)",
	"input_length":  "an integer (prompt tokens)",
	"output_length": "an integer (generated tokens)",
	"hash_ids":      "an array of integers (prefix-cache block ids)",
}

// traceJSONError words a trace line's decoding error: a field of the wrong
// type names the field, the JSON type found and the type expected; a line
// that is not an object or not JSON says so.
func traceJSONError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		field := te.Field
		if i := strings.IndexAny(field, ".["); i >= 0 {
			field = field[:i]
		}
		if want, ok := traceFieldTypes[field]; ok {
			return fmt.Sprintf("%q is a JSON %s; want %s", te.Field, te.Value, want)
		}
		if te.Field == "" {
			return fmt.Sprintf("a JSON %s, not an object; want one JSON object per line with \"input_length\" (and \"timestamp\", \"output_length\", \"hash_ids\")", te.Value)
		}
	}
	return fmt.Sprintf("not valid JSON (%v); want one JSON object per line with \"input_length\"", err)
}

// LoadMooncake reads a Mooncake JSONL trace file (see ReadMooncake).
func LoadMooncake(path string, limit int) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("workload: open trace: %w", err)
	}
	defer f.Close()
	rs, err := ReadMooncake(f, limit)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rs, nil
}

// ChatMeanTokens is the generator's mean prompt length before capping
// (tokens); it matches the mean input_length of Mooncake's conversation trace
// (≈ 12k).
const ChatMeanTokens = 12000

// chatSigma is the spread of the log-normal prompt length: long-tailed like
// multi-turn chat (median ≈ 8k tokens, 1 % above ≈ 65k).
const chatSigma = 0.9

// Generate draws n chat-like requests: prompt lengths log-normal with mean
// ChatMeanTokens, clamped to [minTokens, maxTokens] (maxTokens is the pool's
// cap; ≤ 0 means no cap); output lengths log-normal around 300 tokens;
// arrivals 1 s apart on average (exponential gaps); hash_ids as in the
// Mooncake traces (one per DefaultBlockTokens block): every prompt starts
// with the same system-prompt block 0, and half of them continue one of the
// 8 previous conversations (sharing its blocks up to the shorter prompt's
// whole blocks). The same seed gives the same requests.
func Generate(n int, seed uint64, minTokens, maxTokens int) []Request {
	rng := rand.New(rand.NewPCG(seed, seed^0x6b7678666572))
	hrng := rand.New(rand.NewPCG(seed^0x68617368, seed)) // hash ids: lengths stay as before
	next := int64(1)
	mu := math.Log(ChatMeanTokens) - chatSigma*chatSigma/2
	out := make([]Request, n)
	var ts float64
	for i := range out {
		in := int(math.Exp(mu + chatSigma*rng.NormFloat64()))
		in = max(in, minTokens, 1)
		if maxTokens > 0 {
			in = min(in, maxTokens)
		}
		o := int(math.Exp(math.Log(300) + 0.7*rng.NormFloat64()))
		out[i] = Request{Timestamp: int64(ts), InputLength: in, OutputLength: max(o, 1)}
		blocks := (in + DefaultBlockTokens - 1) / DefaultBlockTokens
		ids := make([]int64, 0, blocks)
		ids = append(ids, 0) // the shared system prompt
		if i > 0 && hrng.IntN(2) == 0 {
			prev := out[i-1-hrng.IntN(min(i, 8))]
			// Only whole blocks are shared (a partial last block's id names
			// its partial content).
			shared := max(min(prev.InputLength, in)/DefaultBlockTokens, 1)
			ids = append(ids, prev.HashIDs[1:shared]...)
		}
		for len(ids) < blocks {
			ids = append(ids, next)
			next++
		}
		out[i].HashIDs = ids[:blocks]
		ts += rng.ExpFloat64() * 1000
	}
	return out
}
