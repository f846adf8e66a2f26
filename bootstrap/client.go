package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Connection bounds of a Client's private transport (per directory).
const (
	maxIdleConns = 4
	maxConns     = 16
)

// TokenEnvHint names where a rank takes the directory's bearer token from;
// a 401 answer's error repeats it.
const TokenEnvHint = "--bootstrap-auth-token or the environment variable KVXFER_BOOTSTRAP_AUTH_TOKEN (or SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN)"

// HeaderDistInitAddr is the response header in which a server started with
// Options.DistInitAddr reports it (a kvxfer extension; SGLang sends none).
const HeaderDistInitAddr = "X-Kvxfer-Dist-Init-Addr"

// Client talks to one bootstrap server (SGLang's or kvxfer's). It is safe for
// concurrent use. Every call honours its context; each HTTP request is also
// bounded by the request timeout (5 s by default, SGLang's).
type Client struct {
	addr            string // host:port, IPv6 bracketed
	base            string // http://host:port
	hc              *http.Client
	token           string
	requestTimeout  time.Duration
	registerTimeout time.Duration
	backoffInitial  time.Duration
	backoffMax      time.Duration
	onRetry         func(attempt int, err error, next time.Duration)
}

// ClientOption configures a Client.
type ClientOption func(*Client)

// WithHTTPClient uses hc instead of a private client with keep-alive.
func WithHTTPClient(hc *http.Client) ClientOption { return func(c *Client) { c.hc = hc } }

// WithAuthToken sends "Authorization: Bearer <token>" on the mutating calls
// (Register, Deregister, RegisterDPRank), as SGLang's newest server requires.
func WithAuthToken(token string) ClientOption { return func(c *Client) { c.token = token } }

// WithRequestTimeout bounds each HTTP request (default 5 s, SGLang's timeout).
func WithRequestTimeout(d time.Duration) ClientOption {
	return func(c *Client) { c.requestTimeout = d }
}

// WithRegisterTimeout bounds Register's whole retry loop (default 30 s); at
// the end Register returns an error wrapping ErrRegisterDeadline.
func WithRegisterTimeout(d time.Duration) ClientOption {
	return func(c *Client) { c.registerTimeout = d }
}

// WithBackoff sets Register's retry delays: the delay before retry a is
// min(initial·2^a, max) times a jitter factor in [0.75, 1) — SGLang's shape
// (spec §3), defaults 250 ms and 5 s.
func WithBackoff(initial, max time.Duration) ClientOption {
	return func(c *Client) { c.backoffInitial, c.backoffMax = initial, max }
}

// WithRetryNotify calls f after each failed Register attempt that will be
// retried, with the attempt number (0-based), its error and the delay
// before the next attempt, so a caller can log that registration is failing
// instead of staying silent until the register timeout. f must not block.
func WithRetryNotify(f func(attempt int, err error, next time.Duration)) ClientOption {
	return func(c *Client) { c.onRetry = f }
}

// NewClient returns a client for the bootstrap server at addr: "host:port"
// with an IPv6 host bracketed ("[::1]:8998"); an "http://" prefix is
// accepted. It fails at once, naming the address and the accepted form, on
// an unparsable address, a missing port or one outside 1–65535, and on an
// unbracketed IPv6 address: "::1:8998" is ambiguous (is 8998 the port or the
// last group?), so it is refused with the bracketed form to use instead.
func NewClient(addr string, opts ...ClientOption) (*Client, error) {
	hp, err := normalizeAddr(addr)
	if err != nil {
		return nil, err
	}
	c := &Client{
		addr:            hp,
		base:            "http://" + hp,
		requestTimeout:  5 * time.Second,
		registerTimeout: 30 * time.Second,
		backoffInitial:  250 * time.Millisecond,
		backoffMax:      5 * time.Second,
	}
	for _, o := range opts {
		o(c)
	}
	if c.hc == nil {
		c.hc = &http.Client{Transport: &http.Transport{
			Proxy:       nil,
			DialContext: (&net.Dialer{Timeout: c.requestTimeout, KeepAlive: 30 * time.Second}).DialContext,
			// One directory, a few requests in flight at most once identical
			// lookups are coalesced: bound the connections (a cold burst of
			// rooms used to leave ~130 idle ones, issue 13). Requests beyond
			// MaxConnsPerHost wait for a free connection within their timeout.
			MaxIdleConnsPerHost: maxIdleConns,
			MaxConnsPerHost:     maxConns,
			IdleConnTimeout:     90 * time.Second,
		}}
	}
	return c, nil
}

