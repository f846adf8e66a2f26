package httpmeta_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/metadata/httpmeta"
)

func TestParseKey(t *testing.T) {
	for _, tc := range []struct {
		q, key, err string
	}{
		{q: "key=a", key: "a"},
		{q: "key=mooncake%2Fram%2F127.0.0.1%3A12345", key: "mooncake/ram/127.0.0.1:12345"},
		{q: "key=++valid++", key: "valid"}, // '+' is a space in a query: trimmed
		{q: "key=%20%20valid%20", key: "valid"},
		{q: "x=1&key=b&key=c", key: "b"}, // the first key wins
		{q: "", err: "metadata key is required"},
		{q: "other=1", err: "metadata key is required"},
		{q: "key=", err: "empty or only white space"},
		{q: "key=%20%20%20", err: "empty or only white space"},
		{q: "key=%zz", err: "does not decode"},
		{q: "key=a%00b", err: "control byte 0x00"},
		{q: "key=a%0Ab", err: "control byte 0x0a"},
		{q: "key=" + strings.Repeat("k", httpmeta.MaxKeyBytes+1), err: "more than 4096"},
	} {
		k, err := httpmeta.ParseKey(tc.q)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !errors.Is(err, httpmeta.ErrBadKey) {
				t.Errorf("ParseKey(%q) = %q, %v; want an error with %q", tc.q, k, err, tc.err)
			}
			continue
		}
		if err != nil || k != tc.key {
			t.Errorf("ParseKey(%q) = %q, %v; want %q", tc.q, k, err, tc.key)
		}
	}
}

// TestServeMooncakeRules: the assertions of Mooncake's own server tests
// (mooncake-wheel/tests/test_http_metadata_server.py) and its C++ server's
// rpc_meta rule, restated.
func TestServeMooncakeRules(t *testing.T) {
	s := httpmeta.New(httpmeta.Options{})
	do := func(method, q, body string) httpmeta.Response {
		return s.Serve(method, q, strings.NewReader(body))
	}
	// A missing, empty or blank key is refused for every method and stores nothing.
	for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		for _, q := range []string{"", "key=", "key=%20%20%20"} {
			if r := do(m, q, "value"); r.Status != http.StatusBadRequest {
				t.Errorf("%s ?%s: status %d, want 400", m, q, r.Status)
			}
		}
	}
	if s.Len() != 0 {
		t.Fatalf("refused requests stored %d keys", s.Len())
	}
	// Keys are trimmed before use.
	if r := do(http.MethodPut, "key=%20%20valid%20%20", "value"); r.Status != 200 || string(r.Body) != "metadata updated" {
		t.Fatalf("PUT: %d %q", r.Status, r.Body)
	}
	r := do(http.MethodGet, "key=%20%20valid%20%20", "")
	if r.Status != 200 || string(r.Body) != "value" || r.ContentType != "application/json" {
		t.Fatalf("GET: %d %q %q", r.Status, r.Body, r.ContentType)
	}
	if _, ok := s.Get("valid"); !ok {
		t.Fatal(`stored under the untrimmed key, not "valid"`)
	}
	if _, ok := s.Get("  valid  "); ok {
		t.Fatal("stored under the untrimmed key too")
	}
	// Overwrite, delete, absent.
	if r := do(http.MethodPut, "key=valid", "v2"); r.Status != 200 {
		t.Fatal(r.Status)
	}
	if r := do(http.MethodGet, "key=valid", ""); string(r.Body) != "v2" {
		t.Fatalf("after overwrite: %q", r.Body)
	}
	if r := do(http.MethodDelete, "key=valid", ""); r.Status != 200 || string(r.Body) != "metadata deleted" {
		t.Fatalf("DELETE: %d %q", r.Status, r.Body)
	}
	for _, m := range []string{http.MethodGet, http.MethodDelete} {
		if r := do(m, "key=valid", ""); r.Status != 404 || string(r.Body) != "metadata not found" {
			t.Fatalf("%s of a deleted key: %d %q", m, r.Status, r.Body)
		}
	}
	// rpc_meta keys are written once; the same value again is fine.
	if r := do(http.MethodPut, "key=mooncake/rpc_meta/h:1", `{"rpc_port":1}`); r.Status != 200 {
		t.Fatal(r.Status)
	}
	if r := do(http.MethodPut, "key=mooncake/rpc_meta/h:1", `{"rpc_port":1}`); r.Status != 200 || string(r.Body) != "metadata unchanged" {
		t.Fatalf("same rpc_meta again: %d %q", r.Status, r.Body)
	}
	if r := do(http.MethodPut, "key=mooncake/rpc_meta/h:1", `{"rpc_port":2}`); r.Status != 400 || !strings.Contains(string(r.Body), "Duplicate rpc_meta") {
		t.Fatalf("other rpc_meta value: %d %q", r.Status, r.Body)
	}
	if v, _ := s.Get("mooncake/rpc_meta/h:1"); string(v) != `{"rpc_port":1}` {
		t.Fatalf("refused PUT changed the value to %q", v)
	}
	// Empty values are values.
	if r := do(http.MethodPut, "key=empty", ""); r.Status != 200 {
		t.Fatal(r.Status)
	}
	if r := do(http.MethodGet, "key=empty", ""); r.Status != 200 || len(r.Body) != 0 {
		t.Fatalf("empty value: %d %q", r.Status, r.Body)
	}
	if r := do(http.MethodPost, "key=x", "v"); r.Status != http.StatusMethodNotAllowed {
		t.Fatalf("POST: %d", r.Status)
	}
}

