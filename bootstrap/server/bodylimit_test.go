package server

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// zeros is an endless reader of '0' bytes (a JSON-ish filler).
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = '0'
	}
	return len(p), nil
}

// TestBodyLimit413 sends bodies over the default 8 MiB limit through the
// listener, with and without Content-Length and with Expect: 100-continue:
// each gets 413 naming the limit (not a reset), and one just at the limit
// is parsed (400 for bad JSON, not 413).
func TestBodyLimit413(t *testing.T) {
	s, _ := startServer(t, Options{})
	const limit = 8 << 20
	base := "http://" + s.Addr()
	cases := []struct {
		name    string
		method  string
		path    string
		size    int64
		chunked bool
		expect  bool
		code    int
	}{
		{"put route, content-length", "PUT", "/route", limit + 1, false, false, 413},
		{"put route, chunked", "PUT", "/route", limit + 1<<20, true, false, 413},
		{"query, chunked 20 MiB", "POST", "/query_dp_ranks", 20 << 20, true, false, 413},
		{"register_dp_rank, content-length 9 MiB", "POST", "/register_dp_rank", 9 << 20, false, false, 413},
		{"query, expect 100-continue, 1 GiB declared", "POST", "/query_dp_ranks", 1 << 30, false, true, 413},
		{"query, content-length 200 MiB", "POST", "/query_dp_ranks", 200 << 20, false, false, 413},
		{"query, exactly the limit", "POST", "/query_dp_ranks", limit, false, false, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var body io.Reader = io.LimitReader(zeros{}, tc.size)
			if tc.chunked {
				body = io.MultiReader(body) // hides the length: chunked encoding
			}
			req, err := http.NewRequest(tc.method, base+tc.path, body)
			if err != nil {
				t.Fatal(err)
			}
			if !tc.chunked {
				req.ContentLength = tc.size
			}
			if tc.expect {
				req.Header.Set("Expect", "100-continue")
			}
			tr := &http.Transport{ExpectContinueTimeout: 5 * time.Second}
			defer tr.CloseIdleConnections()
			resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
			if err != nil {
				if tc.size > limit+maxDrainBytes && !tc.expect {
					t.Skipf("body beyond the drain bound: the client may see the close (%v)", err)
				}
				t.Fatalf("no answer: %v", err)
			}
			defer resp.Body.Close()
			msg, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.code {
				t.Fatalf("got %d %q, want %d", resp.StatusCode, msg, tc.code)
			}
			if tc.code == 413 && (!bytes.Contains(msg, []byte("8388608 bytes (8 MiB)")) || !strings.HasPrefix(string(msg), "body: ")) {
				t.Fatalf("413 text %q does not name the limit", msg)
			}
		})
	}
	// The server still answers afterwards.
	if code, _, msg := raw(t, "GET", base+"/health", ""); code != 200 || msg != "OK" {
		t.Fatalf("health after oversized bodies: %d %q", code, msg)
	}
}
