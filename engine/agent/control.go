package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/internal/zrpc"
)

// Control channel frames (ZeroMQ multipart; a DEALER sends one request, the
// agent's ROUTER answers on the same connection):
//
//	request: 0 "KVXAGENT"  1 "1" (version)  2 type  3 request id (decimal)
//	         4 sender agent name  5 sender instance (decimal)  6 target agent name
//	  HELLO:  no more frames (the sender added the target and asks for its
//	          data path: the answer names the peer id and epoch to open with)
//	  OPENED: 7 peer id  8 epoch (the sender's open finished; a transport
//	          with a handshake binds the epoch to the prepared QPs now)
//	  NOTIF:  7 the notification message (0..MaxNotifBytes bytes)
//	reply:   0 magic  1 version  2 "OK" or "ERR"  3 request id
//	         4.. payload: HELLO OK: 4 peer id  5 epoch; ERR: 4 the reason
//
// Decoders never panic (FuzzDecodeRequest, FuzzDecodeReply) and reject an
// unknown magic, version or type with an error wrapping control.ErrBadFrame.
const (
	ctlMagic   = "KVXAGENT"
	ctlVersion = 1

	msgHello  = "HELLO"
	msgOpened = "OPENED"
	msgNotif  = "NOTIF"
	replyOK   = "OK"
	replyErr  = "ERR"

	// MaxNotifBytes bounds a notification message.
	MaxNotifBytes = 64 << 10
	// maxCtlMessage bounds a control message.
	maxCtlMessage = MaxNotifBytes + 4<<10
)

// request is a decoded control request.
type request struct {
	Type     string
	ID       uint64
	From     string
	Instance uint64
	To       string
	Peer     string // OPENED
	Epoch    uint64 // OPENED
	Msg      []byte // NOTIF
}

func (r *request) encode() [][]byte {
	f := [][]byte{[]byte(ctlMagic), []byte(strconv.Itoa(ctlVersion)), []byte(r.Type), control.Dec(r.ID), []byte(r.From), control.Dec(r.Instance), []byte(r.To)}
	switch r.Type {
	case msgOpened:
		f = append(f, []byte(r.Peer), control.Dec(r.Epoch))
	case msgNotif:
		f = append(f, r.Msg)
	}
	return f
}

func ctlHeader(parts [][]byte, what string) error {
	if len(parts) < 4 {
		return fmt.Errorf("%w: agent %s: %d frames, want at least 4", control.ErrBadFrame, what, len(parts))
	}
	if string(parts[0]) != ctlMagic {
		return fmt.Errorf("%w: agent %s: frame 0 is %q, want %q (is this address a kvxfer agent's control port?)", control.ErrBadFrame, what, control.Trunc(parts[0]), ctlMagic)
	}
	if string(parts[1]) != strconv.Itoa(ctlVersion) {
		return fmt.Errorf("%w: agent %s: version %q not supported (this build speaks %d; upgrade the older side)", control.ErrBadFrame, what, control.Trunc(parts[1]), ctlVersion)
	}
	return nil
}

