// Package server is kvxfer's bootstrap directory server: an SGLang-compatible
// HTTP server (echo) that the prefill ranks of one instance register with and
// decode ranks resolve against, with Prometheus metrics. Its wire types,
// parsers and client are in package bootstrap; ranks import only that.
//
// Routes (spec §2.2, /work/shared/spec/sglang-bootstrap.md): PUT/GET /route,
// POST /register_dp_rank, POST /query_dp_ranks, GET /health — SGLang's shapes
// and codes (from common/conn.py at commit 0094505d, and at b7e89b39 for the
// newest key set: decode_allocation_policy and dsv41_spec_layout carried,
// 400 for a rank that disagrees on either) — plus kvxfer's extensions
// DELETE /route, GET /v1/table, GET /v1/entry (with instance_id: a rank's
// check-in, the heartbeat behind TableRank.Stale) and GET /metrics.
package server

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Content types as SGLang's aiohttp server sends them.
const (
	ctText = "text/plain; charset=utf-8"
	ctJSON = "application/json; charset=utf-8"
)

// Options configure a Server. The zero value serves on all interfaces at a
// kernel-chosen port with the newest SGLang key set, a 120 s room TTL and no
// authentication; `kvxfer bootstrap` defaults the port to DefaultPort.
type Options struct {
	// Host is the listen host (IP or hostname; "" = all interfaces).
	Host string
	// Port is the listen port, 0–65535; 0 lets the kernel pick one
	// (Server.Addr reports it). SGLang's default is DefaultPort.
	Port int
	// PortFlag names how the operator chooses Port (kvxfer bootstrap:
	// "--port"), for the hint of a listen error (port in use, privileged
	// port); empty: the hint says "another port", for embedders whose
	// port comes from elsewhere (the C ABI's kvx_bootstrap_start, SGLang's
	// --disaggregation-bootstrap-port).
	PortFlag string
	// EntryTTL is the room→dp-rank entry lifetime; 0 means DefaultEntryTTL.
	EntryTTL time.Duration
	// AuthToken, when non-empty, requires "Authorization: Bearer <token>" on
	// the mutating routes (PUT/DELETE /route, POST /register_dp_rank); a
	// missing or wrong token gets 401 "Unauthorized". Compared in constant time.
	AuthToken string
	// Compat selects the PrefillServerInfo key set: CompatSGLangNewest (the
	// default when empty: SGLang's newest, with decode_allocation_policy and
	// dsv41_spec_layout) or CompatSGLang0094505 (for decodes of that age,
	// which refuse keys they do not know; it refuses registrations declaring
	// a non-default policy or a DSpark layout).
	Compat string
	// DistInitAddr, when set, is the multi-node prefill's --dist-init-addr;
	// the server reports it in the X-Kvxfer-Dist-Init-Addr header so that
	// followers can check they reached the right leader (Client.CheckLeader).
	DistInitAddr string
	// MaxRooms bounds the live room→dp-rank entries; 0 means 1,000,000. A
	// registration beyond it gets 429 until entries expire.
	MaxRooms int
	// MaxBodyBytes bounds request bodies in bytes; 0 means 8 MiB. A larger
	// body is answered 413 Request Entity Too Large naming the limit.
	MaxBodyBytes int64
	// ShutdownTimeout bounds graceful shutdown; 0 means 5 s.
	ShutdownTimeout time.Duration
	// RequestLog enables one slog line per request (debug level).
	RequestLog bool
	// Logger receives the server's logs; nil means slog.Default().
	Logger *slog.Logger
}

// Server is the bootstrap directory of one prefill instance. Routes
// (spec §2.2): PUT/GET /route, POST /register_dp_rank, POST /query_dp_ranks,
// GET and HEAD /health — SGLang's shapes and codes — plus kvxfer's
// extensions DELETE /route (conditional on instance_id), GET /v1/table,
// GET /v1/entry and GET /metrics. Create with New,
// run with Start. Safe for concurrent use.
type Server struct {
	opts Options
	log  *slog.Logger
	e    *echo.Echo

	ready   chan struct{}
	addrMu  sync.Mutex
	addr    string
	started bool

	mu    sync.RWMutex
	topo  *topology
	table map[bootstrap.Coord]*rankEntry
	// infoJSON is the pre-encoded topology answer, rebuilt on change.
	infoJSON []byte

	roomMu sync.Mutex
	rooms  map[uint64]roomEntry

	m metrics
}

