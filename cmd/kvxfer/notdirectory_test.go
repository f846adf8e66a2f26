package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestBootstrapNotADirectoryFailsFast: a decode whose request names an
// HTTP server that is no bootstrap directory (a 200 HTML page, a 404 for
// GET /route) fails the room within a few tries, saying the address is not
// a bootstrap directory, not at the end of its bootstrap timeout; a
// directory answering 503 (topology not complete) and an address that
// refuses connections are still retried until the bootstrap timeout.
func TestBootstrapNotADirectoryFailsFast(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	serve := func(code int, body string) string {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(code)
			_, _ = w.Write([]byte(body))
		}))
		t.Cleanup(s.Close)
		return s.Listener.Addr().String()
	}
	page := serve(http.StatusOK, "<html><body>Grafana</body></html>")
	missing := serve(http.StatusNotFound, "404 page not found")
	notReady := serve(http.StatusServiceUnavailable, "Prefill server not fully registered yet")
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close()

	const timeout = 4 * time.Second
	d := startProc(t, "decode", nil, roleArgs("decode", page, host, "--bootstrap-timeout", timeout.String())...)
	d.ready()
	start := time.Now()
	rooms := map[uint64]string{1: page, 2: missing, 3: notReady, 4: refused}
	for room, addr := range rooms {
		d.send(requestLine{Room: room, Tokens: 16, Bootstrap: addr})
	}
	for range rooms {
		r := d.result(time.Minute)
		took := time.Since(start)
		room := *r.Room
		if r.OK {
			t.Fatalf("room %d (%s) succeeded: %+v", room, rooms[room], r.Result)
		}
		switch room {
		case 1, 2:
			for _, w := range []string{"http://" + rooms[room] + " is not a bootstrap directory", "3 times in a row", "not another HTTP service"} {
				if !strings.Contains(r.Error, w) {
					t.Errorf("room %d (%s): error %q lacks %q", room, rooms[room], r.Error, w)
				}
			}
			if took >= timeout {
				t.Errorf("room %d (%s): failed after %s, not before the %s bootstrap timeout", room, rooms[room], took, timeout)
			}
		case 3, 4:
			if strings.Contains(r.Error, "not a bootstrap directory") || !strings.Contains(r.Error, "timeout") || took < timeout-time.Second {
				t.Errorf("room %d (%s): error %q after %s; want it retried until the %s bootstrap timeout", room, rooms[room], r.Error, took, timeout)
			}
		}
	}
}