// decodeRequest decodes a request's frames (without the ROUTER identity).
func decodeRequest(parts [][]byte) (*request, error) {
	if err := ctlHeader(parts, "request"); err != nil {
		return nil, err
	}
	typ := string(parts[2])
	want := 0
	switch typ {
	case msgHello:
		want = 7
	case msgOpened:
		want = 9
	case msgNotif:
		want = 8
	default:
		return nil, fmt.Errorf("%w: agent request: unknown type %q", control.ErrBadFrame, control.Trunc(parts[2]))
	}
	if len(parts) != want {
		return nil, fmt.Errorf("%w: agent %s has %d frames, want %d", control.ErrBadFrame, typ, len(parts), want)
	}
	r := &control.FrameReader{Msg: "agent " + typ, Parts: parts}
	req := &request{Type: typ, ID: r.Uint(3, 1<<63, "request id"), From: r.Str(4, "sender"), Instance: r.Uint(5, 1<<64-1, "instance"), To: r.Str(6, "target")}
	if r.Err == nil && (req.From == "" || len(req.From) > MaxNameBytes) {
		r.Fail(4, "sender name of %d bytes, want 1..%d", len(req.From), MaxNameBytes)
	}
	switch typ {
	case msgOpened:
		req.Peer = r.Str(7, "peer id")
		req.Epoch = r.Uint(8, 1<<64-1, "epoch")
	case msgNotif:
		if len(parts[7]) > MaxNotifBytes {
			r.Fail(7, "notification of %d bytes, longer than %d", len(parts[7]), MaxNotifBytes)
		}
		req.Msg = append([]byte{}, parts[7]...)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return req, nil
}

// reply is a decoded control reply.
type reply struct {
	ID      uint64
	OK      bool
	Payload [][]byte
}

func (r *reply) encode() [][]byte {
	st := replyErr
	if r.OK {
		st = replyOK
	}
	return append([][]byte{[]byte(ctlMagic), []byte(strconv.Itoa(ctlVersion)), []byte(st), control.Dec(r.ID)}, r.Payload...)
}

// decodeReply decodes a reply's frames.
func decodeReply(parts [][]byte) (*reply, error) {
	if err := ctlHeader(parts, "reply"); err != nil {
		return nil, err
	}
	if len(parts) > 8 {
		return nil, fmt.Errorf("%w: agent reply has %d frames, want at most 8", control.ErrBadFrame, len(parts))
	}
	var ok bool
	switch string(parts[2]) {
	case replyOK:
		ok = true
	case replyErr:
	default:
		return nil, fmt.Errorf("%w: agent reply: status %q is not OK or ERR", control.ErrBadFrame, control.Trunc(parts[2]))
	}
	r := &control.FrameReader{Msg: "agent reply", Parts: parts}
	id := r.Uint(3, 1<<63, "request id")
	if r.Err != nil {
		return nil, r.Err
	}
	rep := &reply{ID: id, OK: ok}
	for _, p := range parts[4:] {
		rep.Payload = append(rep.Payload, append([]byte{}, p...))
	}
	return rep, nil
}

// handler answers one decoded request: the payload of an OK reply, or an
// error whose text becomes the ERR reply.
type handler func(req *request) ([][]byte, error)

// listener is the agent's control ROUTER socket and its serving goroutine.
type listener struct {
	*zrpc.Listener
	handle handler
	log    *slog.Logger
}

func listen(zctx *zmq.Context, host string, port int, h handler, log *slog.Logger) (*listener, error) {
	l := &listener{handle: h, log: log}
	zl, err := zrpc.Listen(zctx, host, port, l.serve, zrpc.ListenConfig{
		ErrPrefix:  "agent: control channel",
		LogPrefix:  "agent control",
		MaxMessage: maxCtlMessage,
		BindHint: func(error) string {
			return "port in use, or the host is not an address of this machine; 0 picks a free port"
		},
		Log: log,
	})
	if err != nil {
		return nil, err
	}
	l.Listener = zl
	return l, nil
}

// serve answers one request's frames (nil: no reply).
func (l *listener) serve(frames [][]byte) [][]byte {
	req, err := decodeRequest(frames)
	if err != nil {
		l.log.Debug("agent control: dropped a malformed request", "err", err)
		if len(frames) >= 4 && string(frames[0]) == ctlMagic {
			if rid, perr := strconv.ParseUint(string(frames[3]), 10, 64); perr == nil {
				return (&reply{ID: rid, Payload: [][]byte{[]byte(err.Error())}}).encode()
			}
		}
		return nil
	}
	payload, herr := l.handle(req)
	rep := &reply{ID: req.ID, OK: herr == nil, Payload: payload}
	if herr != nil {
		rep.Payload = [][]byte{[]byte(herr.Error())}
	}
	return rep.encode()
}

// Errors of the control channel.
var (
	// ErrAgentUnreachable: nothing answered at the agent's control address
	// before the deadline (process gone, host down, port filtered).
	ErrAgentUnreachable = errors.New("agent unreachable")
	// ErrRefused: the remote agent answered with a refusal (it removed this
	// agent, does not know it, or is another agent than the metadata named).
	ErrRefused = errors.New("refused by the remote agent")
)

var ctlSeq atomic.Uint64

// peerConn is a kept DEALER connection to one remote agent's control
// channel, for its notifications (a socket per NOTIF cost a connection
// handshake each: about 0.5 ms on loopback). Requests on it are
// serialised; a request that times out closes the socket (a late answer
// must not meet the next request), the next one connects again.
type peerConn struct {
	zctx *zmq.Context
	addr string

	mu     sync.Mutex
	sock   *zmq.Socket
	closed bool
}

// call sends req on the kept connection (connecting first when needed).
func (c *peerConn) call(ctx context.Context, req *request) ([][]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, fmt.Errorf("agent: control %s to %s: connection closed (the remote agent was removed)", req.Type, c.addr)
	}
	if c.sock == nil {
		s, err := dial(c.zctx, c.addr, req.Type)
		if err != nil {
			return nil, err
		}
		c.sock = s
	}
	pl, err := exchange(ctx, c.sock, c.addr, req)
	if err != nil && !errors.Is(err, ErrRefused) {
		_ = c.sock.Close()
		c.sock = nil
	}
	return pl, err
}