// New builds a server from opts (see Options for the defaults). It does
// not listen yet; call Start. An unknown Compat value is reported by Start.
func New(opts Options) *Server {
	if opts.EntryTTL <= 0 {
		opts.EntryTTL = bootstrap.DefaultEntryTTL
	}
	if opts.Compat == "" {
		opts.Compat = bootstrap.DefaultCompat
	}
	if opts.MaxRooms <= 0 {
		opts.MaxRooms = 1_000_000
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = 8 << 20
	}
	if opts.ShutdownTimeout <= 0 {
		opts.ShutdownTimeout = 5 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Server{
		opts:  opts,
		log:   opts.Logger.With("component", "bootstrap"),
		ready: make(chan struct{}),
		table: make(map[bootstrap.Coord]*rankEntry),
		rooms: make(map[uint64]roomEntry),
	}
	s.m = newMetrics(func() float64 { return float64(s.staleCount(time.Now())) })
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = s.errorHandler
	if opts.DistInitAddr != "" {
		e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
			return func(c echo.Context) error {
				c.Response().Header().Set(bootstrap.HeaderDistInitAddr, opts.DistInitAddr)
				return next(c)
			}
		})
	}
	if opts.RequestLog {
		e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
			return func(c echo.Context) error {
				t := time.Now()
				err := next(c)
				s.log.Debug("request", "method", c.Request().Method, "uri", c.Request().RequestURI,
					"status", c.Response().Status, "dur", time.Since(t), "remote", c.RealIP())
				return err
			}
		})
	}
	e.Any("/route", s.handleRoute)
	e.POST("/register_dp_rank", s.handleRegisterDPRank)
	e.POST("/query_dp_ranks", s.handleQueryDPRanks)
	// GET routes answer HEAD too, as aiohttp's add_get does (SGLang's
	// /health; load balancers probe with HEAD): same status and headers, no
	// body (net/http drops it).
	health := func(c echo.Context) error { return c.Blob(http.StatusOK, ctText, []byte("OK")) }
	metrics := echo.WrapHandler(promhttp.HandlerFor(s.m.reg, promhttp.HandlerOpts{}))
	for _, m := range []string{http.MethodGet, http.MethodHead} {
		e.Add(m, "/health", health)
		e.Add(m, "/v1/table", s.handleTable)
		e.Add(m, "/v1/entry", s.handleEntry)
		e.Add(m, "/metrics", metrics)
	}
	s.e = e
	return s
}

// Handler returns the server's HTTP handler (for embedding in another
// listener or httptest); Start is not needed to use it, but the room
// registry is then swept only lazily (expired rooms are still never returned).
func (s *Server) Handler() http.Handler { return s.e }

// errorHandler answers echo's own errors (unknown path, wrong method on a
// known path, a panic) in plain text; it never leaks internals.
func (s *Server) errorHandler(err error, c echo.Context) {
	if c.Response().Committed {
		return
	}
	code, msg := http.StatusInternalServerError, "internal error"
	var he *echo.HTTPError
	if errors.As(err, &he) {
		code = he.Code
		msg = fmt.Sprint(he.Message)
	}
	if code == http.StatusInternalServerError {
		s.log.Error("handler failed", "method", c.Request().Method, "uri", c.Request().RequestURI, "err", err)
	}
	_ = c.Blob(code, ctText, []byte(msg))
}

