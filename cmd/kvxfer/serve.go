package main

// Where a rank's request lines come from (stdin, or --serve: a unix socket
// or an HTTP endpoint) and how it stops: every request line read gets its
// result line, and SIGTERM drains (issue 26 item 3, issue 22 item 2).

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"
	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/cluster"
	"github.com/kvxfer/kvxfer/workload"
)

// DefaultDrainTimeout is --drain-timeout's default: how long the rooms in
// flight at a SIGTERM (or at stdin's end) get to finish before they are
// cancelled. Below
// Kubernetes' default grace period (30 s) and systemd's TimeoutStopSec
// (90 s), so a drained rank exits before it is killed.
const DefaultDrainTimeout = 20 * time.Second

// serveHelp ends the prefill and decode help: --serve and the drain.
const serveHelp = `
--serve runs a long-lived rank with no stdin, on the same request and result
lines: unix:PATH (each connection gets the ready line, then one result line per
request line it sends) or http://HOST:PORT (POST /v1/requests with request
lines as the body, answered as NDJSON; GET /v1/ready). Exit status 0 once
drained.

SIGTERM or SIGINT drains: the lines already written to the rank when the signal
came (in its stdin pipe or socket) are served; a line written after it gets a
result with ok false saying the rank is draining; the rooms in flight finish,
every line read gets its result line, then the rank exits; the rooms still running after --drain-timeout, or
at a second signal, are cancelled, their result naming why.`

// drainRefusal is the error of a request line read after the stop signal.
const drainRefusal = "not started: the rank is draining (it got %s and finishes only the rooms it had started); send the request to another rank"

// rank is a started prefill or decode rank: its manager, buffers and room
// settings, the rooms in flight, and the drain state shared by every
// request source.
type rank struct {
	role engine.Role
	// serveLn is --serve's listener, bound before the rank registered
	// (nil: requests come on stdin).
	serveLn net.Listener
	m       *engine.Manager
	pool    *workload.KVBuffers
	rows    *workload.PageAllocator
	cache   *workload.PrefixCache
	rc      cluster.RoomConfig
	layout  *workload.Layout
	// ready is the rank's ready line (stdout, each socket connection,
	// GET /v1/ready).
	ready readyLine
	// token, when set, is the bearer token the HTTP endpoint requires.
	token        string
	drainTimeout time.Duration
	// bodies is what the HTTP endpoint is reading (--serve http).
	bodies bodySet

	// roomCtx is what rooms run under: cancelled (with the reason) by a
	// second stop signal or when the drain timeout passes.
	roomCtx     context.Context
	cancelRooms context.CancelCauseFunc
	// planMu orders prefix decisions (workload.PrefixCache.Plan) by
	// arrival, across connections.
	planMu sync.Mutex
	// inflight counts the rooms started and not yet answered (not a
	// WaitGroup: a line read just before the stop signal may start a room
	// while the drain waits).
	inflightMu   sync.Mutex
	inflightZero *sync.Cond
	inflight     int
	// drainNS is when the drain began (Unix ns; 0 while serving) and
	// drainSig the signal that began it.
	// attempts holds, per bootstrap_room, the attempt of the room this
	// rank is serving or releasing: a later line for the same room (a
	// router's retry keeps its bootstrap_room) starts once that attempt's
	// result is written and its release returned (a failed room's pages
	// fenced), instead of failing at once as "already active".
	attemptsMu             sync.Mutex
	attempts               map[uint64]chan struct{}
	drainNS                atomic.Int64
	drainSig               atomic.Value // string
	total, failed, refused atomic.Int64
	// refusedBodies counts POST /v1/requests answered 503 while draining
	// (their lines are not read, so they are not in refused).
	refusedBodies atomic.Int64
}

// draining reports whether the drain began before t, and the signal.
func (r *rank) drainedBefore(t time.Time) (bool, string) {
	ns := r.drainNS.Load()
	if ns == 0 || t.UnixNano() < ns {
		return false, ""
	}
	s, _ := r.drainSig.Load().(string)
	return true, s
}

