// Package zrpc holds the ZeroMQ request/reply plumbing shared by the segment
// engine's RPC (engine/segengine) and the agent's control channel
// (engine/agent): a ROUTER listener that serves one request per message and
// answers on the requester's connection, and the DEALER side's socket
// set-up, send and poll pacing. Frames, message types and error sentinels
// stay with each protocol; this package imports only zmq4 and the standard
// library.
package zrpc

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// ServeFunc answers one request: frames are the message without the ROUTER
// routing id; the result is the reply's frames, or nil to send no reply.
type ServeFunc func(frames [][]byte) [][]byte

// ListenConfig names a listener for its errors and logs.
type ListenConfig struct {
	// ErrPrefix starts every error of Listen ("engine: segment RPC").
	ErrPrefix string
	// LogPrefix starts the listener's debug log messages ("segment RPC").
	LogPrefix string
	// MaxMessage bounds a received message in bytes (ZMQ_MAXMSGSIZE).
	MaxMessage int64
	// BindHint says what to do when the bind fails (appended in
	// parentheses to the bind error).
	BindHint func(err error) string
	// Log receives the debug messages (a reply not sent).
	Log *slog.Logger
}

// Listener is a ROUTER socket and its serving goroutine.
type Listener struct {
	// Port is the bound TCP port (the one picked when 0 was asked).
	Port int

	sock    *zmq.Socket
	serve   ServeFunc
	cfg     ListenConfig
	done    chan struct{}
	stopped chan struct{}
}

// Listen binds a ROUTER socket on host:port (0 = a free port; an IPv6
// literal host turns IPv6 on) and serves its requests with serve until
// Close. Errors start with cfg.ErrPrefix and name the address.
func Listen(zctx *zmq.Context, host string, port int, serve ServeFunc, cfg ListenConfig) (*Listener, error) {
	s, err := zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		return nil, fmt.Errorf("%s: zmq ROUTER socket: %w", cfg.ErrPrefix, err)
	}
	_ = s.SetLinger(0)
	_ = s.SetRcvtimeo(100 * time.Millisecond)
	_ = s.SetSndtimeo(time.Second)
	_ = s.SetMaxmsgsize(cfg.MaxMessage)
	p := "*"
	if port > 0 {
		p = strconv.Itoa(port)
	}
	bh := host
	if ip := net.ParseIP(bh); ip != nil && ip.To4() == nil {
		_ = s.SetIpv6(true)
		bh = "[" + bh + "]"
	}
	if err := s.Bind("tcp://" + bh + ":" + p); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("%s: bind %s:%s: %w (%s)", cfg.ErrPrefix, host, p, err, cfg.BindHint(err))
	}
	ep, err := s.GetLastEndpoint()
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("%s: endpoint: %w", cfg.ErrPrefix, err)
	}
	_, ps, err := net.SplitHostPort(ep[len("tcp://"):])
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("%s: endpoint %q: %w", cfg.ErrPrefix, ep, err)
	}
	l := &Listener{sock: s, serve: serve, cfg: cfg, done: make(chan struct{}), stopped: make(chan struct{})}
	l.Port, _ = strconv.Atoi(ps)
	go l.loop()
	return l, nil
}

func (l *Listener) loop() {
	defer close(l.stopped)
	for {
		select {
		case <-l.done:
			return
		default:
		}
		parts, err := l.sock.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.ETERM {
				return
			}
			continue // EAGAIN (receive timeout), EINTR
		}
		if len(parts) < 2 {
			continue
		}
		id, frames := parts[0], parts[1:]
		if rep := l.serve(frames); rep != nil {
			l.send(id, rep)
		}
	}
}

// send answers the requester with routing id id.
func (l *Listener) send(id []byte, frames [][]byte) {
	if err := Send(l.sock, append([][]byte{id}, frames...)); err != nil {
		l.cfg.Log.Debug(l.cfg.LogPrefix+": reply not sent (requester gone?)", "err", err)
	}
}

// Close stops the serving goroutine and closes the socket. Idempotent.
func (l *Listener) Close() {
	select {
	case <-l.done:
	default:
		close(l.done)
	}
	<-l.stopped
	_ = l.sock.Close()
}

// NewDealer creates an unconnected DEALER socket for a peer at host
// (linger 0, maxMessage bytes at most per message, 1 s send timeout, IPv6
// on for an IPv6 literal). The error is zmq's.
func NewDealer(zctx *zmq.Context, host string, maxMessage int64) (*zmq.Socket, error) {
	s, err := zctx.NewSocket(zmq.DEALER)
	if err != nil {
		return nil, err
	}
	_ = s.SetLinger(0)
	_ = s.SetMaxmsgsize(maxMessage)
	_ = s.SetSndtimeo(time.Second)
	if ip := net.ParseIP(host); ip != nil && ip.To4() == nil {
		_ = s.SetIpv6(true)
	}
	return s, nil
}

// Send sends frames as one multipart message on s.
func Send(s *zmq.Socket, frames [][]byte) error {
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	_, err := s.SendMessage(parts...)
	return err
}

// PollWait is how long a requester polls for its reply before it checks
// ctx again: 50 ms, less when ctx's deadline is nearer (at least 1 ms).
func PollWait(ctx context.Context) time.Duration {
	wait := 50 * time.Millisecond
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
		wait = max(time.Until(dl), time.Millisecond)
	}
	return wait
}

// Trunc4k returns b as a string, cut to 4096 bytes (with "…") when longer:
// a peer's error text quoted in an error.
func Trunc4k(b []byte) string {
	if len(b) > 4096 {
		return string(b[:4096]) + "…"
	}
	return string(b)
}
