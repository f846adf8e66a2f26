// Package httpmeta is kvxfer's HTTP metadata server: the key/value store
// Mooncake's transfer engines use as their metadata server in HTTP mode
// (metadata_server "http://host:port/metadata", what Mooncake's CI runs with
// mooncake_http_metadata_server). Routes, as Mooncake serves them
// (mooncake-wheel/mooncake/http_metadata_server.py and
// mooncake-store/src/http_metadata_server.cpp):
//
//	GET    /metadata?key=K   200 with the stored bytes (application/json), 404 when absent
//	PUT    /metadata?key=K   200 "metadata updated" (body stored as is)
//	DELETE /metadata?key=K   200 "metadata deleted", 404 when absent
//	GET    /health           200 "OK"
//
// A request without a key, or with a blank one, is answered 400 and changes
// nothing; keys are trimmed of surrounding white space before use (the
// Python server's rule). A key containing "rpc_meta" is written once: a PUT
// with another value is refused (400 "Duplicate rpc_meta key not allowed"),
// the same value again answers 200 "metadata unchanged" (the C++ server's
// rule). Other methods on /metadata get 405.
//
// kvxfer adds bounds: a key is at most MaxKeyBytes bytes and has no NUL or
// control byte, a value at most Options.MaxValueBytes (413 beyond it), the
// store at most Options.MaxKeys keys and Options.MaxTotalBytes bytes of keys
// and values (507 beyond either), and a malformed query string (a bad
// %-escape) is a 400 naming it. Bad input never changes the store.
// metadata.HTTPStore is the client kvxfer engines use.
//
// The store lives in memory: a restarted server is empty, and kvxfer's
// engines publish their descriptors again within their refresh interval
// (metadata.HTTPOptions.Refresh).
package httpmeta

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/labstack/echo/v4"
)

// Defaults and limits.
const (
	// DefaultPort is the port Mooncake's mooncake_http_metadata_server
	// listens on by default.
	DefaultPort = 8080
	// MaxKeyBytes bounds a key's length in bytes (after trimming).
	MaxKeyBytes = 4096
	// DefaultMaxValueBytes bounds a stored value (a kvxfer segment
	// descriptor is at most 8 MiB, transport.MaxSegmentDescriptorBytes).
	DefaultMaxValueBytes = 8 << 20
	// DefaultMaxKeys bounds the number of keys stored.
	DefaultMaxKeys = 100_000
	// DefaultMaxTotalBytes bounds the bytes of all keys and values stored.
	DefaultMaxTotalBytes = 1 << 30
	// Path is the metadata route.
	Path = "/metadata"
)

// Response texts. The status codes carry the meaning; the texts are
// Mooncake's where Mooncake has one.
const (
	msgUpdated   = "metadata updated"
	msgUnchanged = "metadata unchanged"
	msgDeleted   = "metadata deleted"
	msgNotFound  = "metadata not found"
	msgDupRPC    = "Duplicate rpc_meta key not allowed"
)

const (
	ctJSON = "application/json"
	ctText = "text/plain; charset=utf-8"
)

// ErrBadKey is wrapped by ParseKey's errors.
var ErrBadKey = errors.New("httpmeta: bad metadata key")

// ParseKey returns the "key" parameter of a raw query string ("key=a%2Fb&x=1"),
// unescaped and trimmed of surrounding white space; the first "key" wins when
// there are several, as in Mooncake's servers. Errors wrap ErrBadKey and say
// what is wrong: a malformed escape, no key or a blank one, a key over
// MaxKeyBytes bytes, a NUL or other control byte in the key.
func ParseKey(rawQuery string) (string, error) {
	vals, err := url.ParseQuery(rawQuery)
	if err != nil {
		return "", fmt.Errorf("%w: the query string does not decode (%v); escape the key with %%XX (urllib.parse.quote, curl --data-urlencode)", ErrBadKey, err)
	}
	ks, ok := vals["key"]
	if !ok || len(ks) == 0 {
		return "", fmt.Errorf("%w: metadata key is required (%s?key=<key>)", ErrBadKey, Path)
	}
	k := strings.TrimSpace(ks[0])
	switch {
	case k == "":
		return "", fmt.Errorf("%w: metadata key is required: the key is empty or only white space", ErrBadKey)
	case len(k) > MaxKeyBytes:
		return "", fmt.Errorf("%w: the key is %d bytes, more than %d", ErrBadKey, len(k), MaxKeyBytes)
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c < 0x20 || c == 0x7f {
			return "", fmt.Errorf("%w: the key has control byte %#02x at offset %d", ErrBadKey, c, i)
		}
	}
	return k, nil
}