// normalizeAddr turns the accepted address forms into a bracketed host:port.
func normalizeAddr(addr string) (string, error) {
	a := strings.TrimPrefix(strings.TrimPrefix(addr, "http://"), "https://")
	a = strings.TrimSuffix(a, "/")
	if strings.Count(a, ":") > 1 && !strings.HasPrefix(a, "[") {
		// An unbracketed IPv6 address, with or without a port: never guess.
		i := strings.LastIndexByte(a, ':')
		head, tail := a[:i], a[i+1:]
		p, perr := strconv.Atoi(tail)
		whole, werr := netip.ParseAddr(a)
		if ip, err := netip.ParseAddr(head); err == nil && perr == nil && p >= 1 && p <= 65535 {
			alt := ""
			if werr == nil {
				alt = fmt.Sprintf(", or [%s]:PORT if %s is the whole address", a, a)
			}
			return "", fmt.Errorf("bootstrap: address %q: an IPv6 address must be bracketed: write [%s]:%s%s", addr, ip, tail, alt)
		}
		if werr == nil {
			return "", fmt.Errorf("bootstrap: address %q has no port; want [%s]:PORT, e.g. [%s]:%d", addr, whole, whole, DefaultPort)
		}
		return "", fmt.Errorf("bootstrap: address %q: want host:port with an IPv6 host bracketed, e.g. [::1]:%d", addr, DefaultPort)
	}
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) && ae.Err == "missing port in address" {
			return "", fmt.Errorf("bootstrap: address %q has no port; want host:port, e.g. %s", addr, JoinHostPort(a, DefaultPort))
		}
		return "", fmt.Errorf("bootstrap: address %q: want host:port (IPv6 as [addr]:port): %v", addr, err)
	}
	if host == "" {
		return "", fmt.Errorf("bootstrap: address %q has no host", addr)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return "", fmt.Errorf("bootstrap: address %q: port %q is not in 1–65535", addr, port)
	}
	return JoinHostPort(host, p), nil
}

// Addr returns the server address as "host:port" (IPv6 bracketed).
func (c *Client) Addr() string { return c.addr }

// StatusError is a non-2xx answer from the server. It matches ErrNotReady
// (503), ErrNotFound (404), ErrUnauthorized (401), ErrConflict (409),
// ErrReplaced (412) and ErrBadRequest (400) with errors.Is.
type StatusError struct {
	// Op is the request, e.g. "GET /route".
	Op string
	// Addr is the server's host:port.
	Addr string
	// Code is the HTTP status code.
	Code int
	// Body is the server's message on one line (white space collapsed,
	// cut to 200 bytes: bodyExcerpt).
	Body string
	// Hint says what to do, when the code alone says it (401: the token).
	Hint string
}

// bodyExcerpt is an error answer's body as one line for an error message:
// every run of white space (an HTML page's newlines included) is one space,
// and more than 200 bytes are cut at a character boundary and marked "…".
func bodyExcerpt(data []byte) string {
	msg := strings.Join(strings.Fields(string(data)), " ")
	if len(msg) <= 200 {
		return msg
	}
	cut := 200
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + "…"
}

