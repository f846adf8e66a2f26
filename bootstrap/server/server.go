// Package server is kvxfer's bootstrap directory server: an SGLang-compatible
// HTTP server (echo) that the prefill ranks of one instance register with and
// decode ranks resolve against, with Prometheus metrics. Its wire types,
// parsers and client are in package bootstrap; ranks import only that.
//
// Routes (spec §2.2, /work/shared/spec/sglang-bootstrap.md): PUT/GET /route,
// POST /register_dp_rank, POST /query_dp_ranks, GET /health — SGLang's shapes
// and codes (from common/conn.py at commit 0094505d) — plus kvxfer's
// extensions DELETE /route, GET /v1/table and GET /metrics.
package server

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Content types as SGLang's aiohttp server sends them.
const (
	ctText = "text/plain; charset=utf-8"
	ctJSON = "application/json; charset=utf-8"
)

// Options configure a Server. The zero value serves on all interfaces at a
// kernel-chosen port with the pinned SGLang key set, a 120 s room TTL and no
// authentication; `kvxfer bootstrap` defaults the port to DefaultPort.
type Options struct {
	// Host is the listen host (IP or hostname; "" = all interfaces).
	Host string
	// Port is the listen port, 0–65535; 0 lets the kernel pick one
	// (Server.Addr reports it). SGLang's default is DefaultPort.
	Port int
	// EntryTTL is the room→dp-rank entry lifetime; 0 means DefaultEntryTTL.
	EntryTTL time.Duration
	// AuthToken, when non-empty, requires "Authorization: Bearer <token>" on
	// the mutating routes (PUT/DELETE /route, POST /register_dp_rank); a
	// missing or wrong token gets 401 "Unauthorized". Compared in constant time.
	AuthToken string
	// Compat selects the PrefillServerInfo key set: CompatSGLang0094505 (the
	// default when empty) or CompatSGLangNewest.
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

// topology holds the first-writer-wins scalars of the table (spec §2.2).
type topology struct {
	tpSize, cpSize, dpSize, ppSize int
	pageSize                       int
	kvCacheDtype                   *string
	follow                         bool
	dsaSplit                       bool
	httpPort                       *int
	total                          int
}

type rankEntry struct {
	info         bootstrap.PrefillRankInfo
	json         []byte
	registeredAt time.Time
	updates      int
}

type roomEntry struct {
	dp int
	at time.Time
}

type metrics struct {
	reg           *prometheus.Registry
	regOK         prometheus.Counter
	regReplaced   prometheus.Counter
	regBad        prometheus.Counter
	regConflict   prometheus.Counter
	regSuperseded prometheus.Counter
	delRefused    prometheus.Counter
	unauth        prometheus.Counter
	deregs        prometheus.Counter
	lookTopo      prometheus.Counter
	lookRank      prometheus.Counter
	lookMiss      prometheus.Counter
	lookBad       prometheus.Counter
	notReady      prometheus.Counter
	dpRegs        prometheus.Counter
	dpQueries     prometheus.Counter
	dpRooms       prometheus.Counter
	dpDropped     prometheus.Counter
	tableSize     prometheus.Gauge
	expected      prometheus.Gauge
	roomsSize     prometheus.Gauge
}

func newMetrics() metrics {
	reg := prometheus.NewRegistry()
	registrations := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_registrations_total",
		Help: "PUT /route registrations by result (ok, replaced, bad_request, conflict, superseded: from an instance older than the entry's, refused).",
	}, []string{"result"})
	lookups := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_lookups_total",
		Help: "GET /route lookups by kind (topology, rank) and result (ok, not_found, bad_request).",
	}, []string{"kind", "result"})
	dp := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvxfer_bootstrap_dp_rank_requests_total",
		Help: "Room→dp-rank registry calls: register, query, rooms asked by queries, and rooms_dropped (entries whose dp_rank was out of range of the topology that became known).",
	}, []string{"op"})
	m := metrics{
		reg:           reg,
		regOK:         registrations.WithLabelValues("ok"),
		regReplaced:   registrations.WithLabelValues("replaced"),
		regBad:        registrations.WithLabelValues("bad_request"),
		regConflict:   registrations.WithLabelValues("conflict"),
		regSuperseded: registrations.WithLabelValues("superseded"),
		lookTopo:      lookups.WithLabelValues("topology", "ok"),
		lookRank:      lookups.WithLabelValues("rank", "ok"),
		lookMiss:      lookups.WithLabelValues("rank", "not_found"),
		lookBad:       lookups.WithLabelValues("any", "bad_request"),
		dpRegs:        dp.WithLabelValues("register"),
		dpQueries:     dp.WithLabelValues("query"),
		dpRooms:       dp.WithLabelValues("rooms_queried"),
		dpDropped:     dp.WithLabelValues("rooms_dropped"),
		unauth: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_unauthorized_total",
			Help: "Mutating requests refused with 401 (bearer token missing or wrong).",
		}),
		deregs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_deregistrations_total",
			Help: "DELETE /route calls that removed a rank.",
		}),
		delRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_deregistrations_refused_total",
			Help: "Conditional DELETE /route calls that left the entry in place: it names another instance (the caller was replaced).",
		}),
		notReady: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvxfer_bootstrap_not_ready_total",
			Help: "GET /route answers 503 because not every rank has registered.",
		}),
		tableSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_table_size",
			Help: "Distinct (dp, cp, tp, pp) ranks registered.",
		}),
		expected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_expected_ranks",
			Help: "dp·cp·tp·pp of the registered topology (0 before the first registration).",
		}),
		roomsSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvxfer_bootstrap_dp_rooms",
			Help: "Live entries in the room→dp-rank registry.",
		}),
	}
	reg.MustRegister(registrations, lookups, dp, m.unauth, m.deregs, m.delRefused, m.notReady, m.tableSize, m.expected, m.roomsSize,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// New builds a server from opts (see Options for the defaults). It does
// not listen yet; call Start. An unknown Compat value is reported by Start.
func New(opts Options) *Server {
	if opts.EntryTTL <= 0 {
		opts.EntryTTL = bootstrap.DefaultEntryTTL
	}
	if opts.Compat == "" {
		opts.Compat = bootstrap.CompatSGLang0094505
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
		m:     newMetrics(),
	}
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
	ln, err := listen(host, s.opts.Port)
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

	sweepDone := make(chan struct{})
	sweepCtx, stopSweep := context.WithCancel(ctx)
	go func() { defer close(sweepDone); s.sweepRooms(sweepCtx) }()

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
	return result
}

// hostHint says which listen hosts work.
const hostHint = "pass 127.0.0.1 (this machine only), 0.0.0.0 or :: (every interface), " +
	"or an address of one of this machine's interfaces (see `ip -brief addr`)"

// listen opens the TCP listener on host:port. Its errors say what went
// wrong: a host that is neither an IP address nor a hostname, a host that
// does not resolve or is not an address of this machine (with the hosts
// that work), a port in use (another server?), or a privileged port.
func listen(host string, port int) (net.Listener, error) {
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
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (is another bootstrap server using this port? pick another with --port, or 0 for a free one)", addr, err)
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (host %q is not an address of this machine; %s)", addr, err, host, hostHint)
	case errors.As(err, &dnsErr):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (host %q does not resolve to an address of this machine; %s)", addr, err, host, hostHint)
	case errors.Is(err, syscall.EACCES):
		return nil, fmt.Errorf("bootstrap: listen on %s: %w (ports below 1024 need privileges; pick one ≥ 1024 with --port)", addr, err)
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

// Register adds or replaces one rank in the table directly (the handler's
// logic without HTTP). It returns an error wrapping ErrConflict when the
// rank's topology disagrees with the table's.
func (s *Server) Register(r bootstrap.RegisterRequest) error {
	_, err := s.apply(r)
	return err
}

func (s *Server) register(c echo.Context, r bootstrap.RegisterRequest) error {
	replaced, err := s.apply(r)
	if errors.Is(err, bootstrap.ErrReplaced) {
		s.m.regSuperseded.Inc()
		s.log.Warn("registration from a replaced instance refused", "remote", c.RealIP(), "err", err)
		return text(c, http.StatusPreconditionFailed, err.Error())
	}
	if err != nil {
		s.m.regConflict.Inc()
		s.log.Warn("registration conflicts with topology", "remote", c.RealIP(), "err", err)
		return text(c, http.StatusConflict, err.Error())
	}
	if replaced {
		s.m.regReplaced.Inc()
	} else {
		s.m.regOK.Inc()
	}
	return text(c, http.StatusOK, "OK")
}

// superseded reports whether a registration `nu` must be refused because
// the entry `cur` names another instance with a higher epoch (its
// successor). Registrations without an instance id (SGLang's) replace
// unconditionally, as in SGLang.
func superseded(cur, nu bootstrap.PrefillRankInfo) bool {
	return cur.InstanceID != "" && nu.InstanceID != "" && cur.InstanceID != nu.InstanceID && cur.Epoch > nu.Epoch
}

func newTopology(r bootstrap.RegisterRequest) *topology {
	t := &topology{
		tpSize: r.AttnTPSize, cpSize: r.AttnCPSize, dpSize: r.DPSize(), ppSize: r.PPSize,
		pageSize: r.PageSize, kvCacheDtype: r.KVCacheDtype, follow: r.FollowBootstrapRoom(),
		dsaSplit: r.EnableDSACacheLayerSplit, httpPort: r.PrefillHTTPPort,
	}
	t.total = t.tpSize * t.cpSize * t.dpSize * t.ppSize
	return t
}

func strOrNull(p *string) string {
	if p == nil {
		return "null"
	}
	return strconv.Quote(*p)
}

// conflict names the first topology field on which a and b differ.
func (a *topology) conflict(b *topology) string {
	type f struct {
		name   string
		av, bv string
	}
	for _, x := range []f{
		{"dp_size (attn_dp_size or system_dp_size)", strconv.Itoa(a.dpSize), strconv.Itoa(b.dpSize)},
		{"attn_cp_size", strconv.Itoa(a.cpSize), strconv.Itoa(b.cpSize)},
		{"attn_tp_size", strconv.Itoa(a.tpSize), strconv.Itoa(b.tpSize)},
		{"pp_size", strconv.Itoa(a.ppSize), strconv.Itoa(b.ppSize)},
		{"page_size", strconv.Itoa(a.pageSize), strconv.Itoa(b.pageSize)},
		{"kv_cache_dtype", strOrNull(a.kvCacheDtype), strOrNull(b.kvCacheDtype)},
		{"load_balance_method (follow_bootstrap_room)", strconv.FormatBool(a.follow), strconv.FormatBool(b.follow)},
		{"enable_dsa_cache_layer_split", strconv.FormatBool(a.dsaSplit), strconv.FormatBool(b.dsaSplit)},
	} {
		if x.av != x.bv {
			return fmt.Sprintf("%s: registration says %s, table says %s", x.name, x.bv, x.av)
		}
	}
	return ""
}

// apply validates r against the table and stores it. A re-registration of
// the same coordinates replaces the endpoint (a restarted rank with a new
// port) and does not change the count. A rank that is alone in the table may
// change the topology (the whole instance restarted with a new config).
func (s *Server) apply(r bootstrap.RegisterRequest) (replaced bool, err error) {
	nt := newTopology(r)
	coord := bootstrap.Coord{DP: r.DPRank(), CP: r.AttnCPRank, TP: r.AttnTPRank, PP: r.PPRank}
	info := bootstrap.PrefillRankInfo{RankIP: r.RankIP, RankPort: r.RankPort, InstanceID: r.InstanceID, Epoch: r.Epoch}
	js, err := json.Marshal(info)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old, exists := s.table[coord]
	if exists && superseded(old.info, info) {
		return false, fmt.Errorf("%w: rank %s is registered by instance %s (epoch %d) at %s, newer than this instance %s (epoch %d): this rank was replaced; stop it rather than take the coordinates back",
			bootstrap.ErrReplaced, coord, old.info.InstanceID, old.info.Epoch, old.info.Endpoint(), info.InstanceID, info.Epoch)
	}
	if s.topo != nil {
		if msg := s.topo.conflict(nt); msg != "" {
			if !(exists && len(s.table) == 1) {
				return false, fmt.Errorf("%w: rank %s: %s (%d ranks registered with the table's topology; deregister them with DELETE /route or restart the bootstrap server)",
					bootstrap.ErrConflict, coord, msg, len(s.table))
			}
		} else if s.topo.httpPort != nil {
			nt.httpPort = s.topo.httpPort // first writer wins, as SGLang
		}
	}
	if exists {
		old.info, old.json, old.registeredAt = info, js, time.Now()
		old.updates++
		s.log.Info("rank re-registered", "rank", coord.String(), "endpoint", info.Endpoint())
	} else {
		s.table[coord] = &rankEntry{info: info, json: js, registeredAt: time.Now()}
		s.log.Info("rank registered", "rank", coord.String(), "endpoint", info.Endpoint(),
			"registered", len(s.table), "expected", nt.total)
	}
	if s.topo == nil || s.topo.dpSize != nt.dpSize {
		s.dropRoomsOutOfRangeLocked(nt.dpSize)
	}
	s.topo = nt
	s.rebuildInfoLocked()
	return exists, nil
}

// dropRoomsOutOfRangeLocked deletes the room→dp-rank entries whose dp_rank
// is not below dpSize: they were registered before the topology was known
// (accepted, as SGLang does) or under an earlier one, and name a DP rank
// that does not exist. Each drop is counted in
// kvxfer_bootstrap_dp_rank_requests_total{op="rooms_dropped"} and the total
// logged. The caller holds s.mu (write); s.roomMu is taken here (lock order
// s.mu, then s.roomMu).
func (s *Server) dropRoomsOutOfRangeLocked(dpSize int) {
	s.roomMu.Lock()
	dropped := 0
	for r, e := range s.rooms {
		if e.dp >= dpSize {
			delete(s.rooms, r)
			dropped++
		}
	}
	n := len(s.rooms)
	s.roomMu.Unlock()
	if dropped > 0 {
		s.m.dpDropped.Add(float64(dropped))
		s.m.roomsSize.Set(float64(n))
		s.log.Warn("dropped room→dp-rank entries with a dp_rank outside the registered topology",
			"dropped", dropped, "dp_size", dpSize, "remaining", n)
	}
}

// rebuildInfoLocked re-encodes the topology answer and updates the gauges.
func (s *Server) rebuildInfoLocked() {
	s.m.tableSize.Set(float64(len(s.table)))
	if s.topo == nil {
		s.infoJSON = nil
		s.m.expected.Set(0)
		return
	}
	s.m.expected.Set(float64(s.topo.total))
	info := s.topo.serverInfo(s.opts.Compat)
	b, err := json.Marshal(info)
	if err != nil { // cannot happen: plain types only
		s.log.Error("encode bootstrap.PrefillServerInfo", "err", err)
	}
	s.infoJSON = b
}

func (t *topology) serverInfo(compat string) bootstrap.PrefillServerInfo {
	ps := t.pageSize
	info := bootstrap.PrefillServerInfo{
		AttnTPSize: t.tpSize, AttnCPSize: t.cpSize, DPSize: t.dpSize, PPSize: t.ppSize,
		PageSize: &ps, KVCacheDtype: t.kvCacheDtype, FollowBootstrapRoom: t.follow,
		EnableDSACacheLayerSplit: t.dsaSplit, PrefillHTTPPort: t.httpPort,
	}
	if compat == bootstrap.CompatSGLangNewest {
		early := "early"
		info.DecodeAllocationPolicy = &early
	}
	return info
}

// readyLocked reports whether every distinct rank has registered.
func (s *Server) readyLocked() bool { return s.topo != nil && len(s.table) == s.topo.total }

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
			return text(c, http.StatusBadRequest, "Missing inputs for bootstrap server.")
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

// handleRegisterDPRank serves POST /register_dp_rank: it records room →
// prefill DP rank. With a topology registered, a dp_rank ≥ dp_size is a 400.
// Before any rank has registered the entry is accepted, as SGLang accepts
// it (spec §2.2), but kept only while it fits: when the topology becomes
// known (or its dp_size changes) entries with dp_rank ≥ dp_size are dropped
// and counted (op="rooms_dropped"), and /query_dp_ranks never answers one.
func (s *Server) handleRegisterDPRank(c echo.Context) error {
	if !s.authorized(c) {
		return text(c, http.StatusUnauthorized, "Unauthorized")
	}
	body, err := s.readBody(c)
	if err != nil {
		return badRequest(c, err)
	}
	room, dp, err := bootstrap.ParseRegisterDPRank(body)
	if err != nil {
		return badRequest(c, err)
	}
	// The check and the insert happen under s.mu (read) so that a topology
	// registered meanwhile cannot miss this entry when it drops out-of-range
	// ones (apply holds s.mu for writing while it drops).
	s.mu.RLock()
	dpSize := 0
	if s.topo != nil {
		dpSize = s.topo.dpSize
	}
	if dpSize > 0 && dp >= dpSize {
		s.mu.RUnlock()
		return badRequest(c, bootstrap.NewFieldError("dp_rank", "%d must be < the registered dp_size %d", dp, dpSize))
	}
	s.roomMu.Lock()
	if _, ok := s.rooms[room]; !ok && len(s.rooms) >= s.opts.MaxRooms {
		n := len(s.rooms)
		s.roomMu.Unlock()
		s.mu.RUnlock()
		return text(c, http.StatusTooManyRequests, fmt.Sprintf(
			"room→dp-rank registry full (%d live entries, limit %d); entries expire after %s — retry later, or raise the limit / lower the TTL",
			n, s.opts.MaxRooms, s.opts.EntryTTL))
	}
	s.rooms[room] = roomEntry{dp: dp, at: time.Now()}
	n := len(s.rooms)
	s.roomMu.Unlock()
	s.mu.RUnlock()
	s.m.roomsSize.Set(float64(n))
	s.m.dpRegs.Inc()
	return text(c, http.StatusOK, "OK")
}

// handleQueryDPRanks serves POST /query_dp_ranks: a JSON object mapping
// each known, unexpired room (decimal string) to its DP rank; unknown rooms
// are omitted, as in SGLang. A dp_rank not below the registered dp_size is
// never answered.
func (s *Server) handleQueryDPRanks(c echo.Context) error {
	body, err := s.readBody(c)
	if err != nil {
		return badRequest(c, err)
	}
	rooms, err := bootstrap.ParseQueryDPRanks(body)
	if err != nil {
		return badRequest(c, err)
	}
	s.m.dpQueries.Inc()
	s.m.dpRooms.Add(float64(len(rooms)))
	out := make([]byte, 0, 16+len(rooms)*28)
	out = append(out, '{')
	seen := make(map[uint64]struct{}, len(rooms))
	cutoff := time.Now().Add(-s.opts.EntryTTL)
	// Belt and braces: never answer a dp_rank the topology does not have
	// (entries out of range are dropped when the topology becomes known).
	dpSize := math.MaxInt
	s.mu.RLock()
	if s.topo != nil {
		dpSize = s.topo.dpSize
	}
	s.mu.RUnlock()
	s.roomMu.Lock()
	for _, r := range rooms {
		e, ok := s.rooms[r]
		if !ok || e.at.Before(cutoff) || e.dp >= dpSize {
			continue
		}
		if _, dup := seen[r]; dup {
			continue
		}
		seen[r] = struct{}{}
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, '"')
		out = strconv.AppendUint(out, r, 10)
		out = append(out, '"', ':')
		out = strconv.AppendInt(out, int64(e.dp), 10)
	}
	s.roomMu.Unlock()
	out = append(out, '}')
	return c.Blob(http.StatusOK, ctJSON, out)
}

// sweepRooms deletes expired room entries every EntryTTL/2 until ctx ends.
func (s *Server) sweepRooms(ctx context.Context) {
	every := s.opts.EntryTTL / 2
	if every < 10*time.Millisecond {
		every = 10 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.expireRooms(now)
		}
	}
}