// beginDrain marks the rank draining from now on (the first call counts):
// lines read after it are refused, the rooms in flight run on.
func (r *rank) beginDrain(why string) {
	r.drainSig.CompareAndSwap(nil, why)
	if r.drainNS.CompareAndSwap(0, time.Now().UnixNano()) {
		slog.Info("draining: no new requests; the rooms in flight finish, then the rank exits",
			"why", why, "drain_timeout", r.drainTimeout, "hint", "a second SIGTERM or SIGINT cancels the rooms in flight")
	}
}

// handle answers one request line with exactly one result line on out:
// at once for a line read after the drain began (refused) or a bad line's
// error is written from a goroutine like every served room, so handle
// never blocks on a room. sess counts the lines of one source still
// waiting for their result (nil: none kept).
func (r *rank) handle(in inputLine, out *lineWriter, sess *sync.WaitGroup) {
	r.total.Add(1)
	late, sig := in.afterStop, ""
	if late {
		sig, _ = r.drainSig.Load().(string)
	} else if !in.gated {
		late, sig = r.drainedBefore(in.readAt)
	}
	if late {
		r.refused.Add(1)
		r.failed.Add(1)
		rep := replyLine{Role: r.role.String(), TPRank: r.layout.TPRank, PPRank: r.layout.PPRank, Line: in.n}
		if in.hasRoom {
			rep.Room = new(in.q.Room)
		}
		rep.Error = fmt.Sprintf(drainRefusal, sig)
		rep.Verified = r.verified(false)
		out.write(rep)
		return
	}
	r.roomStarted(1)
	if sess != nil {
		sess.Add(1)
	}
	// Prefix decisions are made here, in arrival order, so decode ranks fed
	// the same lines decide alike (workload.PrefixCache).
	var lease *workload.Lease
	if r.cache != nil && in.err == nil {
		r.planMu.Lock()
		lease = r.cache.Plan(in.q.Room, in.q.HashIDs, in.q.Tokens)
		r.planMu.Unlock()
	}
	go func() {
		defer r.roomStarted(-1)
		if sess != nil {
			defer sess.Done()
		}
		if in.hasRoom && in.err == nil {
			defer r.awaitAttempt(in.q.Room)()
		}
		rep, release := r.serveLine(in, lease)
		out.write(rep)
		// The result goes out first; a failed room's pages come back only
		// once its producers are fenced (and before the rank exits).
		release()
	}()
}

// awaitAttempt waits until no earlier attempt of room is served or
// released on this rank (or the rooms are cancelled), claims the room, and
// returns the function that ends this attempt's claim.
func (r *rank) awaitAttempt(room uint64) (done func()) {
	for {
		r.attemptsMu.Lock()
		if r.attempts == nil {
			r.attempts = map[uint64]chan struct{}{}
		}
		prev := r.attempts[room]
		if prev == nil {
			mine := make(chan struct{})
			r.attempts[room] = mine
			r.attemptsMu.Unlock()
			return func() {
				r.attemptsMu.Lock()
				delete(r.attempts, room)
				r.attemptsMu.Unlock()
				close(mine)
			}
		}
		r.attemptsMu.Unlock()
		select {
		case <-prev:
		case <-r.roomCtx.Done():
			return func() {} // the attempt runs and fails with the cancellation
		}
	}
}

// roomStarted adds d to the rooms in flight.
func (r *rank) roomStarted(d int) {
	r.inflightMu.Lock()
	defer r.inflightMu.Unlock()
	r.inflight += d
	if r.inflight == 0 {
		r.inflightZero.Broadcast()
	}
}

// waitRooms returns once no room is in flight.
func (r *rank) waitRooms() {
	r.inflightMu.Lock()
	defer r.inflightMu.Unlock()
	for r.inflight > 0 {
		r.inflightZero.Wait()
	}
}