// Error formats the op, address, code, the server's message and the hint.
func (e *StatusError) Error() string {
	method, path, _ := strings.Cut(e.Op, " ")
	msg := fmt.Sprintf("bootstrap: %s http://%s%s: HTTP %d: %s", method, e.Addr, path, e.Code, e.Body)
	if e.Hint != "" {
		msg += " (" + e.Hint + ")"
	}
	return msg
}

// Is maps the status code to the package sentinels.
func (e *StatusError) Is(target error) bool {
	switch target {
	case ErrNotReady:
		return e.Code == http.StatusServiceUnavailable
	case ErrNotFound:
		return e.Code == http.StatusNotFound
	case ErrUnauthorized:
		return e.Code == http.StatusUnauthorized
	case ErrConflict:
		return e.Code == http.StatusConflict
	case ErrBadRequest:
		return e.Code == http.StatusBadRequest
	case ErrReplaced:
		return e.Code == http.StatusPreconditionFailed
	}
	return false
}

// do sends one request and returns the 2xx body or an error naming the op.
func (c *Client) do(ctx context.Context, method, path string, query url.Values, body any, auth bool) ([]byte, http.Header, error) {
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, c.requestTimeout)
	defer cancel()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, nil, fmt.Errorf("bootstrap: encode %s %s body: %w", method, path, err)
		}
		rd = bytes.NewReader(b)
	}
	u := c.base + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, nil, fmt.Errorf("bootstrap: %s %s: %w", method, u, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth && c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	start := time.Now()
	resp, err := c.hc.Do(req)
	if err != nil {
		var ne net.Error
		if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
			// Connected (or dialling) but no HTTP answer: often another
			// kind of port given as the bootstrap address.
			// Name the deadline that ended: the caller's (e.g. a
			// bootstrap timeout shorter than the request timeout) or
			// this request's own.
			within := fmt.Sprintf("no answer within the %s request timeout", c.requestTimeout)
			if parent.Err() != nil {
				within = fmt.Sprintf("no answer before the caller's deadline ended, %s after the request was sent", time.Since(start).Round(time.Millisecond))
			}
			return nil, nil, fmt.Errorf("bootstrap: %s %s%s: %w (%s: is this the prefill's bootstrap server's HTTP port, default %d, and not a rank's control or metrics port?)", method, c.base, path, err, within, DefaultPort)
		}
		return nil, nil, fmt.Errorf("bootstrap: %s %s%s: %w (is the prefill's bootstrap server running at this address?)", method, c.base, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil, fmt.Errorf("bootstrap: %s %s%s: read body: %w", method, c.base, path, err)
	}
	if resp.StatusCode/100 != 2 {
		msg := bodyExcerpt(data)
		se := &StatusError{Op: method + " " + path, Addr: c.addr, Code: resp.StatusCode, Body: msg}
		if resp.StatusCode == http.StatusServiceUnavailable && path == "/route" && method == http.MethodGet {
			se.Hint = "the directory does not hold every prefill rank of the topology yet: a prefill rank has not started, or has stopped; a decode's lookup retries until its bootstrap timeout"
		}
		if resp.StatusCode == http.StatusUnauthorized {
			if auth && c.token != "" {
				se.Hint = "the directory refused this rank's bearer token: give every rank the token the bootstrap server was started with, through " + TokenEnvHint
			} else {
				se.Hint = "the directory requires a token: set " + TokenEnvHint + " to the bootstrap server's token"
			}
		}
		return nil, resp.Header, se
	}
	return data, resp.Header, nil
}