func (s *Server) expireRooms(now time.Time) {
	cutoff := now.Add(-s.opts.EntryTTL)
	s.roomMu.Lock()
	for r, e := range s.rooms {
		if e.at.Before(cutoff) {
			delete(s.rooms, r)
		}
	}
	n := len(s.rooms)
	s.roomMu.Unlock()
	s.m.roomsSize.Set(float64(n))
}

// Snapshot returns the current directory (what GET /v1/table serves).
func (s *Server) Snapshot() bootstrap.TableSnapshot {
	s.mu.RLock()
	snap := bootstrap.TableSnapshot{
		Compat: s.opts.Compat, Ready: s.readyLocked(), Registered: len(s.table),
		EntryTTLSeconds: s.opts.EntryTTL.Seconds(), DistInitAddr: s.opts.DistInitAddr,
		Ranks: make([]bootstrap.TableRank, 0, len(s.table)), Missing: []bootstrap.Coord{},
	}
	for c, e := range s.table {
		snap.Ranks = append(snap.Ranks, bootstrap.TableRank{Coord: c, PrefillRankInfo: e.info, RegisteredAt: e.registeredAt, Reregistrations: e.updates})
	}
	if s.topo != nil {
		snap.Expected = s.topo.total
		info := s.topo.serverInfo(s.opts.Compat)
		snap.Topology = &info
		t := s.topo
	outer:
		for dp := 0; dp < t.dpSize; dp++ {
			for cp := 0; cp < t.cpSize; cp++ {
				for tp := 0; tp < t.tpSize; tp++ {
					for pp := 0; pp < t.ppSize; pp++ {
						c := bootstrap.Coord{DP: dp, CP: cp, TP: tp, PP: pp}
						if _, ok := s.table[c]; !ok {
							snap.Missing = append(snap.Missing, c)
							if len(snap.Missing) >= 1024 {
								break outer
							}
						}
					}
				}
			}
		}
	}
	s.mu.RUnlock()
	s.roomMu.Lock()
	snap.DPRooms = len(s.rooms)
	s.roomMu.Unlock()
	slices.SortFunc(snap.Ranks, func(a, b bootstrap.TableRank) int {
		for _, d := range [4]int{a.DP - b.DP, a.CP - b.CP, a.TP - b.TP, a.PP - b.PP} {
			if d != 0 {
				return d
			}
		}
		return 0
	})
	return snap
}

// handleEntry serves GET /v1/entry?<the four rank coordinates> (a kvxfer
// extension): the entry at those coordinates as a TableRank, whether or not
// the directory is ready, or 404 with HeaderEntry "absent". Ranks poll it to
// notice a directory that lost them (restart) or names another instance.
func (s *Server) handleEntry(c echo.Context) error {
	coord, all, err := bootstrap.ParseRankQueryString(c.Request().URL.RawQuery)
	if err == nil && all {
		err = bootstrap.NewFieldError("prefill_dp_rank", "GET /v1/entry needs one rank's coordinates, not the all -1 topology form")
	}
	if err != nil {
		return badRequest(c, err)
	}
	s.mu.RLock()
	ent := s.table[coord]
	var tr bootstrap.TableRank
	if ent != nil {
		tr = bootstrap.TableRank{Coord: coord, PrefillRankInfo: ent.info, RegisteredAt: ent.registeredAt, Reregistrations: ent.updates}
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
