// Package debugsrv serves a rank's observability over HTTP (kvxfer
// prefill/decode --metrics-addr, the demo's children, kvx_metrics_serve):
//
//	GET /metrics               Prometheus text exposition of the registry
//	GET /debug/rooms           recent room timelines, newest first, JSON
//	                           (?failed=1: failed rooms only; ?limit=N, default 100)
//	GET /debug/rooms/{room}    one room's timeline on this rank, JSON
//	                           (?format=text: one line); 404 when the rank has none
//	GET /health                200 "OK"
//
// It uses net/http and promhttp only (no web framework), binds at once (port
// 0 picks a free one) and never reads the environment.
package debugsrv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvxfer/kvxfer/engine"
)

// RoomSource is what serves timelines: an *engine.Manager, or several
// (Rooms).
type RoomSource interface {
	RoomTimeline(room uint64) (engine.RoomTimeline, bool)
	RoomTimelines(failedOnly bool, limit int) []engine.RoomTimeline
}

// Server is a running debug HTTP server; Close stops it.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// DefaultRoomLimit is how many timelines GET /debug/rooms returns without
// ?limit.
const DefaultRoomLimit = 100

// Start listens on addr ("host:port"; port 0 picks a free one) and serves g
// and rooms (nil: the room routes answer 404) until Close. Errors: the
// address cannot be bound (named).
func Start(addr string, g prometheus.Gatherer, rooms RoomSource, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("debugsrv: listen on %s: %w (is the port in use? use port 0 for a free one)", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorLog: slogAdapter{log}}))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("OK")) })
	mux.HandleFunc("GET /debug/rooms", func(w http.ResponseWriter, r *http.Request) {
		limit := DefaultRoomLimit
		if v := r.URL.Query().Get("limit"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				writeErr(w, http.StatusBadRequest, fmt.Sprintf("limit %q: want a positive integer", v))
				return
			}
			limit = n
		}
		failed := r.URL.Query().Get("failed")
		out := []engine.RoomTimeline{}
		if rooms != nil {
			out = append(out, rooms.RoomTimelines(failed == "1" || failed == "true", limit)...)
		}
		writeJSON(w, http.StatusOK, out)
	})
	mux.HandleFunc("GET /debug/rooms/{room}", func(w http.ResponseWriter, r *http.Request) {
		room, err := strconv.ParseUint(r.PathValue("room"), 10, 64)
		if err != nil || room > 1<<63-1 {
			writeErr(w, http.StatusBadRequest, fmt.Sprintf("room %q: want a bootstrap_room, an integer 0 … 2^63-1", r.PathValue("room")))
			return
		}
		var tl engine.RoomTimeline
		ok := false
		if rooms != nil {
			tl, ok = rooms.RoomTimeline(room)
		}
		if !ok {
			writeErr(w, http.StatusNotFound, fmt.Sprintf("room %d is not on this rank: it never ran here, or it finished before the last rooms this rank keeps (kvxfer prefill/decode --timeline-rooms; %d in the C ABI and Python)", room, engine.DefaultTimelineRooms))
			return
		}
		if r.URL.Query().Get("format") == "text" {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = w.Write([]byte(tl.String() + "\n"))
			return
		}
		writeJSON(w, http.StatusOK, tl)
	})
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ErrorLog: nil}, ln: ln, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("debug HTTP server stopped", "addr", ln.Addr().String(), "err", err)
		}
	}()
	return s, nil
}

// Addr is the bound "host:port".
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server (in-flight requests get a second). Idempotent.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	<-s.done
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeErr(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}

// slogAdapter gives promhttp an error logger.
type slogAdapter struct{ l *slog.Logger }

func (a slogAdapter) Println(v ...any) { a.l.Warn("metrics handler", "err", fmt.Sprint(v...)) }

// Rooms merges several managers' timelines (one process holding several
// ranks, as the C ABI may).
type Rooms func() []RoomSource

// RoomTimeline returns the newest timeline of room among the sources.
func (f Rooms) RoomTimeline(room uint64) (engine.RoomTimeline, bool) {
	var best engine.RoomTimeline
	found := false
	for _, s := range f() {
		if tl, ok := s.RoomTimeline(room); ok && (!found || tl.Created.After(best.Created)) {
			best, found = tl, true
		}
	}
	return best, found
}

// RoomTimelines merges the sources' timelines, newest first.
func (f Rooms) RoomTimelines(failedOnly bool, limit int) []engine.RoomTimeline {
	var all []engine.RoomTimeline
	for _, s := range f() {
		all = append(all, s.RoomTimelines(failedOnly, limit)...)
	}
	sortNewest(all)
	if limit > 0 && len(all) > limit {
		all = all[:limit]
	}
	return all
}

func sortNewest(tls []engine.RoomTimeline) {
	slices.SortStableFunc(tls, func(a, b engine.RoomTimeline) int { return b.Created.Compare(a.Created) })
}

// Fetch gets one room's timeline from a debug server at addr ("host:port")
// within timeout. found is false when that rank does not have the room.
// Errors: the server cannot be reached or answers something else.
func Fetch(ctx context.Context, addr string, room uint64) (tl engine.RoomTimeline, found bool, err error) {
	url := "http://" + addr + "/debug/rooms/" + strconv.FormatUint(room, 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return tl, false, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return tl, false, fmt.Errorf("GET %s: %w (is --metrics-addr of that rank %s?)", url, err, addr)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		if err := json.NewDecoder(resp.Body).Decode(&tl); err != nil {
			return tl, false, fmt.Errorf("GET %s: decode the timeline: %w", url, err)
		}
		return tl, true, nil
	case http.StatusNotFound:
		return tl, false, nil
	}
	var e struct{ Error string }
	_ = json.NewDecoder(resp.Body).Decode(&e)
	return tl, false, fmt.Errorf("GET %s: %s: %s", url, resp.Status, e.Error)
}
