package metadata

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// HTTPSegmentPrefix is the key prefix of segment descriptors in an HTTP
// metadata server: a segment named N is stored under HTTPSegmentPrefix+N.
// It shares no key with Mooncake's own records ("mooncake/..."), so kvxfer
// and Mooncake engines can use one server side by side.
const HTTPSegmentPrefix = "kvxfer/segments/"

// HTTP defaults.
const (
	// DefaultHTTPRefresh is how often an HTTPStore checks that what it
	// published is still there (and publishes it again when the server lost
	// it: restarted, or an entry deleted by hand).
	DefaultHTTPRefresh = 5 * time.Second
	// DefaultHTTPPoll is how often a Watch asks for the watched descriptor.
	DefaultHTTPPoll = time.Second
	// maxHTTPValue bounds a value read from the server.
	maxHTTPValue = transport.MaxSegmentDescriptorBytes
)

// IsHTTP reports whether s names an HTTP metadata server ("http://" or
// "https://").
func IsHTTP(s string) bool {
	s = strings.ToLower(strings.TrimSpace(s))
	return strings.HasPrefix(s, "http://") || strings.HasPrefix(s, "https://")
}

// ParseHTTPURL parses Mooncake's HTTP metadata server address,
// "http://host:port/metadata" (any path; https too). Errors name what is
// wrong: another scheme, no host, a port that is not 1–65535, no path (the
// route is part of the URL: Mooncake's servers serve /metadata), a query or
// fragment (the key is appended as ?key=).
func ParseHTTPURL(s string) (*url.URL, error) {
	u, err := url.Parse(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("metadata: %q: not a URL: %v (want http://host:port/metadata)", s, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("metadata: %q: scheme %q: want http://host:port/metadata", s, u.Scheme)
	case u.Hostname() == "":
		return nil, fmt.Errorf("metadata: %q: no host (want http://host:port/metadata)", s)
	case u.Path == "" || u.Path == "/":
		return nil, fmt.Errorf("metadata: %q: no path; Mooncake's metadata servers serve /metadata (want http://%s/metadata)", s, u.Host)
	case u.RawQuery != "" || u.Fragment != "" || u.User != nil:
		return nil, fmt.Errorf("metadata: %q: want no query, fragment or user info (the key is added as ?key=)", s)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("metadata: %q: port %q: want 1–65535", s, p)
		}
	}
	return u, nil
}

// HTTPOptions tune OpenHTTP.
type HTTPOptions struct {
	// Timeout bounds each HTTP request (DefaultTimeout).
	Timeout time.Duration
	// Refresh is the interval of the publisher's check (DefaultHTTPRefresh).
	Refresh time.Duration
	// Poll is the interval at which Watch reads a watched descriptor
	// (DefaultHTTPPoll).
	Poll time.Duration
	// DeleteGrace is how long a watched descriptor must stay absent before
	// Watch reports it deleted (2 × Refresh when 0): a restarted server is
	// empty until every live publisher's next refresh, and that absence is
	// not a peer loss.
	DeleteGrace time.Duration
	// Client is the HTTP client (a fresh one when nil).
	Client *http.Client
	// Logger receives republishes and conflicts (slog.Default when nil).
	Logger *slog.Logger
}

// HTTPStore is a connection to a Mooncake-style HTTP metadata server
// (package httpmeta, or Mooncake's mooncake_http_metadata_server). It
// implements transport.SegmentDirectory with the server's GET/PUT/DELETE
// /metadata?key= routes.
//
// The server has no leases: a descriptor stays until it is deleted, so a
// crashed engine's entry remains (a peer that opens it fails to connect, as
// in Mooncake's HTTP mode) until the name is published again. What the store
// published is checked every Refresh and published again when the server
// lost it (a restarted server is empty). Watch polls every Poll: a restart
// of the peer (new epoch) is seen within that interval, an orderly shutdown
// (the entry deleted) once the name stayed absent for DeleteGrace, so that a
// restarted server does not read as every peer lost. Close it when done
// (idempotent).
type HTTPStore struct {
	u    *url.URL
	opts HTTPOptions
	cli  *http.Client
	log  *slog.Logger
	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu        sync.Mutex
	closed    bool
	published map[string][]byte // key → value this process published
	conflicts map[string]string // key → value seen instead, logged once
	seen      map[string]httpRev
	rev       int64
}

// httpRev is the last value a Resolve or Watch saw under a name and the
// revision number this store gave it.
type httpRev struct {
	rev int64
	val []byte
}

var _ transport.SegmentDirectory = (*HTTPStore)(nil)

