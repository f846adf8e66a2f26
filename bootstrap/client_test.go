package bootstrap

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestClientRejectsUnusableRankIP: a decode resolving a rank from a server
// that stored an unreachable host (another implementation) gets an error
// naming rank_ip instead of an endpoint to dial.
func TestClientRejectsUnusableRankIP(t *testing.T) {
	for _, tc := range []struct{ ip, want string }{
		{"0.0.0.0", ""}, {"999.1.1.1", ""}, {"::", ""},
		{"10.1.2.3", "10.1.2.3"}, {"[fd00::1]", "fd00::1"},
	} {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"rank_ip":"` + tc.ip + `","rank_port":7000}`))
		}))
		c, err := NewClient(strings.TrimPrefix(hs.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
		cancel()
		hs.Close()
		if tc.want == "" {
			if err == nil || !strings.Contains(err.Error(), "rank_ip") {
				t.Errorf("rank_ip %q: got %+v %v, want an error naming rank_ip", tc.ip, ri, err)
			}
		} else if err != nil || ri.RankIP != tc.want {
			t.Errorf("rank_ip %q: got %+v %v, want %q", tc.ip, ri, err, tc.want)
		}
	}
}

// TestRouteMissingErrors (issue 22 item 13): against a directory without
// kvxfer's routes (SGLang's answers 404 for GET /v1/table and /v1/entry, 405
// for a method it lacks) Table, Entry, CheckIn and ServerInfo return an error
// that matches ErrUnsupported and gives the *StatusError to errors.As, but
// does not match ErrNotFound: a rank must not take "no such route" for "no
// entry" and re-register at every check.
func TestRouteMissingErrors(t *testing.T) {
	for _, code := range []int{http.StatusNotFound, http.StatusMethodNotAllowed} {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "Not Found: "+r.URL.Path, code)
		}))
		c, err := NewClient(strings.TrimPrefix(hs.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		calls := map[string]func() error{
			"Table":      func() error { _, err := c.Table(ctx); return err },
			"Entry":      func() error { _, err := c.Entry(ctx, Coord{TP: 1}); return err },
			"CheckIn":    func() error { _, err := c.CheckIn(ctx, Coord{TP: 1}, "inst-1"); return err },
			"ServerInfo": func() error { _, err := c.ServerInfo(ctx); return err },
		}
		for name, call := range calls {
			err := call()
			var se *StatusError
			switch {
			case !errors.Is(err, ErrUnsupported):
				t.Errorf("%d %s: %v does not match ErrUnsupported", code, name, err)
			case !errors.As(err, &se) || se.Code != code || !strings.Contains(se.Body, "Not Found"):
				t.Errorf("%d %s: errors.As gave %+v from %v", code, name, se, err)
			case errors.Is(err, ErrNotFound):
				t.Errorf("%d %s: %v matches ErrNotFound", code, name, err)
			case !strings.Contains(err.Error(), c.Addr()):
				t.Errorf("%d %s: %v does not name the server", code, name, err)
			}
		}
		cancel()
		hs.Close()
	}
}

// TestClientSilentAddressSaysWhatToCheck: a port that accepts connections
// and never answers HTTP (a rank's ZeroMQ control port given as the
// bootstrap address) fails after the request timeout saying that nothing
// answered and which port it should be, not "is the server running".
func TestClientSilentAddressSaysWhatToCheck(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	held := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held <- c // kept open, never answered
		}
	}()
	defer func() {
		for {
			select {
			case c := <-held:
				c.Close()
			default:
				return
			}
		}
	}()
	c, err := NewClient(ln.Addr().String(), WithRequestTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.ServerInfo(context.Background())
	if err == nil {
		t.Fatal("ServerInfo from a silent port succeeded")
	}
	for _, want := range []string{ln.Addr().String(), "no answer within the 200ms request timeout", "bootstrap server's HTTP port"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

// TestClientSilentAddressNamesCallersDeadline: when the caller's deadline
// (a 300 ms bootstrap timeout, say) ends before the client's 5 s request
// timeout, the error names the caller's deadline and the time waited, not
// "no answer within 5s".
func TestClientSilentAddressNamesCallersDeadline(t *testing.T) {
	// Never accepted: the kernel completes the handshake, nothing answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := NewClient(ln.Addr().String(), WithRequestTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = c.ServerInfo(ctx)
	if err == nil {
		t.Fatal("ServerInfo from a silent port succeeded")
	}
	msg := err.Error()
	if strings.Contains(msg, "5s") || !strings.Contains(msg, "before the caller's deadline ended") || !strings.Contains(msg, "bootstrap server's HTTP port") {
		t.Fatalf("error %q: want the caller's deadline named (not the 5s request timeout) and the port hint", msg)
	}
}

// TestErrorAnswerBodyIsOneLine: another HTTP service's error page (an
// HTML 404 with newlines, as python3 -m http.server answers) is quoted in
// the error on one line and shortened, so a caller that prints the error
// as one line (the Python examples, a JSON result line) stays one line
// (before: the page's newlines and all of its first 512 bytes).
func TestErrorAnswerBodyIsOneLine(t *testing.T) {
	page := "<!DOCTYPE HTML>\n<html lang=\"en\">\n    <head>\n        <title>Error response</title>\n    </head>\n    <body>\n        <h1>Error response</h1>\n        <p>Error code: 404</p>\n" + strings.Repeat("        <p>Message: File not found.</p>\n", 20) + "    </body>\n</html>\n"
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(page))
	}))
	defer hs.Close()
	c, err := NewClient(strings.TrimPrefix(hs.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.ServerInfo(context.Background())
	var se *StatusError
	if !errors.As(err, &se) || se.Code != http.StatusNotFound {
		t.Fatalf("ServerInfo against an HTML 404: %v, want a StatusError with code 404", err)
	}
	msg := err.Error()
	if strings.ContainsAny(msg, "\n\r\t") || strings.Contains(msg, "  ") || len(se.Body) > 200+len("…") ||
		!strings.Contains(msg, "<!DOCTYPE HTML> <html lang=\"en\"> <head> <title>Error response</title>") {
		t.Errorf("error %q: want the page's start on one line, white space collapsed, body at most 200 bytes", msg)
	}
	for _, c := range []struct{ in, want string }{
		{"  plain\tmessage \n", "plain message"},
		{"", ""},
		{strings.Repeat("é", 150), strings.Repeat("é", 100) + "…"},            // 2-byte runes: cut at 200 bytes exactly
		{"a" + strings.Repeat("é", 150), "a" + strings.Repeat("é", 99) + "…"}, // not inside a rune
	} {
		if got := bodyExcerpt([]byte(c.in)); got != c.want {
			t.Errorf("bodyExcerpt(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