// close closes the socket; later calls fail. Idempotent.
func (c *peerConn) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.sock != nil {
		_ = c.sock.Close()
		c.sock = nil
	}
}

// dial connects a DEALER socket to addr.
func dial(zctx *zmq.Context, addr, what string) (*zmq.Socket, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("agent: control address %q is not host:port", addr)
	}
	s, err := zrpc.NewDealer(zctx, host, maxCtlMessage)
	if err != nil {
		return nil, fmt.Errorf("agent: control %s to %s: zmq DEALER socket: %w", what, addr, err)
	}
	if err := s.Connect("tcp://" + net.JoinHostPort(host, port)); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("agent: control %s: connect to %s: %w: %v", what, addr, ErrAgentUnreachable, err)
	}
	return s, nil
}

// call sends req to addr on a socket of its own and waits for the reply
// until ctx ends.
func call(ctx context.Context, zctx *zmq.Context, addr string, req *request) ([][]byte, error) {
	s, err := dial(zctx, addr, req.Type)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return exchange(ctx, s, addr, req)
}

// exchange sends req on s and waits for its reply until ctx ends. Errors
// wrap ErrAgentUnreachable (no answer; with ctx's error) or ErrRefused.
func exchange(ctx context.Context, s *zmq.Socket, addr string, req *request) ([][]byte, error) {
	req.ID = ctlSeq.Add(1)
	if err := zrpc.Send(s, req.encode()); err != nil {
		return nil, fmt.Errorf("agent: control %s to %s: send: %w: %v", req.Type, addr, ErrAgentUnreachable, err)
	}
	poller := zmq.NewPoller()
	poller.Add(s, zmq.POLLIN)
	for {
		polled, err := poller.Poll(zrpc.PollWait(ctx))
		if err != nil && zmq.AsErrno(err) != zmq.Errno(syscall.EINTR) {
			return nil, fmt.Errorf("agent: control %s to %s: poll: %w", req.Type, addr, err)
		}
		if len(polled) > 0 {
			msg, err := s.RecvMessageBytes(zmq.DONTWAIT)
			if err == nil {
				rep, err := decodeReply(msg)
				if err != nil {
					return nil, fmt.Errorf("agent: control %s to %s: %w", req.Type, addr, err)
				}
				if rep.ID != req.ID {
					continue
				}
				if !rep.OK {
					why := ""
					if len(rep.Payload) > 0 {
						why = zrpc.Trunc4k(rep.Payload[0])
					}
					return nil, fmt.Errorf("agent: control %s to %s: %w: %s", req.Type, addr, ErrRefused, why)
				}
				return rep.Payload, nil
			}
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("agent: control %s to %s: %w: no answer before the deadline (agent process gone, host down, or not a kvxfer agent's control port): %w", req.Type, addr, ErrAgentUnreachable, err)
		}
	}
}