// OpenHTTP checks that the metadata server at rawURL answers (one GET,
// bounded by Timeout: 200 or 404 is an answer) and starts the publisher's
// refresh. An unreachable server fails with an error wrapping
// transport.ErrMetadataUnavailable and naming the URL; a malformed URL or a
// server that answers something else (not a metadata server) fails without
// it.
func OpenHTTP(ctx context.Context, rawURL string, o HTTPOptions) (*HTTPStore, error) {
	u, err := ParseHTTPURL(rawURL)
	if err != nil {
		return nil, err
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Refresh <= 0 {
		o.Refresh = DefaultHTTPRefresh
	}
	if o.Poll <= 0 {
		o.Poll = DefaultHTTPPoll
	}
	if o.DeleteGrace <= 0 {
		o.DeleteGrace = 2 * o.Refresh
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	cli := o.Client
	if cli == nil {
		cli = &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second}}
	}
	sctx, stop := context.WithCancel(context.Background())
	s := &HTTPStore{u: u, opts: o, cli: cli, log: o.Logger.With("metadata", u.String()), ctx: sctx, stop: stop,
		published: map[string][]byte{}, conflicts: map[string]string{}, seen: map[string]httpRev{}}
	code, _, err := s.do(ctx, http.MethodGet, HTTPSegmentPrefix+".probe", nil)
	if err != nil {
		stop()
		return nil, s.unavailable("connect", err)
	}
	if code != http.StatusOK && code != http.StatusNotFound {
		stop()
		return nil, fmt.Errorf("metadata: %s answered GET ?key= with HTTP %d, not 200 or 404: is it a metadata server (mooncake_http_metadata_server, `kvxfer metadata-server`)? check the URL's path", u, code)
	}
	s.wg.Add(1)
	go s.refresher()
	return s, nil
}

// String returns the server's URL (transport.SegmentDirectory).
func (s *HTTPStore) String() string { return s.u.String() }

// SegmentKey returns the key of a segment name.
func (s *HTTPStore) SegmentKey(name string) string { return HTTPSegmentPrefix + name }

func (s *HTTPStore) unavailable(op string, err error) error {
	return fmt.Errorf("metadata: %s: HTTP metadata server %s unreachable or not answering: %w: %v", op, s.u, transport.ErrMetadataUnavailable, err)
}

// do sends one request for key and returns the status and body (at most
// maxHTTPValue bytes).
func (s *HTTPStore) do(ctx context.Context, method, key string, body []byte) (int, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	target := *s.u
	target.RawQuery = "key=" + url.QueryEscape(key)
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, target.String(), rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := s.cli.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxHTTPValue+1))
	if err != nil {
		return 0, nil, err
	}
	if len(b) > maxHTTPValue {
		return 0, nil, fmt.Errorf("%s %s: answer over %d bytes", method, key, maxHTTPValue)
	}
	return resp.StatusCode, b, nil
}

// answer turns a non-200 status into an error naming it.
func (s *HTTPStore) answer(op string, code int, body []byte) error {
	msg := strings.TrimSpace(string(body))
	if len(msg) > 200 {
		msg = msg[:200] + "…"
	}
	if code >= 500 {
		return fmt.Errorf("metadata: %s: HTTP metadata server %s answered %d %q: %w", op, s.u, code, msg, transport.ErrMetadataUnavailable)
	}
	return fmt.Errorf("metadata: %s: HTTP metadata server %s answered %d %q", op, s.u, code, msg)
}

func (s *HTTPStore) checkOpen(op string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("metadata: %s: store for %s: %w", op, s.u, transport.ErrClosed)
	}
	return nil
}

// Publish stores desc under its segment name (transport.SegmentDirectory). The
// value is kept even when the server is unreachable, so the refresher
// publishes the latest once it answers.
func (s *HTTPStore) Publish(ctx context.Context, desc transport.SegmentDescriptor) error {
	if desc.Name == "" || strings.ContainsAny(desc.Name, "\x00") {
		return fmt.Errorf("metadata: publish: segment name %q is empty or has a NUL byte", desc.Name)
	}
	op := "publish segment " + desc.Name
	if err := s.checkOpen(op); err != nil {
		return err
	}
	key, val := s.SegmentKey(desc.Name), desc.Encode()
	s.mu.Lock()
	s.published[key] = val
	delete(s.conflicts, key)
	s.mu.Unlock()
	code, body, err := s.do(ctx, http.MethodPut, key, val)
	if err != nil {
		return s.unavailable(op, err)
	}
	if code != http.StatusOK {
		return s.answer(op, code, body)
	}
	return nil
}

// Unpublish removes a segment name and stops publishing it
// (transport.SegmentDirectory). A name the server does not hold is not an error.
func (s *HTTPStore) Unpublish(ctx context.Context, name string) error {
	key := s.SegmentKey(name)
	s.mu.Lock()
	delete(s.published, key)
	s.mu.Unlock()
	code, body, err := s.do(ctx, http.MethodDelete, key, nil)
	if err != nil {
		return s.unavailable("unpublish segment "+name, err)
	}
	if code != http.StatusOK && code != http.StatusNotFound {
		return s.answer("unpublish segment "+name, code, body)
	}
	return nil
}

// get reads name's value: (value, true), (nil, false) when absent.
func (s *HTTPStore) get(ctx context.Context, name string) ([]byte, bool, error) {
	code, body, err := s.do(ctx, http.MethodGet, s.SegmentKey(name), nil)
	if err != nil {
		return nil, false, s.unavailable("resolve segment "+name, err)
	}
	switch code {
	case http.StatusOK:
		return body, true, nil
	case http.StatusNotFound:
		return nil, false, nil
	}
	return nil, false, s.answer("resolve segment "+name, code, body)
}