// serveLine runs one request line's room and returns its result line and
// the release of its pages.
func (r *rank) serveLine(in inputLine, lease *workload.Lease) (rep replyLine, release func()) {
	release = func() {}
	switch {
	case in.err != nil:
		rep.Error = fmt.Sprintf("line %d: %v", in.n, in.err)
	case r.role == engine.RolePrefill:
		rc := r.rc
		rc.Layerwise, rc.LayerTime = in.q.Layerwise, time.Duration(in.q.LayerComputeUS)*time.Microsecond
		rc.PatternRoom = in.q.PatternRoom
		rep.Result = cluster.PrefillRoom(r.roomCtx, r.m, r.pool, r.rows, rc, in.q.Room, in.q.Tokens)
	default:
		rep.Result, release = cluster.DecodeRoom(r.roomCtx, r.m, r.pool, r.rows, lease, r.rc, in.q.Room, in.q.Tokens, in.q.Bootstrap)
	}
	rep.Role, rep.TPRank, rep.PPRank, rep.Line = r.role.String(), r.layout.TPRank, r.layout.PPRank, in.n
	if in.hasRoom {
		rep.Room = new(in.q.Room)
	}
	if !rep.OK {
		if rep.Error == "" {
			rep.Error = "failed without a reason (report this as a bug)"
		}
		r.failed.Add(1)
	}
	rep.Verified = r.verified(rep.OK)
	return rep, release
}

// verified is a result line's "verified" (replyLine.Verified): on a decode,
// whether a room that succeeded (ok) had its bytes checked (--verify);
// nil, no key, on a prefill.
func (r *rank) verified(ok bool) *bool {
	if r.role != engine.RoleDecode {
		return nil
	}
	return new(ok && r.rc.Verifier != nil)
}

// drain returns once every room in flight wrote its result and the
// sources were stopped: it waits for the rooms (the sources read on,
// refusing every new line), then calls quiesce (the sources answer what
// was sent to them and stop), then waits for any room a line read just
// before the signal started. The --drain-timeout clock starts now; from
// names what began the drain ("the stop signal", "stdin's end"). A signal
// (after the first one, when stdin's end began the drain), or the clock
// running out, cancels the rooms in flight (they end at once naming the
// reason, and tell their peers) and calls abort (interrupt the sources),
// once.
func (r *rank) drain(sigs <-chan os.Signal, from string, quiesce, abort func()) {
	done := make(chan struct{})
	go func() {
		r.waitRooms()
		if quiesce != nil {
			quiesce()
		}
		r.waitRooms()
		close(done)
	}()
	clock := time.After(r.drainTimeout)
	signalled := from != stdinEnd
	cancelled := false
	cancel := func(cause error) {
		if cancelled {
			return
		}
		cancelled = true
		slog.Warn("cancelling the rooms still in flight", "why", cause)
		r.cancelRooms(cause)
		if abort != nil {
			abort()
		}
	}
	for {
		select {
		case <-done:
			return
		case s := <-sigs:
			if !signalled && !cancelled {
				// stdin ended first: the first signal marks the drain
				// (the clock already runs), the next one cancels.
				signalled = true
				r.beginDrain(s.String() + " signal")
				continue
			}
			cancel(fmt.Errorf("a second stop signal (%v) during the drain", s))
		case <-clock:
			clock = nil
			cancel(fmt.Errorf("--drain-timeout %s passed after %s with the room still in flight; raise --drain-timeout to give rooms in flight longer", r.drainTimeout, from))
		}
	}
}

// stdinEnd is drain's from when stdin's end began the drain; stopSignal
// when a stop signal did.
const (
	stdinEnd   = "stdin's end"
	stopSignal = "the stop signal"
)