// Start listens on Options.Host:Port and serves until ctx is done, then shuts
// down gracefully (bounded by ShutdownTimeout) and returns nil. A bind error
// or a bad option is returned at once; Ready is then never closed. Start may
// be called once.
func (s *Server) Start(ctx context.Context) error {
	s.addrMu.Lock()
	if s.started {
		s.addrMu.Unlock()
		return errors.New("bootstrap: server already started")
	}
	s.started = true
	s.addrMu.Unlock()
	if s.opts.Compat != bootstrap.CompatSGLang0094505 && s.opts.Compat != bootstrap.CompatSGLangNewest {
		return fmt.Errorf("bootstrap: unknown compat %q; want %q (default) or %q",
			s.opts.Compat, bootstrap.CompatSGLang0094505, bootstrap.CompatSGLangNewest)
	}
	if s.opts.Port < 0 || s.opts.Port > 65535 {
		return fmt.Errorf("bootstrap: port %d out of range 0–65535", s.opts.Port)
	}
	host := s.opts.Host
	if len(host) > 1 && host[0] == '[' && host[len(host)-1] == ']' {
		host = host[1 : len(host)-1]
	}
	ln, err := listen(host, s.opts.Port, s.opts.PortFlag)
	if err != nil {
		return err
	}
	s.addrMu.Lock()
	s.addr = ln.Addr().String()
	s.addrMu.Unlock()
	// Connections accepted but never used (a client transport's spare dial)
	// would hold graceful shutdown for 5 s: track them to close at shutdown.
	var newConns sync.Map // net.Conn → struct{}
	srv := &http.Server{
		ConnState: func(c net.Conn, st http.ConnState) {
			if st == http.StateNew {
				newConns.Store(c, struct{}{})
			} else {
				newConns.Delete(c)
			}
		},
		Handler:           s.e,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.log.Info("bootstrap server listening", "addr", s.addr, "compat", s.opts.Compat,
		"entry_ttl", s.opts.EntryTTL, "auth", s.opts.AuthToken != "")
	close(s.ready)

	sweepDone, liveDone := make(chan struct{}), make(chan struct{})
	sweepCtx, stopSweep := context.WithCancel(ctx)
	go func() { defer close(sweepDone); s.sweepRooms(sweepCtx) }()
	go func() { defer close(liveDone); s.watchLiveness(sweepCtx.Done()) }()

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	var result error
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), s.opts.ShutdownTimeout)
		shut := make(chan error, 1)
		go func() { shut <- srv.Shutdown(sctx) }()
		tick := time.NewTicker(20 * time.Millisecond)
	wait:
		for {
			select {
			case err := <-shut:
				if err != nil {
					result = fmt.Errorf("bootstrap: graceful shutdown: %w (requests still running after %s)", err, s.opts.ShutdownTimeout)
					_ = srv.Close()
				}
				break wait
			case <-tick.C:
				newConns.Range(func(k, _ any) bool {
					_ = k.(net.Conn).Close() // no request read on it yet
					newConns.Delete(k)
					return true
				})
			}
		}
		tick.Stop()
		cancel()
		<-serveErr
	case err := <-serveErr:
		if !errors.Is(err, http.ErrServerClosed) {
			result = fmt.Errorf("bootstrap: serve on %s: %w", s.addr, err)
		}
	}
	stopSweep()
	<-sweepDone
	<-liveDone
	return result
}

// hostHint says which listen hosts work.
const hostHint = "pass 127.0.0.1 (this machine only), 0.0.0.0 or :: (every interface), " +
	"or an address of one of this machine's interfaces (see `ip -brief addr`)"