// note records the value seen under name and returns its revision (a new
// one when the value changed).
func (s *HTTPStore) note(name string, val []byte) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.seen[name]; ok && bytes.Equal(r.val, val) {
		return r.rev
	}
	s.rev++
	s.seen[name] = httpRev{rev: s.rev, val: val}
	return s.rev
}

// Resolve returns the descriptor published under name and a revision for
// Watch (transport.SegmentDirectory). Errors wrap transport.ErrSegmentNotFound,
// transport.ErrMetadataUnavailable or ErrBadRecord.
func (s *HTTPStore) Resolve(ctx context.Context, name string) (transport.SegmentDescriptor, int64, error) {
	val, ok, err := s.get(ctx, name)
	if err != nil {
		return transport.SegmentDescriptor{}, 0, err
	}
	if !ok {
		return transport.SegmentDescriptor{}, 0, fmt.Errorf("metadata: segment %q is not published in %s (not started, shut down, or started with another metadata server): %w",
			name, s.u, transport.ErrSegmentNotFound)
	}
	d, err := transport.DecodeSegmentDescriptor(val)
	if err != nil {
		return transport.SegmentDescriptor{}, 0, fmt.Errorf("metadata: segment %q in %s: %w: %w", name, s.u, ErrBadRecord, err)
	}
	return d, s.note(name, val), nil
}

// Watch polls name's descriptor every Poll and calls fn, from one goroutine
// and in order, when it changed after revision rev or vanished for longer
// than DeleteGrace (transport.SegmentDirectory). An unreachable server delivers nothing until
// it answers again; a value that does not decode is logged and skipped.
func (s *HTTPStore) Watch(name string, rev int64, fn func(transport.SegmentEvent)) (stop func()) {
	ctx, cancel := context.WithCancel(s.ctx)
	done := make(chan struct{})
	s.mu.Lock()
	var last []byte
	present := false
	if r, ok := s.seen[name]; ok && r.rev == rev {
		last, present = r.val, true
	}
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(done)
		t := time.NewTicker(s.opts.Poll)
		defer t.Stop()
		var absentSince time.Time // first poll that found the name absent
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			val, ok, err := s.get(ctx, name)
			if err != nil {
				continue
			}
			if ok || !present {
				absentSince = time.Time{}
			} else if absentSince.IsZero() {
				absentSince = time.Now()
			}
			switch {
			case !ok && present && time.Since(absentSince) >= s.opts.DeleteGrace:
				present, last = false, nil
				s.mu.Lock()
				s.rev++
				r := s.rev
				s.mu.Unlock()
				fn(transport.SegmentEvent{Name: name, Deleted: true, Rev: r})
			case ok && (!present || !bytes.Equal(val, last)):
				d, err := transport.DecodeSegmentDescriptor(val)
				present, last = true, val
				if err != nil {
					s.log.Warn("ignoring a malformed segment descriptor in the HTTP metadata server", "key", s.SegmentKey(name), "err", err)
					continue
				}
				fn(transport.SegmentEvent{Name: name, Desc: d, Rev: s.note(name, val)})
			}
		}
	}()
	return func() { cancel(); <-done }
}

// refresher publishes again what the server lost, every Refresh.
func (s *HTTPStore) refresher() {
	defer s.wg.Done()
	t := time.NewTicker(s.opts.Refresh)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		s.refresh()
	}
}

// refresh checks each published key once: absent → publish it again;
// another value → log once (another process publishes the same name).
func (s *HTTPStore) refresh() {
	s.mu.Lock()
	keys := make(map[string][]byte, len(s.published))
	for k, v := range s.published {
		keys[k] = v
	}
	s.mu.Unlock()
	for k, v := range keys {
		code, body, err := s.do(s.ctx, http.MethodGet, k, nil)
		if err != nil {
			s.log.Debug("metadata server not answering; publishing again when it does", "key", k, "err", err)
			return
		}
		switch {
		case code == http.StatusNotFound:
			s.mu.Lock()
			cur, still := s.published[k]
			s.mu.Unlock()
			if !still || !bytes.Equal(cur, v) {
				continue // unpublished or replaced meanwhile
			}
			if c, _, err := s.do(s.ctx, http.MethodPut, k, v); err == nil && c == http.StatusOK {
				s.log.Info("the metadata server had lost this segment descriptor (restarted, or deleted by hand); published it again", "key", k)
			}
		case code == http.StatusOK && !bytes.Equal(body, v):
			s.mu.Lock()
			logged := s.conflicts[k] == string(body)
			s.conflicts[k] = string(body)
			s.mu.Unlock()
			if !logged {
				s.log.Warn("another process publishes this segment name in the metadata server; peers resolve its descriptor, not this one's (give every engine its own name)", "key", k)
			}
		}
	}
}

// Close stops the refresher and every watch. It does not delete what was
// published (engines unpublish their names on Close). Idempotent.
func (s *HTTPStore) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.stop()
	s.wg.Wait()
	s.cli.CloseIdleConnections()
	return nil
}