// summary logs what the rank served, once it stops.
func (r *rank) summary(how string) {
	slog.Info("rank stopped", "how", how, "requests", r.total.Load(), "failed", r.failed.Load(), "refused_while_draining", r.refused.Load(),
		"http_bodies_refused_while_draining", r.refusedBodies.Load())
}

// errStopped ends a gatedReader's reads once a drain stopped it.
var errStopped = errors.New("request source stopped by the drain")

// gatedReader is a stream of request lines (stdin, one socket connection)
// with what a drain needs: the bytes read so far, whether the reading
// goroutine waits in Read (then every complete line it read was handed
// on), the bytes readable without blocking (FIONREAD, alias TIOCINQ), and a read deadline
// to interrupt a blocked Read without consuming anything. The reading
// goroutine (run) holds mu except while it waits in the source's Read.
type gatedReader struct {
	src io.Reader
	// pending returns the bytes readable now (nil: unknown).
	pending func() (int, error)
	// deadline sets the source's read deadline (nil: it has none).
	deadline func(time.Time) error

	mu      sync.Mutex
	cond    *sync.Cond
	inRead  bool
	done    bool
	stopped bool
	nread   int64
	// boundary is the stream offset the source had buffered (read, or
	// readable without blocking) when the stop signal came: lines ending
	// past it are refused (-1: no signal yet). markWanted says mark
	// interrupted a Read in flight and waits for the reading goroutine to
	// set boundary.
	boundary   int64
	markWanted bool
}

func newGatedReader(src io.Reader, pending func() (int, error), deadline func(time.Time) error) *gatedReader {
	g := &gatedReader{src: src, pending: pending, deadline: deadline, boundary: -1}
	g.cond = sync.NewCond(&g.mu)
	return g
}

// mark records the stop signal's boundary: the lines already written to
// the source (read, or waiting in the pipe or socket buffer) are served,
// those written later refused. Without a way to ask the kernel (pending
// nil or failing) only the lines read so far count. The first call counts.
func (g *gatedReader) mark() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.boundary >= 0 || g.done {
		return
	}
	if !g.inRead || g.deadline == nil {
		g.setBoundary()
		return
	}
	// A Read is in flight: bytes it already took from the kernel are not
	// in nread yet. Interrupt it (a read deadline consumes nothing); the
	// reading goroutine sets the boundary once it holds mu again.
	g.markWanted = true
	if err := g.deadline(time.Now()); err != nil {
		g.markWanted = false
		g.setBoundary()
		return
	}
	for g.boundary < 0 && !g.done {
		g.cond.Wait()
	}
}

// Read is the source's Read with mu released around it.
func (g *gatedReader) Read(p []byte) (int, error) {
	for {
		if g.stopped {
			return 0, errStopped
		}
		g.inRead = true
		g.cond.Broadcast()
		g.mu.Unlock()
		n, err := g.src.Read(p)
		g.mu.Lock()
		g.inRead = false
		g.nread += int64(n)
		if g.markWanted {
			// mark interrupted this Read (or it returned on its own): every
			// byte it took is counted in nread now.
			g.setBoundary()
			g.markWanted = false
			_ = g.deadline(time.Time{})
			g.cond.Broadcast()
			if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) && !g.stopped {
				continue
			}
		}
		if err != nil && g.stopped && errors.Is(err, os.ErrDeadlineExceeded) {
			err = errStopped
		}
		return n, err
	}
}

// setBoundary sets boundary to the bytes read plus those readable now;
// g.mu held, no Read in flight (or one on a source without deadlines).
func (g *gatedReader) setBoundary() {
	b := g.nread
	if g.pending != nil {
		if n, err := g.pending(); err == nil {
			b += int64(n)
		}
	}
	g.boundary = b
}