// Options configure a Server. The zero value listens on every interface at
// a kernel-chosen port with the default limits; `kvxfer metadata-server`
// defaults the port to DefaultPort.
type Options struct {
	// Host is the listen host (IP or host name; "" = every interface).
	Host string
	// Port is the listen port, 0–65535 (0: the kernel picks; Addr tells).
	Port int
	// PortFlag names how the operator chooses Port (kvxfer
	// metadata-server: "--port"), for the hint of a port-in-use error;
	// empty: the hint says "another port", for embedders whose port comes
	// from elsewhere (the C ABI's kvx_metadata_server_start, Python's
	// MetadataServer(port=...)).
	PortFlag string
	// MaxValueBytes bounds a PUT body (DefaultMaxValueBytes when 0).
	MaxValueBytes int64
	// MaxKeys bounds the keys stored (DefaultMaxKeys when 0).
	MaxKeys int
	// MaxTotalBytes bounds the bytes of every key and value stored
	// (DefaultMaxTotalBytes when 0).
	MaxTotalBytes int64
	// ShutdownTimeout bounds graceful shutdown (5 s when 0).
	ShutdownTimeout time.Duration
	// Logger receives the server's logs (slog.Default when nil).
	Logger *slog.Logger
}

// Server is an in-memory HTTP metadata server (see the package doc). Create
// with New, serve with Start or mount Handler. Safe for concurrent use.
type Server struct {
	opts Options
	log  *slog.Logger
	e    *echo.Echo

	ready   chan struct{}
	addrMu  sync.Mutex
	addr    string
	started bool

	mu    sync.RWMutex
	store map[string][]byte
	total int64 // bytes of keys and values in store
}

// New builds a server (see Options for the defaults); it does not listen
// until Start.
func New(opts Options) *Server {
	if opts.MaxValueBytes <= 0 {
		opts.MaxValueBytes = DefaultMaxValueBytes
	}
	if opts.MaxKeys <= 0 {
		opts.MaxKeys = DefaultMaxKeys
	}
	if opts.MaxTotalBytes <= 0 {
		opts.MaxTotalBytes = DefaultMaxTotalBytes
	}
	if opts.ShutdownTimeout <= 0 {
		opts.ShutdownTimeout = 5 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Server{opts: opts, log: opts.Logger.With("component", "metadata-server"), ready: make(chan struct{}), store: map[string][]byte{}}
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = s.errorHandler
	e.Any(Path, s.handleMetadata)
	e.GET("/health", func(c echo.Context) error { return c.Blob(http.StatusOK, ctText, []byte("OK")) })
	s.e = e
	return s
}

// Handler returns the HTTP handler (for httptest or another listener).
func (s *Server) Handler() http.Handler { return s.e }

// errorHandler answers echo's own errors (unknown path, a panic) in plain
// text without internals.
func (s *Server) errorHandler(err error, c echo.Context) {
	if c.Response().Committed {
		return
	}
	code, msg := http.StatusInternalServerError, "internal error"
	var he *echo.HTTPError
	if errors.As(err, &he) {
		code, msg = he.Code, fmt.Sprint(he.Message)
	}
	if code == http.StatusInternalServerError {
		s.log.Error("handler failed", "method", c.Request().Method, "uri", c.Request().RequestURI, "err", err)
	}
	_ = c.Blob(code, ctText, []byte(msg))
}

// Response is one answer of Serve: status code, content type and body.
type Response struct {
	Status      int
	ContentType string
	Body        []byte
}

func text(code int, msg string) Response {
	return Response{Status: code, ContentType: ctText, Body: []byte(msg)}
}

// Serve answers one /metadata request: method, raw query string and body
// (read up to MaxValueBytes+1 bytes). It is the whole request decoding and
// store logic; the HTTP handler only adapts it. Bad input is answered 400,
// 405, 413 or 507 and never changes the store.
func (s *Server) Serve(method, rawQuery string, body io.Reader) Response {
	switch method {
	case http.MethodGet, http.MethodPut, http.MethodDelete:
	default:
		return text(http.StatusMethodNotAllowed, fmt.Sprintf("method %s not allowed on %s: use GET, PUT or DELETE", method, Path))
	}
	key, err := ParseKey(rawQuery)
	if err != nil {
		return text(http.StatusBadRequest, strings.TrimPrefix(err.Error(), ErrBadKey.Error()+": "))
	}
	switch method {
	case http.MethodGet:
		s.mu.RLock()
		v, ok := s.store[key]
		s.mu.RUnlock()
		if !ok {
			return text(http.StatusNotFound, msgNotFound)
		}
		return Response{Status: http.StatusOK, ContentType: ctJSON, Body: v}
	case http.MethodDelete:
		s.mu.Lock()
		old, ok := s.store[key]
		if ok {
			delete(s.store, key)
			s.total -= int64(len(key) + len(old))
		}
		s.mu.Unlock()
		if !ok {
			return text(http.StatusNotFound, msgNotFound)
		}
		return text(http.StatusOK, msgDeleted)
	}
	if body == nil {
		body = http.NoBody
	}
	v, err := io.ReadAll(io.LimitReader(body, s.opts.MaxValueBytes+1))
	if err != nil {
		return text(http.StatusBadRequest, "reading the request body: "+err.Error())
	}
	if int64(len(v)) > s.opts.MaxValueBytes {
		return text(http.StatusRequestEntityTooLarge, fmt.Sprintf("the value is more than %d bytes (the server's limit)", s.opts.MaxValueBytes))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old, exists := s.store[key]
	if exists && strings.Contains(key, "rpc_meta") {
		if bytes.Equal(old, v) {
			return text(http.StatusOK, msgUnchanged)
		}
		return text(http.StatusBadRequest, msgDupRPC)
	}
	if !exists && len(s.store) >= s.opts.MaxKeys {
		return text(http.StatusInsufficientStorage, fmt.Sprintf("the store holds %d keys, its limit; delete keys first", len(s.store)))
	}
	grow := int64(len(v) - len(old))
	if !exists {
		grow += int64(len(key))
	}
	if s.total+grow > s.opts.MaxTotalBytes {
		return text(http.StatusInsufficientStorage, fmt.Sprintf("the store holds %d bytes; this value would pass its %d-byte limit; delete keys first", s.total, s.opts.MaxTotalBytes))
	}
	s.store[key] = v
	s.total += grow
	return text(http.StatusOK, msgUpdated)
}

func (s *Server) handleMetadata(c echo.Context) error {
	r := c.Request()
	var body io.Reader
	if r.Method == http.MethodPut {
		body = r.Body
	}
	resp := s.Serve(r.Method, r.URL.RawQuery, body)
	if resp.Status == http.StatusMethodNotAllowed {
		c.Response().Header().Set("Allow", "GET, PUT, DELETE")
	}
	return c.Blob(resp.Status, resp.ContentType, resp.Body)
}

// Get returns the value stored under key (for tests and tools).
func (s *Server) Get(key string) ([]byte, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v, ok := s.store[key]
	return v, ok
}

// Len returns the number of keys stored.
func (s *Server) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.store)
}