// Register sends PUT /route for one prefill rank, retrying transport errors
// and 5xx answers (503 included) with capped, jittered exponential backoff
// until it succeeds, ctx ends or the register timeout passes; then it returns
// an error wrapping ErrRegisterDeadline that names the server, the number of
// attempts and the last failure. 400, 401 and 409 are not retried: the
// returned error wraps ErrBadRequest, ErrUnauthorized or ErrConflict.
func (c *Client) Register(ctx context.Context, r RegisterRequest) error {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, c.registerTimeout)
	defer cancel()
	var last error
	for attempt := 0; ; attempt++ {
		_, _, err := c.do(ctx, http.MethodPut, "/route", nil, r, true)
		if err == nil {
			return nil
		}
		if last == nil || ctx.Err() == nil {
			last = err // keep the last real failure, not the one the deadline cut short
		}
		var se *StatusError
		if errors.As(err, &se) && se.Code/100 == 4 && se.Code != http.StatusRequestTimeout && se.Code != http.StatusTooManyRequests {
			return fmt.Errorf("bootstrap: register rank %s at %s: %w", r.coordString(), c.addr, err)
		}
		d := backoff(c.backoffInitial, c.backoffMax, attempt)
		if c.onRetry != nil && ctx.Err() == nil {
			c.onRetry(attempt, err, d)
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: rank %s at %s: %d attempts over %s (%v); last error: %v",
				ErrRegisterDeadline, r.coordString(), c.addr, attempt+1, time.Since(start).Round(time.Millisecond), context.Cause(ctx), last)
		case <-t.C:
		}
	}
}

func (r RegisterRequest) coordString() string {
	return fmt.Sprintf("(dp=%d cp=%d tp=%d pp=%d)", r.DPRank(), r.AttnCPRank, r.AttnTPRank, r.PPRank)
}

// backoff returns min(initial·2^attempt, max) × U[0.75, 1).
func backoff(initial, max time.Duration, attempt int) time.Duration {
	d := initial
	for i := 0; i < attempt && d < max; i++ {
		d *= 2
	}
	if d > max {
		d = max
	}
	return time.Duration(float64(d) * (0.75 + 0.25*rand.Float64()))
}

func rankQuery(dp, cp, tp, pp int) url.Values {
	return url.Values{
		"prefill_dp_rank": {strconv.Itoa(dp)},
		"prefill_cp_rank": {strconv.Itoa(cp)},
		"target_tp_rank":  {strconv.Itoa(tp)},
		"target_pp_rank":  {strconv.Itoa(pp)},
	}
}

// Deregister removes the rank at `at` with DELETE /route (a kvxfer
// extension; SGLang servers answer 405). Call it on clean shutdown. With a
// non-empty instanceID the delete is conditional: the server removes the
// entry only while it still names that instance, so a replaced rank's exit
// never removes its successor (the error then wraps ErrReplaced and names
// the entry's instance). The error wraps ErrNotFound when no rank is
// registered there.
func (c *Client) Deregister(ctx context.Context, at Coord, instanceID string) error {
	q := rankQuery(at.DP, at.CP, at.TP, at.PP)
	if instanceID != "" {
		q.Set("instance_id", instanceID)
	}
	_, _, err := c.do(ctx, http.MethodDelete, "/route", q, nil, true)
	return err
}

// HeaderEntry is set on GET /v1/entry's 404 answers ("absent"), telling a
// kvxfer server's "no entry" from a server without the route.
const HeaderEntry = "X-Kvxfer-Entry"

// Entry fetches the directory's entry at `at` with GET /v1/entry (a kvxfer
// extension), whether or not the directory is ready (GET /route answers 503
// until every rank registered). It changes nothing; a rank checking that
// the directory still names it uses CheckIn. Errors wrap ErrNotFound (no
// entry there), or are an *UnsupportedError (the server has no such route:
// not a kvxfer directory), which matches ErrUnsupported and gives the
// *StatusError (the 404/405) to errors.As.
func (c *Client) Entry(ctx context.Context, at Coord) (*TableRank, error) {
	return c.entry(ctx, at, "")
}