// run reads request lines until EOF, a read error or the drain's stop,
// handing each to handle (which must not block). It returns nil at EOF
// and when stopped.
func (g *gatedReader) run(role engine.Role, handle func(inputLine)) error {
	g.mu.Lock()
	defer func() {
		g.done = true
		g.cond.Broadcast()
		g.mu.Unlock()
	}()
	judge := func(in inputLine) {
		in.gated = true
		in.afterStop = g.boundary >= 0 && in.end > g.boundary
		handle(in)
	}
	if err := readRequests(g, role, judge); err != nil && !errors.Is(err, errStopped) {
		return err
	}
	return nil
}

// quiesce returns once every byte that was readable when it was called
// has been read and its complete lines handed on (lines written before a
// stop signal are answered, not lost in a pipe), and stops the reader: a
// source with a deadline is interrupted at once; one without (a terminal)
// hands on, refused, whatever its blocked Read returns later.
func (g *gatedReader) quiesce() {
	g.mu.Lock()
	defer g.mu.Unlock()
	target := g.nread
	if g.pending != nil {
		if n, err := g.pending(); err == nil {
			target += int64(n)
		}
	}
	for !g.done && !(g.inRead && g.nread >= target) {
		g.cond.Wait()
	}
	g.stopped = true
	if g.done || g.deadline == nil {
		return
	}
	if err := g.deadline(time.Now()); err != nil {
		return
	}
	for !g.done {
		g.cond.Wait()
	}
}

// interrupt stops a blocked Read now (the rooms were cancelled).
func (g *gatedReader) interrupt() {
	if g.deadline != nil {
		_ = g.deadline(time.Now())
	}
}

// stdinReader returns stdin as a gatedReader. A pipe or socket is read
// through a non-blocking duplicate of fd 0, so a drain can interrupt a
// blocked read without losing a byte; restore puts fd 0 back in blocking
// mode (the parent may share it).
func stdinReader() (g *gatedReader, restore func()) {
	pending := func() (int, error) { return unix.IoctlGetInt(0, unix.TIOCINQ) }
	var st unix.Stat_t
	if err := unix.Fstat(0, &st); err != nil || (st.Mode&unix.S_IFMT != unix.S_IFIFO && st.Mode&unix.S_IFMT != unix.S_IFSOCK) {
		return newGatedReader(os.Stdin, pending, nil), func() {}
	}
	fd, err := unix.Dup(0)
	if err != nil {
		return newGatedReader(os.Stdin, pending, nil), func() {}
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return newGatedReader(os.Stdin, pending, nil), func() {}
	}
	f := os.NewFile(uintptr(fd), "/dev/stdin") // non-blocking: pollable, with deadlines
	return newGatedReader(f, pending, f.SetReadDeadline), func() {
		_ = unix.SetNonblock(0, false)
		_ = f.Close()
	}
}

// serveStdin reads request lines from stdin until EOF or a stop signal,
// then drains. Exit status (stdin protocol): an error when any request
// failed or was refused.
func (r *rank) serveStdin(sigs <-chan os.Signal) error {
	out := &lineWriter{w: os.Stdout}
	out.write(r.ready)
	slog.Info("rank serving requests from stdin (JSON lines; --serve unix:PATH or http://HOST:PORT serves without stdin)",
		"role", r.role, "control", r.m.Endpoint(), "model", r.layout.Model.Name, "pages", r.layout.NumPages, "item_len", r.layout.ItemLen(), "crc32c", engine.CRC32CPath())
	g, restore := stdinReader()
	defer restore()
	readErr := make(chan error, 1)
	go func() { readErr <- g.run(r.role, func(in inputLine) { r.handle(in, out, nil) }) }()
	var rerr error
	select {
	case rerr = <-readErr:
		r.stdinClosed(rerr)
		r.drain(sigs, stdinEnd, nil, nil)
	case s := <-sigs:
		r.beginDrain(s.String() + " signal")
		g.mark()
		r.drain(sigs, stopSignal, g.quiesce, g.interrupt)
	}
	r.summary("stdin")
	if rerr != nil {
		return fmt.Errorf("reading requests from stdin: %w", rerr)
	}
	if n := r.failed.Load(); n > 0 {
		return fmt.Errorf("%d of %d requests failed (see the error field of their result lines)", n, r.total.Load())
	}
	return nil
}

