package workload

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestReadMooncake(t *testing.T) {
	cases := []struct {
		name, in string
		limit    int
		want     int
		err      string
	}{
		{"two", `{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]}
{"timestamp": 27, "input_length": 10, "output_length": 3, "hash_ids": []}
`, 0, 2, ""},
		{"limit", "{\"input_length\": 5}\n\n{\"input_length\": 6}\n{\"input_length\": 7}\n", 2, 2, ""},
		{"blank only", "\n\n", 0, 0, "no requests"},
		{"bad json", "{\"input_length\": 5\n", 0, 0, "line 1"},
		{"missing input", "{\"input_length\": 5}\n{\"output_length\": 5}\n", 0, 0, "line 2: no \"input_length\""},
		{"zero input", "{\"input_length\": 0}\n", 0, 0, "must be > 0"},
		{"negative output", "{\"input_length\": 3, \"output_length\": -1}\n", 0, 0, "output_length"},
		{"string length", "{\"input_length\": 5}\n{\"input_length\": \"3\"}\n", 0, 0, `line 2: "input_length" is a JSON string; want an integer (prompt tokens)`},
		{"float length", "{\"input_length\": 3.5}\n", 0, 0, `line 1: "input_length" is a JSON number 3.5; want an integer (prompt tokens)`},
		{"string timestamp", "{\"input_length\": 3, \"timestamp\": \"now\"}\n", 0, 0, `line 1: "timestamp" is a JSON string; want a number (ms since the trace start)`},
		{"hash_ids object", "{\"input_length\": 3, \"hash_ids\": {}}\n", 0, 0, `line 1: "hash_ids" is a JSON object; want an array of integers`},
		{"hash_ids element", "{\"input_length\": 3, \"hash_ids\": [1, \"x\"]}\n", 0, 0, `want an array of integers (prefix-cache block ids)`},
		{"array line", "[1, 2]\n", 0, 0, `line 1: a JSON array, not an object; want one JSON object per line`},
		{"not json", "{\"input_length\": 5\n", 0, 0, `line 1: not valid JSON (`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs, err := ReadMooncake(strings.NewReader(c.in), c.limit)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err %v, want containing %q", err, c.err)
				}
				return
			}
			if err != nil || len(rs) != c.want {
				t.Fatalf("got %d requests, err %v; want %d", len(rs), err, c.want)
			}
		})
	}
}

func TestReadSharedTrace(t *testing.T) {
	const path = "/work/shared/data/traces/conversation_trace.jsonl"
	if _, err := os.Stat(path); err != nil {
		t.Skipf("shared trace not present: %v", err)
	}
	rs, err := LoadMooncake(path, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 100 || rs[0].InputLength <= 0 {
		t.Fatalf("got %d requests, first %+v", len(rs), rs[0])
	}
}

func TestGenerate(t *testing.T) {
	rs := Generate(4000, 1, 64, 0)
	sum := 0
	for _, r := range rs {
		if r.InputLength < 64 {
			t.Fatalf("input %d below the floor", r.InputLength)
		}
		sum += r.InputLength
	}
	mean := float64(sum) / float64(len(rs))
	if mean < 0.85*ChatMeanTokens || mean > 1.15*ChatMeanTokens {
		t.Fatalf("mean prompt %.0f tokens, want ≈ %d", mean, ChatMeanTokens)
	}
	capped := Generate(500, 2, 64, 4096)
	for _, r := range capped {
		if r.InputLength > 4096 {
			t.Fatalf("input %d above the cap", r.InputLength)
		}
	}
	a, b := Generate(10, 7, 1, 0), Generate(10, 7, 1, 0)
	for i := range a {
		if a[i].InputLength != b[i].InputLength || !slices.Equal(a[i].HashIDs, b[i].HashIDs) {
			t.Fatal("same seed gave different requests")
		}
	}
	// hash_ids as in the Mooncake traces: one per 512-token block, block 0
	// shared, and whole blocks of earlier conversations shared.
	whole := map[string]bool{}
	sharedBlocks := 0
	for _, r := range rs[:200] {
		if len(r.HashIDs) != (r.InputLength+DefaultBlockTokens-1)/DefaultBlockTokens || r.HashIDs[0] != 0 {
			t.Fatalf("%d tokens: hash_ids %v", r.InputLength, r.HashIDs)
		}
		for j := 1; j < r.InputLength/DefaultBlockTokens; j++ {
			k := fmt.Sprint(r.HashIDs[:j+1])
			if whole[k] {
				sharedBlocks++
			}
			whole[k] = true
		}
	}
	if sharedBlocks == 0 {
		t.Fatal("no conversation shares a block beyond the system prompt")
	}
}

func FuzzReadMooncake(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]}` + "\n"))
	f.Add([]byte("{\"input_length\": -1}\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		rs, err := ReadMooncake(strings.NewReader(string(b)), 10)
		if err == nil {
			for _, r := range rs {
				if r.InputLength <= 0 || r.OutputLength < 0 {
					t.Fatalf("accepted invalid request %+v", r)
				}
			}
		}
	})
}