// CheckIn is Entry by the rank registered at `at` with instanceID: when the
// entry names that instance, the directory counts it as the rank's heartbeat
// (the registration's heartbeat_ms promised one at least that often) and the
// rank is not reported stale. The bearer token is sent (WithAuthToken): a
// directory with a token refuses a check-in without it (401, wrapping
// ErrUnauthorized). An entry naming another instance is returned as is and
// kept unchanged. A directory without heartbeats (an older kvxfer one)
// answers as Entry does.
func (c *Client) CheckIn(ctx context.Context, at Coord, instanceID string) (*TableRank, error) {
	if !ValidInstanceID(instanceID) {
		return nil, fmt.Errorf("bootstrap: check-in for rank %s: instance id %q: want 1–64 characters of letters, digits, '.', '_', ':' or '-'", at, truncate(instanceID))
	}
	return c.entry(ctx, at, instanceID)
}

func (c *Client) entry(ctx context.Context, at Coord, instanceID string) (*TableRank, error) {
	q := rankQuery(at.DP, at.CP, at.TP, at.PP)
	if instanceID != "" {
		q.Set("instance_id", instanceID)
	}
	data, hdr, err := c.do(ctx, http.MethodGet, "/v1/entry", q, nil, instanceID != "")
	if err != nil {
		if routeMissing(err) && hdr.Get(HeaderEntry) == "" {
			return nil, unsupported(err)
		}
		return nil, err
	}
	var e TableRank
	if err := json.Unmarshal(data, &e); err != nil {
		return nil, fmt.Errorf("bootstrap: GET %s/v1/entry %s: decode: %w", c.addr, at, err)
	}
	return &e, nil
}

// ServerInfo fetches the prefill topology (GET /route with all four
// parameters −1), decoded by ParsePrefillServerInfo (either key set; unknown
// keys ignored; a malformed answer gives its *FieldError, wrapped with
// ErrNotDirectory). The error wraps
// ErrNotReady on 503 (not every rank has registered yet; retry later); on
// 404/405 (the server has no GET /route: not a bootstrap directory) it is an
// *UnsupportedError (ErrUnsupported, and the *StatusError for errors.As).
func (c *Client) ServerInfo(ctx context.Context) (*PrefillServerInfo, error) {
	data, _, err := c.do(ctx, http.MethodGet, "/route", rankQuery(-1, -1, -1, -1), nil, false)
	if err != nil {
		if routeMissing(err) { // every directory, SGLang's too, serves it
			return nil, unsupported(err)
		}
		return nil, err
	}
	info, err := ParsePrefillServerInfo(data)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: GET %s/route topology: %w: %w", c.addr, ErrNotDirectory, err)
	}
	return info, nil
}

// RankInfo fetches the control endpoint of the prefill rank at (dp, cp, tp,
// pp). The error wraps ErrNotReady on 503 and ErrNotFound on 404.
func (c *Client) RankInfo(ctx context.Context, dp, cp, tp, pp int) (*PrefillRankInfo, error) {
	data, _, err := c.do(ctx, http.MethodGet, "/route", rankQuery(dp, cp, tp, pp), nil, false)
	if err != nil {
		return nil, err
	}
	var ri PrefillRankInfo
	if err := json.Unmarshal(data, &ri); err != nil {
		return nil, fmt.Errorf("bootstrap: GET %s/route rank (dp=%d cp=%d tp=%d pp=%d): decode: %w", c.addr, dp, cp, tp, pp, err)
	}
	if ri.RankIP == "" || ri.RankPort < 1 || ri.RankPort > 65535 {
		return nil, fmt.Errorf("bootstrap: GET %s/route rank (dp=%d cp=%d tp=%d pp=%d): bad answer rank_ip=%q rank_port=%d",
			c.addr, dp, cp, tp, pp, ri.RankIP, ri.RankPort)
	}
	// A server other than kvxfer's may store any string: refuse hosts no
	// connection can reach rather than dial them.
	host, err := validHost(ri.RankIP)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: GET %s/route rank (dp=%d cp=%d tp=%d pp=%d): bad answer rank_ip: %w (the prefill rank registered an unusable address; fix its host setting)",
			c.addr, dp, cp, tp, pp, err)
	}
	ri.RankIP = host
	return &ri, nil
}