// stdinClosed says why the rank stops when stdin ended: a rank started
// with stdin closed (nohup </dev/null, systemd, docker run without -i)
// used to print its ready line and exit in silence.
func (r *rank) stdinClosed(err error) {
	n, inflight := r.total.Load(), fmt.Sprintf("the rooms in flight finish first (within --drain-timeout %s; then they are cancelled)", r.drainTimeout)
	switch {
	case err != nil:
		slog.Error("stdin closed with a read error: no more requests; "+inflight, "err", err)
	case n == 0:
		slog.Warn("stdin closed before any request line: this rank reads its requests from stdin (JSON lines) and stops at its end; " +
			"started with stdin closed (</dev/null, nohup, systemd, docker run without -i)? Run a long-lived rank with " +
			"--serve unix:/run/kvxfer/decode.sock or --serve http://127.0.0.1:9100 (deploy/README.md)")
	default:
		slog.Info("stdin closed: no more requests; "+inflight+", then the rank exits", "requests", n)
	}
}

// serveSpec is a parsed --serve value.
type serveSpec struct {
	// unix is the socket path (unix:PATH), http the listen address
	// (http://HOST:PORT); both empty: stdin.
	unix, http string
}

// parseServe parses --serve: "" (stdin), "unix:PATH" or "http://HOST:PORT".
func parseServe(s string) (serveSpec, error) {
	switch {
	case s == "" || s == "-" || s == "stdin":
		return serveSpec{}, nil
	case strings.HasPrefix(s, "unix:"):
		p := strings.TrimPrefix(strings.TrimPrefix(s, "unix:"), "//")
		if p == "" {
			return serveSpec{}, fmt.Errorf("--serve %q: unix: needs a socket path, e.g. unix:/run/kvxfer/decode.sock", s)
		}
		if len(p) > 107 {
			return serveSpec{}, fmt.Errorf("--serve %q: a unix socket path has at most 107 bytes (this one %d)", s, len(p))
		}
		return serveSpec{unix: p}, nil
	case strings.HasPrefix(s, "http://"):
		u, err := url.Parse(s)
		if err != nil || u.Host == "" || u.Port() == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return serveSpec{}, fmt.Errorf("--serve %q: want http://HOST:PORT with no path (port 0 picks a free one, named in the ready line's \"serve\")", s)
		}
		return serveSpec{http: u.Host}, nil
	}
	return serveSpec{}, fmt.Errorf("--serve %q: want unix:PATH (a local socket) or http://HOST:PORT; leave it out to read requests from stdin", s)
}

// listenUnix binds the unix socket at path. A socket file nobody answers
// on (a rank that was killed) is replaced; a live one is an error.
func listenUnix(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("--serve unix:%s: the path exists and is not a socket; remove it or pick another path", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			_ = c.Close()
			return nil, fmt.Errorf("--serve unix:%s: another process serves this socket (a rank already running?)", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("--serve unix:%s: remove the stale socket: %w", path, err)
		}
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("--serve unix:%s: %w (does the directory exist and is it writable?)", path, err)
	}
	ln.SetUnlinkOnClose(true)
	return ln, nil
}

// unixConn is one client connection of serveUnix.
type unixConn struct {
	c    *net.UnixConn
	g    *gatedReader
	sess sync.WaitGroup
	done chan struct{} // closed once the connection is closed
}