func TestServeLimits(t *testing.T) {
	s := httpmeta.New(httpmeta.Options{MaxValueBytes: 10, MaxKeys: 3, MaxTotalBytes: 24})
	put := func(k, v string, want int) {
		t.Helper()
		if r := s.Serve(http.MethodPut, "key="+k, strings.NewReader(v)); r.Status != want {
			t.Fatalf("PUT %s (%d bytes): %d %q, want %d", k, len(v), r.Status, r.Body, want)
		}
	}
	put("a", "01234567890", http.StatusRequestEntityTooLarge)
	put("a", "0123456789", 200) // 11 bytes held (key + value)
	put("b", "0123456789", 200) // 22
	put("c", "x", 200)          // 24: the total limit exactly
	put("d", "", http.StatusInsufficientStorage)
	if !strings.Contains(string(s.Serve(http.MethodPut, "key=d", nil).Body), "3 keys") {
		t.Fatal("the 507 does not name the key limit")
	}
	put("c", "xy", http.StatusInsufficientStorage) // 25 bytes: over the total
	if v, _ := s.Get("c"); string(v) != "x" {
		t.Fatalf("a refused PUT changed c to %q", v)
	}
	if r := s.Serve(http.MethodDelete, "key=b", nil); r.Status != 200 {
		t.Fatal(r.Status)
	}
	put("c", "0123456789", 200) // 22 after the delete
	put("b", "0123456789", http.StatusInsufficientStorage)
}