// listen opens the TCP listener on host:port. Its errors say what went
// wrong: a host that is neither an IP address nor a hostname, a host that
// does not resolve or is not an address of this machine (with the hosts
// that work), a port in use (another server?), or a privileged port; the
// last two name portFlag, how the operator picks another ("": none).
func listen(host string, port int, portFlag string) (net.Listener, error) {
	pick := "pick another port"
	if portFlag != "" {
		pick = "pick another with " + portFlag
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	if host != "" {
		if _, err := netip.ParseAddr(host); err != nil && !bootstrap.IsHostname(host) {
			// Checked before resolving: "999.1.1.1" would otherwise go to DNS.
			return nil, fmt.Errorf("bootstrap: listen on %s: host %q is neither an IP address (IPv4 as a dotted quad 0-255 without leading zeros, or IPv6) nor a hostname; %s",
				addr, short(host), hostHint)
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err == nil {
		return ln, nil
	}
	var dnsErr *net.DNSError
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (is another bootstrap server using this port? %s, or 0 for a free one)", addr, err, pick)
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (host %q is not an address of this machine; %s)", addr, err, host, hostHint)
	case errors.As(err, &dnsErr):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (host %q does not resolve to an address of this machine; %s)", addr, err, host, hostHint)
	case errors.Is(err, syscall.EACCES):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (ports below 1024 need privileges; %s ≥ 1024)", addr, err, pick)
	}
	return nil, fmt.Errorf("bootstrap: listen on %s: %w", addr, err)
}

// short truncates s to 40 bytes for an error message.
func short(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// Addr returns the bound "host:port" (a kernel-chosen port when Options.Port
// was 0); valid once Ready is closed, "" before.
func (s *Server) Addr() string {
	s.addrMu.Lock()
	defer s.addrMu.Unlock()
	return s.addr
}

// Ready returns a channel that is closed once the server listens.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// authorized checks the bearer token when one is configured (constant time;
// scheme name case-insensitive, as SGLang's bootstrap_auth.py).
func (s *Server) authorized(c echo.Context) bool {
	if s.opts.AuthToken == "" {
		return true
	}
	h := c.Request().Header.Get("Authorization")
	scheme, tok, ok := strings.Cut(strings.TrimSpace(h), " ")
	if ok && strings.EqualFold(scheme, "bearer") &&
		subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(s.opts.AuthToken)) == 1 {
		return true
	}
	s.m.unauth.Inc()
	return false
}

func text(c echo.Context, code int, msg string) error { return c.Blob(code, ctText, []byte(msg)) }

// badRequest answers err as plain text: 413 for an oversized body, else 400.
func badRequest(c echo.Context, err error) error {
	var tl *bodyTooLargeError
	if errors.As(err, &tl) {
		return text(c, http.StatusRequestEntityTooLarge, err.Error())
	}
	return text(c, http.StatusBadRequest, err.Error())
}

// maxDrainBytes bounds how much of an oversized body the server reads and
// discards (never stores) before answering 413, so that a client still
// sending gets the answer rather than a connection reset. Past the bound
// (or when Content-Length already says so) the answer is sent with
// "Connection: close" and the rest is not read; the server's ReadTimeout
// bounds slow senders.
const maxDrainBytes = 64 << 20

// bodyTooLargeError is a body over Options.MaxBodyBytes (answered 413).
type bodyTooLargeError struct{ limit int64 }

// Error names the limit and what to do.
func (e *bodyTooLargeError) Error() string {
	size := fmt.Sprintf("%d bytes", e.limit)
	if e.limit >= 1<<20 && e.limit%(1<<20) == 0 {
		size += fmt.Sprintf(" (%d MiB)", e.limit>>20)
	}
	return "body: larger than the limit of " + size +
		"; send less per request (e.g. fewer bootstrap_rooms per /query_dp_ranks call)"
}

// readBody reads the request body up to MaxBodyBytes into memory. A larger
// body (by Content-Length or by what arrives) gives a *bodyTooLargeError;
// its remainder is discarded up to maxDrainBytes first (not when the client
// waits for "100 Continue": it then never sends the body).
func (s *Server) readBody(c echo.Context) ([]byte, error) {
	req := c.Request()
	limit := s.opts.MaxBodyBytes
	tooLarge := &bodyTooLargeError{limit: limit}
	if req.ContentLength > limit {
		if strings.EqualFold(req.Header.Get("Expect"), "100-continue") || req.ContentLength > limit+maxDrainBytes {
			c.Response().Header().Set(echo.HeaderConnection, "close")
		} else {
			s.drainBody(c)
		}
		return nil, tooLarge
	}
	b, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		return nil, bootstrap.NewFieldError("body", "read failed: %v", err)
	}
	if int64(len(b)) > limit {
		s.drainBody(c)
		return nil, tooLarge
	}
	return b, nil
}

// drainBody discards up to maxDrainBytes of the rest of the request body;
// when more remains (or reading fails) the answer closes the connection.
func (s *Server) drainBody(c echo.Context) {
	n, err := io.CopyN(io.Discard, c.Request().Body, maxDrainBytes)
	if err != io.EOF {
		c.Response().Header().Set(echo.HeaderConnection, "close")
	}
	s.log.Warn("request body over the limit", "method", c.Request().Method, "path", c.Request().URL.Path,
		"remote", c.RealIP(), "limit", s.opts.MaxBodyBytes, "discarded", n)
}

func (s *Server) handleRoute(c echo.Context) error {
	switch c.Request().Method {
	case http.MethodGet:
		return s.handleGetRoute(c)
	case http.MethodPut:
		return s.handlePutRoute(c)
	case http.MethodDelete:
		return s.handleDeleteRoute(c)
	}
	// SGLang sends this text with content_type=application/json (spec §2.2).
	return c.Blob(http.StatusMethodNotAllowed, "application/json; charset=utf-8", []byte("Method not allowed"))
}

func (s *Server) handlePutRoute(c echo.Context) error {
	if !s.authorized(c) {
		return text(c, http.StatusUnauthorized, "Unauthorized")
	}
	body, err := s.readBody(c)
	if err == nil {
		var r bootstrap.RegisterRequest
		r, err = bootstrap.ParseRegisterRequest(body)
		if err == nil {
			return s.register(c, r)
		}
	}
	s.m.regBad.Inc()
	s.log.Warn("rejected registration", "remote", c.RealIP(), "err", err)
	return badRequest(c, err)
}

func (s *Server) notReady(c echo.Context) error {
	s.m.notReady.Inc()
	return text(c, http.StatusServiceUnavailable,
		fmt.Sprintf("Prefill server not fully registered yet (%d workers registered).", len(s.table)))
}

func (s *Server) handleGetRoute(c echo.Context) error {
	coord, all, err := bootstrap.ParseRankQueryString(c.Request().URL.RawQuery)
	if err != nil {
		s.m.lookBad.Inc()
		var fe *bootstrap.FieldError
		if errors.As(err, &fe) && fe.Missing {
			// SGLang's text first (clients may match it), then what is
			// missing.
			return text(c, http.StatusBadRequest, fmt.Sprintf("Missing inputs for bootstrap server. Missing: %s (GET /route takes all of %s; all four -1 asks for the topology).",
				fe.Field, strings.Join(bootstrap.RankQueryParams[:], ", ")))
		}
		return badRequest(c, err)
	}
	s.mu.RLock()
	if !s.readyLocked() {
		defer s.mu.RUnlock()
		return s.notReady(c)
	}
	if all {
		b := s.infoJSON
		s.mu.RUnlock()
		s.m.lookTopo.Inc()
		return c.Blob(http.StatusOK, ctJSON, b)
	}
	ent := s.table[coord]
	var b []byte
	if ent != nil {
		b = ent.json
	}
	s.mu.RUnlock()
	if b == nil {
		s.m.lookMiss.Inc()
		return text(c, http.StatusNotFound, "Bootstrap info not found for "+coord.String())
	}
	s.m.lookRank.Inc()
	return c.Blob(http.StatusOK, ctJSON, b)
}

func (s *Server) handleDeleteRoute(c echo.Context) error {
	if !s.authorized(c) {
		return text(c, http.StatusUnauthorized, "Unauthorized")
	}
	coord, all, err := bootstrap.ParseRankQueryString(c.Request().URL.RawQuery)
	if err == nil && all {
		err = bootstrap.NewFieldError("prefill_dp_rank", "DELETE /route needs one rank's coordinates, not the all -1 topology form")
	}
	want := c.QueryParam("instance_id")
	if err == nil && c.QueryParams().Has("instance_id") && !bootstrap.ValidInstanceID(want) {
		err = bootstrap.NewFieldError("instance_id", "%q: want 1–64 characters of letters, digits, '.', '_', ':' or '-'", short(want))
	}
	if err != nil {
		return badRequest(c, err)
	}
	s.mu.Lock()
	ent, ok := s.table[coord]
	if ok && want != "" && ent.info.InstanceID != want {
		// Conditional delete: the entry names another instance (the
		// caller's successor, or a rank without an id): leave it.
		cur := ent.info
		s.mu.Unlock()
		s.m.delRefused.Inc()
		holder := "a rank without an instance id"
		if cur.InstanceID != "" {
			holder = fmt.Sprintf("instance %s (epoch %d)", cur.InstanceID, cur.Epoch)
		}
		s.log.Info("conditional deregistration left the entry in place", "rank", coord.String(), "caller", want, "entry", cur.InstanceID, "endpoint", cur.Endpoint())
		return text(c, http.StatusPreconditionFailed, fmt.Sprintf("%s: rank %s is now registered by %s at %s, not by instance %s; entry left in place",
			bootstrap.ErrReplaced, coord, holder, cur.Endpoint(), want))
	}
	if ok {
		delete(s.table, coord)
		if len(s.table) == 0 {
			s.topo = nil // the whole instance left: accept a new topology
		}
		s.rebuildInfoLocked()
	}
	n := len(s.table)
	s.mu.Unlock()
	if !ok {
		return text(c, http.StatusNotFound, "Bootstrap info not found for "+coord.String())
	}
	s.m.deregs.Inc()
	s.log.Info("rank deregistered", "rank", coord.String(), "registered", n)
	return text(c, http.StatusOK, "OK")
}

// handleEntry serves GET /v1/entry?<the four rank coordinates> (a kvxfer
// extension): the entry at those coordinates as a TableRank, whether or not
// the directory is ready, or 404 with HeaderEntry "absent". Ranks poll it to
// notice a directory that lost them (restart) or names another instance;
// with &instance_id=ID naming the entry's instance the poll is also the
// rank's check-in (its heartbeat: the entry is not stale for another
// StaleAfter), which needs the bearer token when the server has one.
func (s *Server) handleEntry(c echo.Context) error {
	coord, all, err := bootstrap.ParseRankQueryString(c.Request().URL.RawQuery)
	if err == nil && all {
		err = bootstrap.NewFieldError("prefill_dp_rank", "GET /v1/entry needs one rank's coordinates, not the all -1 topology form")
	}
	id := c.QueryParam("instance_id")
	checkIn := c.QueryParams().Has("instance_id")
	if err == nil && checkIn && !bootstrap.ValidInstanceID(id) {
		err = bootstrap.NewFieldError("instance_id", "%q: want 1–64 characters of letters, digits, '.', '_', ':' or '-'", short(id))
	}
	if err != nil {
		return badRequest(c, err)
	}
	if checkIn && !s.authorized(c) {
		return text(c, http.StatusUnauthorized, "Unauthorized")
	}
	now := time.Now()
	s.mu.RLock()
	ent := s.table[coord]
	var tr bootstrap.TableRank
	if ent != nil {
		if checkIn && ent.info.InstanceID == id {
			ent.lastSeen.Store(now.UnixNano())
			if ent.staleLogged.Swap(false) {
				s.log.Info("stale prefill rank checks in again", "rank", coord.String(), "endpoint", ent.info.Endpoint(), "instance", id)
			}
		}
		tr = tableRank(coord, ent, now)
	}
	s.mu.RUnlock()
	if ent == nil {
		c.Response().Header().Set(bootstrap.HeaderEntry, "absent")
		return text(c, http.StatusNotFound, "Bootstrap info not found for "+coord.String())
	}
	return c.JSON(http.StatusOK, tr)
}

func (s *Server) handleTable(c echo.Context) error {
	return c.JSON(http.StatusOK, s.Snapshot())
}
