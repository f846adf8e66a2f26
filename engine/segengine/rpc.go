package segengine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/internal/control"
	"github.com/kvxfer/kvxfer/engine/internal/zrpc"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Segment RPC: each TransferEngine runs a small ZeroMQ ROUTER listener (the
// P2P handshake listener, Mooncake's P2PHANDSHAKE rpc_port) that answers a
// peer's requests about its segment. A requester connects a DEALER socket
// and sends one request; the listener answers on the same connection.
//
// Request frames:
//
//	0 "KVXSEG" (segmentRPCMagic)   1 "1" (segmentRPCVersion)
//	2 type: "DESCRIBE" or "ACCEPT"  3 request id (ASCII decimal, echoed)
//	DESCRIBE: 4 peer id   5 transport name ("" = every transport)
//	          With a peer id the answer carries endpoints prepared for that
//	          peer (an RDMA receiver creates its QPs here); with "" it carries
//	          the regions and the shared endpoints only (a refresh).
//	ACCEPT:   4 peer id   5 transport name   6 the sender's
//	          Segment.HandshakeReply blob (transports with CapHandshake)
//
// Reply frames: 0 magic  1 version  2 "OK" or "ERR"  3 request id
// 4 payload: the SegmentDescriptor (DESCRIBE), "" (ACCEPT) or the error text.
//
// Decoders never panic and reject an unknown magic, version or type with an
// error wrapping ErrBadFrame; the listener drops such requests (logged at
// debug) and keeps serving.
//
// Trust: the segment RPC is not authenticated (ManagerConfig's
// AuthenticateControl covers the KV manager's control frames only, which
// is how prefill and decode ranks set up their data paths; the segment RPC
// serves TransferEngine named segments, kvx_engine_* and Python's
// TransferEngine). Whoever reaches the rpc_port can DESCRIBE a segment (its
// regions' addresses and lengths, each transport's endpoints: an rdma
// rkey, a tcp data address) and, naming a peer id, make an rdma engine
// prepare QPs for that id and connect them with ACCEPT: the same trust as
// Mooncake's P2PHANDSHAKE, which assumes the fabric and the rpc_port are
// reachable by the deployment only. Each peer id gets its own prepared
// endpoint, and the number of ids is not bounded here.
const (
	// segmentRPCMagic is frame 0 of every segment RPC message.
	segmentRPCMagic = "KVXSEG"
	// segmentRPCVersion is the protocol version in frame 1.
	segmentRPCVersion = 1
)

// Segment RPC message types (frame 2).
const (
	rpcDescribe = "DESCRIBE"
	rpcAccept   = "ACCEPT"
	rpcOK       = "OK"
	rpcErr      = "ERR"
)

// maxRPCMessage bounds a segment RPC message (descriptor plus framing).
const maxRPCMessage = transport.MaxSegmentDescriptorBytes + 64<<10

// DefaultRPCTimeout bounds one segment RPC request (connect, answer) when
// the caller's context has no earlier deadline.
const DefaultRPCTimeout = 5 * time.Second

// segmentRequest is a decoded segment RPC request.
type segmentRequest struct {
	// Type is "DESCRIBE" or "ACCEPT".
	Type string
	// ID is the requester's request id, echoed in the reply.
	ID uint64
	// Peer names the requesting sender (per-peer endpoint state key); ""
	// in a DESCRIBE asks for regions and shared endpoints only.
	Peer string
	// Transport restricts a DESCRIBE to one transport, names the ACCEPT's.
	Transport string
	// Reply is the ACCEPT's handshake reply blob.
	Reply []byte
}

// Encode returns the request's frames.
func (r *segmentRequest) Encode() [][]byte {
	f := [][]byte{[]byte(segmentRPCMagic), []byte(strconv.Itoa(segmentRPCVersion)), []byte(r.Type), control.Dec(r.ID), []byte(r.Peer), []byte(r.Transport)}
	if r.Type == rpcAccept {
		f = append(f, r.Reply)
	}
	return f
}

// segmentReply is a decoded segment RPC reply.
type segmentReply struct {
	ID uint64
	// OK is false when the listener refused the request; Payload is then the
	// error text.
	OK      bool
	Payload []byte
}

// Encode returns the reply's frames.
func (r *segmentReply) Encode() [][]byte {
	st := rpcErr
	if r.OK {
		st = rpcOK
	}
	return [][]byte{[]byte(segmentRPCMagic), []byte(strconv.Itoa(segmentRPCVersion)), []byte(st), control.Dec(r.ID), r.Payload}
}

func rpcHeader(parts [][]byte, what string) error {
	if len(parts) < 4 {
		return fmt.Errorf("%w: segment RPC %s: %d frames, want at least 4 (magic, version, type, id)", control.ErrBadFrame, what, len(parts))
	}
	if string(parts[0]) != segmentRPCMagic {
		return fmt.Errorf("%w: segment RPC %s: frame 0 is %q, want %q (is this address a kvxfer engine's RPC port?)", control.ErrBadFrame, what, control.Trunc(parts[0]), segmentRPCMagic)
	}
	if string(parts[1]) != strconv.Itoa(segmentRPCVersion) {
		return fmt.Errorf("%w: segment RPC %s: version %q not supported (this build speaks %d; upgrade the older side)", control.ErrBadFrame, what, control.Trunc(parts[1]), segmentRPCVersion)
	}
	return nil
}

// decodeSegmentRequest decodes a request's frames (without the ROUTER
// identity). Errors wrap ErrBadFrame and name the frame.
func decodeSegmentRequest(parts [][]byte) (*segmentRequest, error) {
	if err := rpcHeader(parts, "request"); err != nil {
		return nil, err
	}
	typ := string(parts[2])
	want := 0
	switch typ {
	case rpcDescribe:
		want = 6
	case rpcAccept:
		want = 7
	default:
		return nil, fmt.Errorf("%w: segment RPC request: unknown type %q", control.ErrBadFrame, control.Trunc(parts[2]))
	}
	if len(parts) != want {
		return nil, fmt.Errorf("%w: segment RPC %s has %d frames, want %d", control.ErrBadFrame, typ, len(parts), want)
	}
	r := &control.FrameReader{Msg: "segment RPC " + typ, Parts: parts}
	req := &segmentRequest{Type: typ, ID: r.Uint(3, 1<<63, "request id"), Peer: r.Str(4, "peer"), Transport: r.Str(5, "transport")}
	if typ == rpcAccept {
		if req.Peer == "" && r.Err == nil {
			r.Fail(4, "peer is empty (ACCEPT needs the peer id of the DESCRIBE that prepared the endpoint)")
		}
		if req.Transport == "" && r.Err == nil {
			r.Fail(5, "transport is empty")
		}
		if len(parts[6]) > control.MaxBlobBytes {
			r.Fail(6, "reply blob of %d bytes, longer than %d", len(parts[6]), control.MaxBlobBytes)
		}
		req.Reply = append([]byte(nil), parts[6]...)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return req, nil
}

// decodeSegmentReply decodes a reply's frames. Errors wrap ErrBadFrame.
func decodeSegmentReply(parts [][]byte) (*segmentReply, error) {
	if err := rpcHeader(parts, "reply"); err != nil {
		return nil, err
	}
	if len(parts) != 5 {
		return nil, fmt.Errorf("%w: segment RPC reply has %d frames, want 5", control.ErrBadFrame, len(parts))
	}
	var ok bool
	switch string(parts[2]) {
	case rpcOK:
		ok = true
	case rpcErr:
	default:
		return nil, fmt.Errorf("%w: segment RPC reply: status %q is not OK or ERR", control.ErrBadFrame, control.Trunc(parts[2]))
	}
	r := &control.FrameReader{Msg: "segment RPC reply", Parts: parts}
	id := r.Uint(3, 1<<63, "request id")
	if r.Err != nil {
		return nil, r.Err
	}
	return &segmentReply{ID: id, OK: ok, Payload: append([]byte(nil), parts[4]...)}, nil
}

// segmentHandler answers one decoded request: the payload of an OK reply,
// or an error whose text becomes the ERR reply.
type segmentHandler func(ctx context.Context, req *segmentRequest) ([]byte, error)

// rpcListener is a running segment RPC listener.
type rpcListener struct {
	*zrpc.Listener
	handle  segmentHandler
	timeout time.Duration
	log     *slog.Logger
	served  atomic.Uint64
}

// listenRPC binds a ROUTER socket on bindHost:port (0 = a free port).
func listenRPC(zctx *zmq.Context, bindHost string, port int, handle segmentHandler, timeout time.Duration, log *slog.Logger) (*rpcListener, error) {
	l := &rpcListener{handle: handle, timeout: timeout, log: log}
	zl, err := zrpc.Listen(zctx, bindHost, port, l.serve, zrpc.ListenConfig{
		ErrPrefix:  "engine: segment RPC",
		LogPrefix:  "segment RPC",
		MaxMessage: maxRPCMessage,
		BindHint: func(err error) string {
			if zmq.AsErrno(err) == zmq.EADDRINUSE {
				return "another process uses the port; pick another rpc port or 0 for a free one"
			}
			return "is the host an address of this machine?"
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
func (l *rpcListener) serve(frames [][]byte) [][]byte {
	req, err := decodeSegmentRequest(frames)
	if err != nil {
		l.log.Debug("segment RPC: dropped a malformed request", "err", err)
		// Answer when the id is readable, so a confused peer learns why.
		if len(frames) >= 4 && string(frames[0]) == segmentRPCMagic {
			if rid, perr := strconv.ParseUint(string(frames[3]), 10, 64); perr == nil {
				return (&segmentReply{ID: rid, Payload: []byte(err.Error())}).Encode()
			}
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	payload, herr := l.handle(ctx, req)
	cancel()
	rep := &segmentReply{ID: req.ID, OK: herr == nil, Payload: payload}
	if herr != nil {
		rep.Payload = []byte(herr.Error())
	}
	l.served.Add(1)
	return rep.Encode()
}

// Errors of the segment RPC client. The wrapping errors name the address.
var (
	// ErrSegmentUnreachable: nothing answered at the segment's RPC address
	// (connection refused, host unreachable, or no answer before the
	// deadline).
	ErrSegmentUnreachable = errors.New("segment RPC unreachable")
	// ErrSegmentRefused: the peer engine answered the request with an error
	// (unknown transport, closed engine, failed handshake).
	ErrSegmentRefused = errors.New("segment RPC refused")
)

var rpcSeq atomic.Uint64

// rpcClient sends segment RPC requests from one zmq context.
type rpcClient struct {
	zctx *zmq.Context
}

// call sends req to addr ("host:port") and waits for its reply until ctx
// ends (DefaultRPCTimeout when ctx has no deadline). A refused connection
// fails at once; a peer that accepts but never answers fails at the
// deadline. Errors wrap ErrSegmentUnreachable (with context.DeadlineExceeded
// when the deadline passed) or ErrSegmentRefused.
func (c *rpcClient) call(ctx context.Context, addr string, req *segmentRequest) ([]byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultRPCTimeout)
		defer cancel()
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil || port == "" {
		return nil, fmt.Errorf("engine: segment RPC address %q is not host:port (segment names are \"host:rpc_port\" in P2P mode)", addr)
	}
	s, err := zrpc.NewDealer(c.zctx, host, maxRPCMessage)
	if err != nil {
		return nil, fmt.Errorf("engine: segment RPC to %s: zmq DEALER socket: %w", addr, err)
	}
	defer s.Close()
	monAddr := fmt.Sprintf("inproc://kvxseg-%p-%d", c, rpcSeq.Add(1))
	var mon *zmq.Socket
	if err := s.Monitor(monAddr, zmq.EVENT_CONNECTED|zmq.EVENT_CONNECT_RETRIED); err == nil {
		if mon, err = c.zctx.NewSocket(zmq.PAIR); err == nil {
			_ = mon.SetLinger(0)
			if err := mon.Connect(monAddr); err != nil {
				_ = mon.Close()
				mon = nil
			}
		} else {
			mon = nil
		}
		if mon == nil {
			// Never leave a monitor without its reader (see Manager.watch).
			_ = s.Monitor("", 0)
		}
	}
	if mon != nil {
		// Stop monitoring before either socket closes: libzmq emits the
		// closing events from its I/O thread, which must never wait on a
		// monitor pipe nobody reads (it would stall every socket of the
		// context).
		defer func() {
			_ = s.Monitor("", 0)
			_ = mon.Close()
		}()
	}
	if err := s.Connect("tcp://" + net.JoinHostPort(host, port)); err != nil {
		return nil, fmt.Errorf("engine: segment RPC: connect to %s: %w: %v", addr, ErrSegmentUnreachable, err)
	}
	req.ID = rpcSeq.Add(1)
	if err := zrpc.Send(s, req.Encode()); err != nil {
		return nil, fmt.Errorf("engine: segment RPC %s to %s: send: %w: %v", req.Type, addr, ErrSegmentUnreachable, err)
	}
	poller := zmq.NewPoller()
	poller.Add(s, zmq.POLLIN)
	if mon != nil {
		poller.Add(mon, zmq.POLLIN)
	}
	connected := false
	for {
		polled, err := poller.Poll(zrpc.PollWait(ctx))
		if err != nil && zmq.AsErrno(err) != zmq.Errno(syscall.EINTR) {
			return nil, fmt.Errorf("engine: segment RPC %s to %s: poll: %w", req.Type, addr, err)
		}
		for _, p := range polled {
			if p.Socket == mon {
				ev, _, _, err := mon.RecvEvent(zmq.DONTWAIT)
				if err != nil {
					continue
				}
				switch ev {
				case zmq.EVENT_CONNECTED:
					connected = true
				case zmq.EVENT_CONNECT_RETRIED:
					if !connected {
						return nil, fmt.Errorf("engine: segment RPC %s to %s: %w: connection refused (is the peer engine running, and is its segment name host:rpc_port?)", req.Type, addr, ErrSegmentUnreachable)
					}
				}
				continue
			}
			msg, err := s.RecvMessageBytes(zmq.DONTWAIT)
			if err != nil {
				continue
			}
			rep, err := decodeSegmentReply(msg)
			if err != nil {
				return nil, fmt.Errorf("engine: segment RPC %s to %s: %w", req.Type, addr, err)
			}
			if rep.ID != req.ID {
				continue // a late answer to an earlier request on this socket cannot happen; ignore
			}
			if !rep.OK {
				return nil, fmt.Errorf("engine: segment RPC %s to %s: %w: %s", req.Type, addr, ErrSegmentRefused, zrpc.Trunc4k(rep.Payload))
			}
			return rep.Payload, nil
		}
		if err := ctx.Err(); err != nil {
			what := "no connection"
			if connected {
				what = "connected, but no answer"
			}
			return nil, fmt.Errorf("engine: segment RPC %s to %s: %w: %s before the deadline (peer hung, host down, or not a kvxfer engine RPC port): %w", req.Type, addr, ErrSegmentUnreachable, what, err)
		}
	}
}