// RegisterDPRank records room → dpRank (POST /register_dp_rank), as a
// prefill sender does when it does not follow the bootstrap room. room must
// be ≤ 2^63−1.
func (c *Client) RegisterDPRank(ctx context.Context, room uint64, dpRank int) error {
	if room > maxRoom {
		return fmt.Errorf("bootstrap: register_dp_rank: bootstrap_room %d exceeds 2^63-1", room)
	}
	body := struct {
		Room uint64 `json:"bootstrap_room"`
		DP   int    `json:"dp_rank"`
	}{room, dpRank}
	_, _, err := c.do(ctx, http.MethodPost, "/register_dp_rank", nil, body, true)
	return err
}

// QueryDPRanks asks which prefill DP rank serves each room (POST
// /query_dp_ranks). Rooms the server does not know (never registered, or
// expired) are absent from the map.
func (c *Client) QueryDPRanks(ctx context.Context, rooms []uint64) (map[uint64]int, error) {
	for _, r := range rooms {
		if r > maxRoom {
			return nil, fmt.Errorf("bootstrap: query_dp_ranks: bootstrap_room %d exceeds 2^63-1", r)
		}
	}
	if rooms == nil {
		rooms = []uint64{}
	}
	body := struct {
		Rooms []uint64 `json:"bootstrap_rooms"`
	}{rooms}
	data, _, err := c.do(ctx, http.MethodPost, "/query_dp_ranks", nil, body, false)
	if err != nil {
		return nil, err
	}
	var raw map[string]int
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("bootstrap: POST %s/query_dp_ranks: decode answer: %w", c.addr, err)
	}
	out := make(map[uint64]int, len(raw))
	for k, v := range raw {
		room, err := strconv.ParseUint(k, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bootstrap: POST %s/query_dp_ranks: key %q is not a decimal room", c.addr, k)
		}
		out[room] = v
	}
	return out, nil
}

// Health checks GET /health (200 "OK"), the decode heartbeat.
func (c *Client) Health(ctx context.Context) error {
	_, _, err := c.do(ctx, http.MethodGet, "/health", nil, nil, false)
	return err
}

// CheckLeader verifies that the server at this client's address is the
// multi-node leader for distInitAddr: it must answer /health with the
// X-Kvxfer-Dist-Init-Addr header equal to distInitAddr. Otherwise the error
// wraps ErrWrongLeader and names both values — typically a follower given a
// different bootstrap port than the leader's, reaching some other server.
// An unreachable leader gives the transport error, naming the address.
func (c *Client) CheckLeader(ctx context.Context, distInitAddr string) error {
	_, hdr, err := c.do(ctx, http.MethodGet, "/health", nil, nil, false)
	if err != nil {
		return fmt.Errorf("bootstrap: check leader for dist-init-addr %q: %w", distInitAddr, err)
	}
	got := hdr.Get(HeaderDistInitAddr)
	if got != distInitAddr {
		if got == "" {
			got = "(none)"
		}
		return fmt.Errorf("%w: %s serves dist-init-addr %s, want %s; give every node the leader's bootstrap port",
			ErrWrongLeader, c.addr, got, distInitAddr)
	}
	return nil
}

// Table fetches GET /v1/table (a kvxfer extension): the whole directory.
// A server without the route (404 or 405: SGLang's directory, or no
// directory at all) gives an *UnsupportedError: it matches ErrUnsupported,
// and errors.As gives its *StatusError (the code and the server's text).
func (c *Client) Table(ctx context.Context) (*TableSnapshot, error) {
	data, _, err := c.do(ctx, http.MethodGet, "/v1/table", nil, nil, false)
	if err != nil {
		if routeMissing(err) {
			return nil, unsupported(err)
		}
		return nil, err
	}
	var t TableSnapshot
	if err := json.Unmarshal(data, &t); err != nil {
		return nil, fmt.Errorf("bootstrap: GET %s/v1/table: decode: %w", c.addr, err)
	}
	return &t, nil
}