// Start listens on Options.Host:Port and serves until ctx is done, then
// shuts down (bounded by ShutdownTimeout) and returns nil. A bind error is
// returned at once (Ready is then never closed). Start may be called once.
func (s *Server) Start(ctx context.Context) error {
	s.addrMu.Lock()
	if s.started {
		s.addrMu.Unlock()
		return errors.New("httpmeta: server already started")
	}
	s.started = true
	s.addrMu.Unlock()
	ln, err := listen(s.opts.Host, s.opts.Port, s.opts.PortFlag)
	if err != nil {
		return err
	}
	s.addrMu.Lock()
	s.addr = ln.Addr().String()
	s.addrMu.Unlock()
	srv := &http.Server{
		Handler:           s.e,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.log.Info("metadata server listening", "addr", s.addr, "route", Path)
	close(s.ready)
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), s.opts.ShutdownTimeout)
		defer cancel()
		err := srv.Shutdown(sctx)
		if err != nil {
			_ = srv.Close()
		}
		<-serveErr
		if err != nil {
			return fmt.Errorf("httpmeta: graceful shutdown: %w (requests still running after %s)", err, s.opts.ShutdownTimeout)
		}
		return nil
	case err := <-serveErr:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("httpmeta: serve on %s: %w", s.addr, err)
	}
}

// Addr returns the bound "host:port" once Ready is closed ("" before).
func (s *Server) Addr() string {
	s.addrMu.Lock()
	defer s.addrMu.Unlock()
	return s.addr
}

// Ready is closed once the server listens.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// listen opens host:port; errors say what to change (a port in use: pick
// another, with portFlag when it is not "").
func listen(host string, port int, portFlag string) (net.Listener, error) {
	pick := "pick another port"
	if portFlag != "" {
		pick = "pick another with " + portFlag
	}
	if port < 0 || port > 65535 {
		return nil, fmt.Errorf("httpmeta: port %d out of range 0–65535", port)
	}
	if len(host) > 1 && host[0] == '[' && host[len(host)-1] == ']' {
		host = host[1 : len(host)-1]
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err == nil {
		return ln, nil
	}
	var dnsErr *net.DNSError
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		return nil, fmt.Errorf("httpmeta: listen on %s: %w (another metadata server on this port? %s, or 0 for a free one)", addr, err, pick)
	case errors.Is(err, syscall.EADDRNOTAVAIL), errors.As(err, &dnsErr):
		return nil, fmt.Errorf("httpmeta: listen on %s: %w (host %q is not an address of this machine; use 127.0.0.1, 0.0.0.0, :: or one of `ip -brief addr`)", addr, err, host)
	case errors.Is(err, syscall.EACCES):
		return nil, fmt.Errorf("httpmeta: listen on %s: %w (ports below 1024 need privileges; pick one ≥ 1024)", addr, err)
	}
	return nil, fmt.Errorf("httpmeta: listen on %s: %w", addr, err)
}