// TestServerOverHTTP runs the server on a real socket, as clients (curl,
// Mooncake's engines) reach it, including a body over the limit and a
// client that stops mid-body.
func TestServerOverHTTP(t *testing.T) {
	s := httpmeta.New(httpmeta.Options{Host: "127.0.0.1", MaxValueBytes: 1 << 20})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Start(ctx) }()
	select {
	case <-s.Ready():
	case err := <-done:
		t.Fatal(err)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	base := "http://" + s.Addr() + "/metadata?key="
	req := func(method, key, body string) (int, string) {
		t.Helper()
		r, err := http.NewRequest(method, base+url.QueryEscape(key), strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if c, b := req(http.MethodPut, "mooncake/ram/127.0.0.1:12345", `{"buffers":[]}`); c != 200 {
		t.Fatalf("PUT: %d %s", c, b)
	}
	if c, b := req(http.MethodGet, "mooncake/ram/127.0.0.1:12345", ""); c != 200 || b != `{"buffers":[]}` {
		t.Fatalf("GET: %d %s", c, b)
	}
	if c, _ := req(http.MethodPut, "big", strings.Repeat("x", 1<<20+1)); c != http.StatusRequestEntityTooLarge {
		t.Fatalf("oversized PUT: %d", c)
	}
	if _, ok := s.Get("big"); ok {
		t.Fatal("oversized value stored")
	}
	resp, err := http.Get("http://" + s.Addr() + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("health: %v %v", resp, err)
	}
	resp.Body.Close()
	resp, err = http.Get("http://" + s.Addr() + "/nope")
	if err != nil || resp.StatusCode != 404 {
		t.Fatalf("unknown path: %v %v", resp, err)
	}
	resp.Body.Close()
	// A client announcing 1000 bytes that sends 3 and hangs up stores nothing.
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write([]byte("PUT /metadata?key=cut HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"))
	c.Close()
	time.Sleep(50 * time.Millisecond)
	if _, ok := s.Get("cut"); ok {
		t.Fatal("a truncated body was stored")
	}
	if c, _ := req(http.MethodGet, "mooncake/ram/127.0.0.1:12345", ""); c != 200 {
		t.Fatal("the server stopped answering after a truncated request")
	}
}

// TestListenErrors: a port in use names Options.PortFlag (kvxfer
// metadata-server's --port) in its hint, and no flag when it is empty (the
// C ABI's and Python's MetadataServer callers have no --port); a foreign
// host says so.
func TestListenErrors(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	err = httpmeta.New(httpmeta.Options{Host: "127.0.0.1", Port: port, PortFlag: "--port"}).Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), "pick another with --port, or 0 for a free one") {
		t.Fatalf("port in use, PortFlag --port: %v", err)
	}
	err = httpmeta.New(httpmeta.Options{Host: "127.0.0.1", Port: port}).Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), "pick another port, or 0 for a free one") || strings.Contains(err.Error(), "--") {
		t.Fatalf("port in use, no PortFlag: %v", err)
	}
	err = httpmeta.New(httpmeta.Options{Host: "192.0.2.1"}).Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), "not an address of this machine") {
		t.Fatalf("foreign host: %v", err)
	}
}

// FuzzServe: any method, query string and body is answered without a panic;
// a refused request never changes the store, and an accepted PUT is read back.
func FuzzServe(f *testing.F) {
	for _, seed := range []struct{ m, q, b string }{
		{"PUT", "key=a", "v"}, {"GET", "key=a", ""}, {"DELETE", "key=a", ""},
		{"PUT", "key=%zz", "v"}, {"PUT", "key=%00", ""}, {"PUT", "key=mooncake/rpc_meta/x", "1"},
		{"POST", "", ""}, {"PUT", "key=a&key=b", "x"}, {"GET", ";;;&&==", ""},
	} {
		f.Add(seed.m, seed.q, []byte(seed.b))
	}
	s := httpmeta.New(httpmeta.Options{MaxValueBytes: 64, MaxKeys: 16, MaxTotalBytes: 512})
	f.Fuzz(func(t *testing.T, method, q string, body []byte) {
		before := s.Len()
		key, kerr := httpmeta.ParseKey(q)
		var old []byte
		var had bool
		if kerr == nil {
			old, had = s.Get(key)
			old = bytes.Clone(old)
		}
		r := s.Serve(method, q, bytes.NewReader(body))
		if r.Status == 0 || r.ContentType == "" {
			t.Fatalf("empty response %+v", r)
		}
		if r.Status != 200 {
			if method == http.MethodDelete && r.Status == 404 || method == http.MethodGet {
				return
			}
			if s.Len() != before {
				t.Fatalf("refused %s ?%q (%d) changed the key count %d → %d", method, q, r.Status, before, s.Len())
			}
			if kerr == nil {
				now, has := s.Get(key)
				if has != had || !bytes.Equal(now, old) {
					t.Fatalf("refused %s ?%q (%d) changed key %q", method, q, r.Status, key)
				}
			}
			return
		}
		if kerr != nil {
			t.Fatalf("%s ?%q accepted though ParseKey says %v", method, q, kerr)
		}
		if method == http.MethodPut {
			got, ok := s.Get(key)
			if !ok || (!bytes.Equal(got, body) && string(r.Body) != "metadata unchanged") {
				t.Fatalf("PUT %q then read %q, %v", key, got, ok)
			}
		}
	})
}