const maxRoom = 1<<63 - 1

// NewFollowerClient returns a client for a multi-node prefill follower: it
// derives the leader's bootstrap address from distInitAddr and the leader's
// bootstrap port (LeaderBootstrapAddr), then waits — retrying with backoff
// up to the register timeout — until a server answers there, and checks that
// it is the leader for distInitAddr (CheckLeader). A server that answers but
// serves another dist-init-addr (or none) gives ErrWrongLeader at once; no
// server at all by the deadline gives an error naming the address and the
// port to check. The leader must run with Options.DistInitAddr (kvxfer
// bootstrap --dist-init-addr) set to the same value.
func NewFollowerClient(ctx context.Context, distInitAddr string, leaderBootstrapPort int, opts ...ClientOption) (*Client, error) {
	addr, err := LeaderBootstrapAddr(distInitAddr, leaderBootstrapPort)
	if err != nil {
		return nil, err
	}
	c, err := NewClient(addr, opts...)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.registerTimeout)
	defer cancel()
	for attempt := 0; ; attempt++ {
		err := c.CheckLeader(ctx, distInitAddr)
		if err == nil {
			return c, nil
		}
		if errors.Is(err, ErrWrongLeader) {
			return nil, err
		}
		t := time.NewTimer(backoff(c.backoffInitial, c.backoffMax, attempt))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("bootstrap: no leader bootstrap server at %s (dist-init-addr %s, port %d) after %d attempts; check the leader's bootstrap --port: %w",
				addr, distInitAddr, leaderBootstrapPort, attempt+1, err)
		case <-t.C:
		}
	}
}

// WaitReady polls ServerInfo (every poll, default 100 ms when ≤ 0) until the
// server is ready or ctx ends; then the error names the address and wraps
// the last failure (usually ErrNotReady: some prefill rank never registered —
// GET /v1/table lists the missing coordinates).
func (c *Client) WaitReady(ctx context.Context, poll time.Duration) (*PrefillServerInfo, error) {
	if poll <= 0 {
		poll = 100 * time.Millisecond
	}
	var last error
	for {
		info, err := c.ServerInfo(ctx)
		if err == nil {
			return info, nil
		}
		if errors.Is(err, ErrBadRequest) || errors.Is(err, ErrUnauthorized) {
			return nil, err
		}
		if last == nil || ctx.Err() == nil {
			last = err // keep the last real answer, not the one the deadline cut short
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("bootstrap: %s not ready (%v): %w", c.addr, context.Cause(ctx), last)
		case <-t.C:
		}
	}
}

// UnsupportedError is a server's 404 or 405 for a kvxfer route it does not
// offer (an SGLang directory has no GET /v1/table or /v1/entry): it matches
// ErrUnsupported with errors.Is, and errors.As gives its *StatusError (the
// code and the server's text). It deliberately does not match ErrNotFound:
// the route is missing, not an entry.
type UnsupportedError struct {
	// Status is the server's answer.
	Status *StatusError
}

// Error names the route, the server and its answer.
func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("%v: %s %s: HTTP %d: %s", ErrUnsupported, e.Status.Op, e.Status.Addr, e.Status.Code, e.Status.Body)
}

// Is matches ErrUnsupported only.
func (e *UnsupportedError) Is(target error) bool { return target == ErrUnsupported }

// As sets a **StatusError target to the server's answer.
func (e *UnsupportedError) As(target any) bool {
	if p, ok := target.(**StatusError); ok {
		*p = e.Status
		return true
	}
	return false
}

// unsupported turns a route-missing *StatusError into an *UnsupportedError.
func unsupported(err error) error {
	var se *StatusError
	errors.As(err, &se)
	return &UnsupportedError{Status: se}
}

// routeMissing reports whether err is the server's answer for a route it
// does not have (404 or 405).
func routeMissing(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && (se.Code == http.StatusNotFound || se.Code == http.StatusMethodNotAllowed)
}