// serveUnix serves request lines from connections to the unix socket ln:
// each connection gets the ready line, then one result line per request
// line it sends (line numbers per connection); the rank closes it once the
// client closed its side and every result is out. A stop signal closes
// the socket and drains; exit status 0 once drained.
func (r *rank) serveUnix(ln *net.UnixListener, sigs <-chan os.Signal) error {
	path := ln.Addr().String()
	out := &lineWriter{w: os.Stdout}
	out.write(r.ready)
	slog.Info("rank serving requests on a unix socket (JSON lines per connection)", "role", r.role, "socket", path, "control", r.m.Endpoint(), "model", r.layout.Model.Name)
	var mu sync.Mutex
	conns := map[*unixConn]struct{}{}
	stopping := false
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			uc := &unixConn{c: c, done: make(chan struct{})}
			uc.g = newGatedReader(c, connPending(c), c.SetReadDeadline)
			mu.Lock()
			if stopping {
				mu.Unlock()
				_ = c.Close()
				continue
			}
			conns[uc] = struct{}{}
			mu.Unlock()
			go func() {
				r.serveConn(uc)
				mu.Lock()
				delete(conns, uc)
				mu.Unlock()
			}()
		}
	}()
	s := <-sigs
	r.beginDrain(s.String() + " signal")
	_ = ln.Close() // removes the socket file: no new connections
	<-acceptDone
	mu.Lock()
	stopping = true
	var open []*unixConn
	for uc := range conns {
		open = append(open, uc)
	}
	mu.Unlock()
	for _, uc := range open {
		uc.g.mark()
	}
	quiesce := func() {
		var wg sync.WaitGroup
		for _, uc := range open {
			wg.Go(uc.g.quiesce)
		}
		wg.Wait()
	}
	r.drain(sigs, stopSignal, quiesce, func() {
		for _, uc := range open {
			uc.g.interrupt()
		}
	})
	for _, uc := range open {
		<-uc.done
	}
	r.summary("unix socket " + path)
	return nil
}

// connPending is FIONREAD on a unix connection.
func connPending(c *net.UnixConn) func() (int, error) {
	return func() (int, error) {
		raw, err := c.SyscallConn()
		if err != nil {
			return 0, err
		}
		var n int
		var ierr error
		if err := raw.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.TIOCINQ) }); err != nil {
			return 0, err
		}
		return n, ierr
	}
}

// serveConn serves one socket connection until the client's EOF or the
// drain's stop, waits for its results, then closes it.
func (r *rank) serveConn(uc *unixConn) {
	defer close(uc.done)
	defer uc.c.Close()
	out := &lineWriter{w: uc.c}
	out.write(r.ready)
	if err := uc.g.run(r.role, func(in inputLine) { r.handle(in, out, &uc.sess) }); err != nil && !errors.Is(err, net.ErrClosed) {
		slog.Info("socket connection ended with a read error; its rooms in flight still finish", "err", err)
	}
	uc.sess.Wait()
}

// serveHTTP serves request lines over HTTP on ln (echo):
//
//	POST /v1/requests   body: request lines (JSON lines); response 200
//	                    application/x-ndjson, one result line per request
//	                    line, each as its room ends (line numbers per body);
//	                    503 once the rank drains
//	GET  /v1/ready      the ready line; 503 once the rank drains
//
// With a bootstrap token set, both require "Authorization: Bearer TOKEN".
// A stop signal stops new requests and drains; exit status 0 once drained.
func (r *rank) serveHTTP(ln net.Listener, sigs <-chan os.Signal) error {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.Use(r.requireToken)
	e.GET("/v1/ready", func(c echo.Context) error {
		if draining, sig := r.drainedBefore(time.Now()); draining {
			return c.JSON(http.StatusServiceUnavailable, map[string]string{"error": "draining after " + sig})
		}
		return c.JSON(http.StatusOK, r.ready)
	})
	e.POST("/v1/requests", r.postRequests)
	srv := &http.Server{Handler: e, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		ErrorLog: slog.NewLogLogger(slog.Default().Handler(), slog.LevelWarn)}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	out := &lineWriter{w: os.Stdout}
	out.write(r.ready)
	slog.Info("rank serving requests over HTTP (POST /v1/requests: JSON lines in, one result line each out; GET /v1/ready)",
		"role", r.role, "addr", r.ready.Serve, "control", r.m.Endpoint(), "model", r.layout.Model.Name, "auth", r.token != "")
	var s os.Signal
	select {
	case s = <-sigs:
	case err := <-serveErr:
		return fmt.Errorf("--serve %s: %w", r.ready.Serve, err)
	}
	r.beginDrain(s.String() + " signal")
	// The endpoint answers 503 while the rooms in flight finish; then it
	// shuts down (Shutdown waits for the handlers still writing results).
	// When the rooms are cancelled, the bodies still being read are
	// interrupted (as a socket's reads are), not the responses: each
	// cancelled room still writes its result line; Close is only the
	// backstop for a client that stops reading its response.
	r.drain(sigs, stopSignal, func() { _ = srv.Shutdown(context.Background()) }, func() {
		r.bodies.interrupt()
		time.AfterFunc(httpAbortGrace, func() { _ = srv.Close() })
	})
	<-serveErr
	r.summary("http " + r.ready.Serve)
	return nil
}

// httpAbortGrace is how long the HTTP endpoint waits, once the rooms were
// cancelled, for the result lines to reach their clients before it closes
// the connections that are left.
const httpAbortGrace = 10 * time.Second

// bodySet is the request bodies POST /v1/requests is reading, so that a
// drain that cancels the rooms can interrupt their reads (a client that
// keeps its body open) while their responses carry the result lines.
type bodySet struct {
	mu      sync.Mutex
	stopped bool
	rcs     map[*http.ResponseController]struct{}
}

// add tracks rc's body until the returned func is called; a body added
// after interrupt is interrupted at once.
func (b *bodySet) add(rc *http.ResponseController) (remove func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.rcs == nil {
		b.rcs = map[*http.ResponseController]struct{}{}
	}
	b.rcs[rc] = struct{}{}
	if b.stopped {
		_ = rc.SetReadDeadline(time.Now())
	}
	return func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		delete(b.rcs, rc)
	}
}

// interrupt ends every tracked body's read now (and of any added later).
func (b *bodySet) interrupt() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stopped = true
	for rc := range b.rcs {
		_ = rc.SetReadDeadline(time.Now())
	}
}

// requireToken answers 401 to a request without the rank's bearer token
// (when it has one).
func (r *rank) requireToken(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if r.token == "" {
			return next(c)
		}
		got, ok := strings.CutPrefix(c.Request().Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(r.token)) != 1 {
			return c.JSON(http.StatusUnauthorized, map[string]string{"error": "this rank requires Authorization: Bearer <the deployment's bootstrap token> (KVXFER_BOOTSTRAP_AUTH_TOKEN)"})
		}
		return next(c)
	}
}

// postRequests is POST /v1/requests: every line of the body gets its
// result line in the streamed response.
func (r *rank) postRequests(c echo.Context) error {
	if draining, sig := r.drainedBefore(time.Now()); draining {
		r.refusedBodies.Add(1)
		return c.JSON(http.StatusServiceUnavailable, map[string]string{"error": fmt.Sprintf(drainRefusal, sig)})
	}
	resp := c.Response()
	// Result lines go out while the body is still read (HTTP/1.1 full
	// duplex; without it the server stops the body at the first write).
	_ = http.NewResponseController(resp.Writer).EnableFullDuplex()
	resp.Header().Set(echo.HeaderContentType, "application/x-ndjson")
	resp.WriteHeader(http.StatusOK)
	resp.Flush()
	out := &lineWriter{w: resp, flush: resp.Flush}
	defer r.bodies.add(http.NewResponseController(resp.Writer))()
	var sess sync.WaitGroup
	err := readRequests(c.Request().Body, r.role, func(in inputLine) { r.handle(in, out, &sess) })
	sess.Wait()
	if err != nil {
		slog.Info("request body ended with a read error; the lines read were answered", "remote", c.RealIP(), "err", err)
	}
	return nil
}
