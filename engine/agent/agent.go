package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// LocalAgent names the local side in PrepDlist (NIXL's "NIXL_INIT_AGENT").
const LocalAgent = "NIXL_INIT_AGENT"

// Defaults of Config.
const (
	// DefaultTimeout bounds one control request or segment RPC.
	DefaultTimeout = 5 * time.Second
	// DefaultDrainTimeout bounds the wait for a cancelled batch to stop.
	DefaultDrainTimeout = 10 * time.Second
	// DefaultTransferTimeout bounds one posted transfer.
	DefaultTransferTimeout = 120 * time.Second
	// DefaultMaxNotifs bounds the unread notifications kept per sender.
	DefaultMaxNotifs = 1 << 16
)

// Errors of the agent. The errors wrapping them name the agent, handle or
// index at fault.
var (
	// ErrUnknownAgent: the remote agent was never added, or was removed
	// (RemoveRemoteAgent); add it again with its metadata.
	ErrUnknownAgent = errors.New("unknown remote agent")
	// ErrBadHandle: the registration, descriptor list or transfer handle is
	// not (or no longer) this agent's.
	ErrBadHandle = errors.New("bad handle")
	// ErrBadIndex: a descriptor index is outside its prepared list.
	ErrBadIndex = errors.New("descriptor index out of range")
	// ErrBadDescriptor: a descriptor is empty, outside registered memory, of
	// another memory kind, or pairs with a descriptor of another length.
	ErrBadDescriptor = errors.New("bad descriptor")
	// ErrNotRegistered: a local descriptor is not inside memory registered
	// with this agent (errors wrapping it also wrap ErrBadDescriptor).
	ErrNotRegistered = errors.New("not inside registered memory")
	// ErrBusy: the transfer is in progress (PROC); wait for DONE or ERR, or
	// cancel it, before posting it again.
	ErrBusy = errors.New("transfer in progress")
	// ErrNotifQueueFull: the receiving agent holds Config.MaxNotifs unread
	// notifications from this agent (its caller does not call GetNotifs).
	ErrNotifQueueFull = errors.New("notification queue full")
)

// Config configures an Agent.
type Config struct {
	// Name is the agent's name (required, 1..MaxNameBytes bytes): peers key
	// their remote agent tables and notifications by it.
	Name string
	// Transport is the opened transport the agent moves bytes with
	// (required). The agent owns it from New on: Close closes it, and New
	// closes it when it fails.
	Transport transport.Transport
	// LocalHostname is "host" or "host:port" for the segment RPC listener
	// (segengine.TransferEngineConfig.LocalHostname); default "127.0.0.1".
	LocalHostname string
	// ControlPort is the control channel's port on the same host; 0 = a
	// free port (the metadata carries it).
	ControlPort int
	// AdvertiseHost, when set, is the host peers reach (a wildcard bind
	// needs it when the default-route interface is not that one).
	AdvertiseHost string
	// Timeout bounds each control request and each segment RPC (default
	// DefaultTimeout).
	Timeout time.Duration
	// DrainTimeout bounds how long Cancel and Release wait for an in-flight
	// batch to stop before closing the segment to its agent (default
	// DefaultDrainTimeout).
	DrainTimeout time.Duration
	// TransferTimeout bounds one posted transfer, data and notification
	// (default DefaultTransferTimeout): a peer that hangs makes it ERR.
	TransferTimeout time.Duration
	// MaxNotifs bounds the unread notifications kept per remote agent
	// (default DefaultMaxNotifs); beyond it the sender's NOTIF is refused
	// (ErrNotifQueueFull) and its transfer ends ERR.
	MaxNotifs int
	// Logger receives the agent's logs (slog.Default when nil).
	Logger *slog.Logger
}

// RegHandle names one RegisterMemory call's regions.
type RegHandle uint64

// DlistHandle names a prepared descriptor list.
type DlistHandle uint64

// XferHandle names a transfer request.
type XferHandle uint64

// Op is a transfer's direction, as NIXL names it.
type Op uint8

const (
	// OpWrite: local descriptors are written into the remote agent's.
	OpWrite Op = iota
	// OpRead: the remote agent's descriptors are read into local ones.
	OpRead
)

// String returns NIXL's name of the operation ("READ", "WRITE").
func (o Op) String() string {
	switch o {
	case OpWrite:
		return "WRITE"
	case OpRead:
		return "READ"
	}
	return "Op(" + strconv.Itoa(int(o)) + ")"
}

// ParseOp parses "READ" or "WRITE".
func ParseOp(s string) (Op, error) {
	switch s {
	case "READ":
		return OpRead, nil
	case "WRITE":
		return OpWrite, nil
	}
	return 0, fmt.Errorf("agent: transfer operation %q: want \"READ\" or \"WRITE\"", s)
}

// XferState is a transfer's state. NIXL's Python API reports NotPosted,
// Err and Canceled as "ERR", Proc as "PROC" and Done as "DONE".
type XferState uint8

const (
	// XferNotPosted: made, never posted.
	XferNotPosted XferState = iota
	// XferProc: posted, not finished.
	XferProc
	// XferDone: the data landed and the notification (if any) was delivered.
	XferDone
	// XferErr: the transfer failed; Err says why.
	XferErr
	// XferCanceled: Cancel stopped it; no notification was sent.
	XferCanceled
)

// String returns NIXL's name of the state ("PROC", "DONE", "ERR").
func (s XferState) String() string {
	switch s {
	case XferProc:
		return "PROC"
	case XferDone:
		return "DONE"
	}
	return "ERR"
}

// Desc is one descriptor of a prepared list: NIXL's (addr, len, dev_id).
type Desc struct {
	// Addr is the first byte, in the owning agent's address space (a
	// device pointer for CUDA memory).
	Addr uint64
	// Len is the length in bytes (> 0).
	Len uint64
	// Device is the GPU ordinal for CUDA memory (informational for host).
	Device int
}

// Telemetry is one transfer's last post, NIXL's nixlXferTelemetry.
type Telemetry struct {
	// Start is when the transfer was posted.
	Start time.Time
	// Post is how long Post took (validation, translation, submission).
	Post time.Duration
	// Xfer is from the post to the end (DONE/ERR), or until now while PROC.
	Xfer time.Duration
	// Bytes is the payload in bytes.
	Bytes uint64
	// Descs is the number of descriptor pairs (before merging adjacent ones).
	Descs int
}

// regList is one RegisterMemory call.
type regList struct {
	mems []transport.Memory
	ids  []transport.RegionID
}

// dlist is a prepared descriptor list.
type dlist struct {
	agent   string // "" = local
	inst    uint64 // the remote agent's instance it was prepared against
	kind    transport.MemoryKind
	descs   []Desc
	regions []transport.RegionID // the region holding each descriptor (merging stays inside one)
}

// remote is an added remote agent.
type remote struct {
	md    Metadata
	conn  *peerConn // its control channel (notifications)
	seg   *segengine.RemoteSegment
	dead  error // the segment was closed to stop a batch; re-add the agent
	xfers map[*xfer]struct{}
}

// inbound is a remote agent that added this one (it said HELLO).
type inbound struct {
	instance uint64
	peer     string
	epoch    uint64
	admitted bool
}

// xfer is a transfer request.
type xfer struct {
	h         XferHandle
	op        Op
	agent     string
	inst      uint64               // the remote agent's instance its list was prepared against
	reads     []segengine.PeerRead // OpRead
	writes    []segengine.PeerWrite
	descs     int
	bytes     uint64
	notif     []byte
	state     XferState
	err       error
	gen       uint64
	active    bool  // a post's goroutine runs
	notifying bool  // the notification is being sent
	stop      bool  // Cancel/Release/RemoveRemoteAgent asked: send no notification
	why       error // RemoveRemoteAgent's reason (the post ends XferErr), nil for Cancel
	seg       *segengine.RemoteSegment
	batch     transport.BatchID
	start     time.Time
	post      time.Duration
	end       time.Time
	done      chan struct{}
}

// Agent is a NIXL-shaped transfer agent (see the package doc).
type Agent struct {
	cfg      Config
	te       *segengine.TransferEngine
	tr       transport.Transport
	zctx     *zmq.Context
	ctl      *listener
	ctlAddr  string
	log      *slog.Logger
	fencer   transport.Fencer // nil when the transport cannot fence
	handshk  bool             // the transport binds epochs after its handshake (rdma)
	instance uint64

	addMu    sync.Mutex // one AddRemoteAgent at a time (a HELLO replaces the peer's older paths)
	mu       sync.Mutex
	closed   bool
	seq      uint64
	regs     map[RegHandle]*regList
	dlists   map[DlistHandle]*dlist
	xfers    map[XferHandle]*xfer
	remotes  map[string]*remote
	inbound  map[string][]*inbound
	removed  map[string]uint64 // name → instance whose HELLO and NOTIF are refused
	notifs   map[string][][]byte
	notifN   map[string]int
	notifSig chan struct{}
}

// New starts an agent: its transfer engine (segment RPC listener) and its
// control channel. Errors: a missing name or transport, a bad
// LocalHostname, a port in use, and the engine's errors.
func New(ctx context.Context, cfg Config) (a *Agent, err error) {
	if cfg.Transport == nil {
		return nil, errors.New("agent: a transport is required (transport.OpenTransport)")
	}
	if cfg.Name == "" || len(cfg.Name) > MaxNameBytes || cfg.Name == LocalAgent {
		_ = cfg.Transport.Close()
		return nil, fmt.Errorf("agent: name %q: want 1..%d bytes, not %q", cfg.Name, MaxNameBytes, LocalAgent)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.TransferTimeout <= 0 {
		cfg.TransferTimeout = DefaultTransferTimeout
	}
	if cfg.MaxNotifs <= 0 {
		cfg.MaxNotifs = DefaultMaxNotifs
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	tr := cfg.Transport
	te, err := segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{Transport: tr, LocalHostname: cfg.LocalHostname,
		AdvertiseHost: cfg.AdvertiseHost, RPCTimeout: cfg.Timeout, Logger: cfg.Logger})
	if err != nil {
		return nil, fmt.Errorf("agent %q: %w", cfg.Name, err)
	}
	defer func() {
		if err != nil {
			_ = te.Close()
		}
	}()
	a = &Agent{cfg: cfg, te: te, tr: tr, instance: te.Epoch(), log: cfg.Logger.With("agent", cfg.Name),
		regs: map[RegHandle]*regList{}, dlists: map[DlistHandle]*dlist{}, xfers: map[XferHandle]*xfer{},
		remotes: map[string]*remote{}, inbound: map[string][]*inbound{}, removed: map[string]uint64{},
		notifs: map[string][][]byte{}, notifN: map[string]int{}, notifSig: make(chan struct{})}
	a.fencer, _ = tr.(transport.Fencer)
	a.handshk = tr.Capabilities().Has(transport.CapHandshake)
	if a.zctx, err = zmq.NewContext(); err != nil {
		return nil, fmt.Errorf("agent %q: zmq context: %w", cfg.Name, err)
	}
	host, _, _ := net.SplitHostPort(te.RPCAddr())
	bind := bindHost(cfg.LocalHostname)
	if a.ctl, err = listen(a.zctx, bind, cfg.ControlPort, a.handle, a.log); err != nil {
		_ = a.zctx.Term()
		return nil, fmt.Errorf("agent %q: %w", cfg.Name, err)
	}
	a.ctlAddr = net.JoinHostPort(host, strconv.Itoa(a.ctl.Port))
	a.log.Debug("agent ready", "segment", te.Name(), "control", a.ctlAddr, "transport", tr.Name(), "fencing", a.fencer != nil)
	return a, nil
}

// bindHost is the host part of a LocalHostname ("127.0.0.1" when empty).
func bindHost(s string) string {
	if s == "" {
		return "127.0.0.1"
	}
	if net.ParseIP(s) != nil {
		return s
	}
	if h, _, err := net.SplitHostPort(s); err == nil {
		return h
	}
	return s
}

// Name returns the agent's name.
func (a *Agent) Name() string { return a.cfg.Name }

// Engine returns the agent's transfer engine (its transport and segment
// RPC listener). The agent owns it: do not close it or register memory
// with it directly (use RegisterMemory).
func (a *Agent) Engine() *segengine.TransferEngine { return a.te }

// ControlAddr returns "host:port" of the control channel.
func (a *Agent) ControlAddr() string { return a.ctlAddr }

// Metadata returns the agent's metadata (get_agent_metadata), to hand to
// peers out of band.
func (a *Agent) Metadata() []byte {
	return Metadata{Name: a.cfg.Name, Instance: a.instance, Control: a.ctlAddr, Segment: a.te.Name(), Transport: a.tr.Name()}.Encode()
}

func (a *Agent) next() uint64 { a.seq++; return a.seq }

// RegisterMemory registers every range of mems with the transport, all or
// nothing (on an error the ones registered are deregistered again), and
// returns the handle DeregisterMemory takes. Errors: a closed agent, an
// empty list, a range overlapping registered memory, the transport's
// errors (a memory kind it cannot register: ErrUnsupportedMemory).
func (a *Agent) RegisterMemory(mems []transport.Memory) (RegHandle, error) {
	if len(mems) == 0 {
		return 0, errors.New("agent: register memory: the list is empty")
	}
	if err := a.usable("register memory"); err != nil {
		return 0, err
	}
	rl := &regList{mems: append([]transport.Memory(nil), mems...)}
	for i, m := range mems {
		d, err := a.te.RegisterMemory(m)
		if err != nil {
			for _, id := range rl.ids {
				_ = a.te.DeregisterMemory(id)
			}
			return 0, fmt.Errorf("agent %q: register memory: descriptor %d of %d [%#x, +%d bytes) %s: %w", a.cfg.Name, i, len(mems), m.Addr, m.Length, m.Kind, err)
		}
		rl.ids = append(rl.ids, d.ID)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	h := RegHandle(a.next())
	a.regs[h] = rl
	return h, nil
}

// DeregisterMemory deregisters a RegisterMemory call's regions; peers'
// later transfers to and from them fail. Errors: an unknown handle, the
// transport's errors (every region is still attempted).
func (a *Agent) DeregisterMemory(h RegHandle) error {
	a.mu.Lock()
	rl := a.regs[h]
	delete(a.regs, h)
	a.mu.Unlock()
	if rl == nil {
		return fmt.Errorf("agent %q: deregister memory: registration %d: %w (already deregistered?)", a.cfg.Name, h, ErrBadHandle)
	}
	var errs []error
	for _, id := range rl.ids {
		if err := a.te.DeregisterMemory(id); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (a *Agent) usable(what string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return fmt.Errorf("agent %q: %s: agent %w", a.cfg.Name, what, transport.ErrClosed)
	}
	return nil
}

// AddRemoteAgent loads a peer's metadata (add_remote_agent): it asks the
// peer for a data path (HELLO), opens its segment with that epoch and
// reports the open (OPENED), and returns the peer's name. Adding an agent
// already added with the same instance returns its name; a new instance
// (the peer restarted) replaces the old one, whose requests fail. Errors
// wrap ErrBadMetadata, ErrRefused (the peer removed this agent), the
// segment engine's open errors, ErrAgentUnreachable; they name the peer.
func (a *Agent) AddRemoteAgent(ctx context.Context, metadata []byte) (string, error) {
	md, err := DecodeMetadata(metadata)
	if err != nil {
		return "", err
	}
	a.addMu.Lock()
	defer a.addMu.Unlock()
	if md.Name == a.cfg.Name {
		return "", fmt.Errorf("agent %q: add remote agent: the metadata is this agent's own (loopback transfers are not supported; use another agent)", a.cfg.Name)
	}
	if md.Transport != a.tr.Name() {
		return "", fmt.Errorf("agent %q: add remote agent %q: it runs transport %s, this agent runs %s (create both agents with the same transport): %w", a.cfg.Name, md.Name, md.Transport, a.tr.Name(), segengine.ErrTransportMismatch)
	}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return "", fmt.Errorf("agent %q: add remote agent: agent %w", a.cfg.Name, transport.ErrClosed)
	}
	if r := a.remotes[md.Name]; r != nil && r.md.Instance == md.Instance && r.dead == nil {
		a.mu.Unlock()
		return md.Name, nil
	}
	delete(a.removed, md.Name) // this agent wants the peer again
	a.mu.Unlock()
	if err := a.dropRemote(md.Name, fmt.Errorf("agent %q: remote agent %q was added again (new metadata)", a.cfg.Name, md.Name)); err != nil && !errors.Is(err, ErrUnknownAgent) {
		a.log.Warn("replacing a remote agent: its old requests did not stop cleanly", "peer", md.Name, "err", err)
	}
	cctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	pl, err := call(cctx, a.zctx, md.Control, &request{Type: msgHello, From: a.cfg.Name, Instance: a.instance, To: md.Name})
	cancel()
	if err != nil {
		return "", fmt.Errorf("agent %q: add remote agent %q: %w", a.cfg.Name, md.Name, err)
	}
	if len(pl) != 2 {
		return "", fmt.Errorf("agent %q: add remote agent %q: HELLO answer has %d frames, want 2 (peer id, epoch)", a.cfg.Name, md.Name, len(pl))
	}
	peer := string(pl[0])
	epoch, perr := strconv.ParseUint(string(pl[1]), 10, 64)
	if perr != nil || peer == "" {
		return "", fmt.Errorf("agent %q: add remote agent %q: HELLO answer peer %q epoch %q is malformed", a.cfg.Name, md.Name, peer, pl[1])
	}
	seg, err := a.te.OpenSegmentWith(ctx, md.Segment, segengine.SegmentOptions{Peer: peer, Epoch: epoch})
	if err != nil {
		return "", fmt.Errorf("agent %q: add remote agent %q: %w", a.cfg.Name, md.Name, err)
	}
	if seg.Epoch() != md.Instance {
		_ = seg.Close()
		return "", fmt.Errorf("agent %q: add remote agent %q: its segment has instance %#x, the metadata says %#x (the peer restarted: fetch its metadata again): %w", a.cfg.Name, md.Name, seg.Epoch(), md.Instance, segengine.ErrSegmentStale)
	}
	cctx, cancel = context.WithTimeout(ctx, a.cfg.Timeout)
	_, err = call(cctx, a.zctx, md.Control, &request{Type: msgOpened, From: a.cfg.Name, Instance: a.instance, To: md.Name, Peer: peer, Epoch: epoch})
	cancel()
	if err != nil {
		_ = seg.Close()
		return "", fmt.Errorf("agent %q: add remote agent %q: %w", a.cfg.Name, md.Name, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		_ = seg.Close()
		return "", fmt.Errorf("agent %q: add remote agent %q: agent %w", a.cfg.Name, md.Name, transport.ErrClosed)
	}
	if old := a.remotes[md.Name]; old != nil { // a concurrent add won
		_ = seg.Close()
		return md.Name, nil
	}
	a.remotes[md.Name] = &remote{md: md, conn: &peerConn{zctx: a.zctx, addr: md.Control}, seg: seg, xfers: map[*xfer]struct{}{}}
	return md.Name, nil
}

// RemoveRemoteAgent forgets a remote agent (remove_remote_agent) and fences
// it: this agent's requests to it are cancelled (and waited for), its
// segment is closed, and its own data path into this agent's memory is cut
// (FenceEpoch), so its later transfers fail and its notifications and HELLO
// are refused until this agent adds it again. Prepared lists naming it stay
// (release them) but make no transfer. Errors: ErrUnknownAgent (neither
// added nor ever connected), a fence that did not complete (the error says
// which; the caller keeps the memory quarantined and calls again).
func (a *Agent) RemoveRemoteAgent(ctx context.Context, name string) error {
	a.mu.Lock()
	ins := a.inbound[name]
	delete(a.inbound, name)
	if len(ins) > 0 {
		a.removed[name] = ins[len(ins)-1].instance
	}
	_, added := a.remotes[name]
	a.mu.Unlock()
	var errs []error
	if added {
		if err := a.dropRemote(name, fmt.Errorf("agent %q: remote agent %q was removed: %w", a.cfg.Name, name, ErrUnknownAgent)); err != nil {
			errs = append(errs, err)
		}
	}
	for _, in := range ins {
		if err := a.fence(ctx, name, in); err != nil {
			errs = append(errs, err)
		}
	}
	if !added && len(ins) == 0 {
		return fmt.Errorf("agent %q: remove remote agent %q: %w (never added, or removed already)", a.cfg.Name, name, ErrUnknownAgent)
	}
	return errors.Join(errs...)
}

// fence cuts an inbound data path.
func (a *Agent) fence(ctx context.Context, name string, in *inbound) error {
	if a.fencer == nil || in.epoch == 0 {
		return nil
	}
	if a.handshk && !in.admitted {
		// Bind the epoch to whatever QPs were prepared, so the fence
		// destroys them (no QPs: nothing to cut).
		_ = a.fencer.AdmitEpoch(in.peer, in.epoch)
	}
	if err := a.fencer.FenceEpoch(ctx, in.peer, in.epoch); err != nil {
		return fmt.Errorf("agent %q: remove remote agent %q: fence its data path (epoch %d): %w", a.cfg.Name, name, in.epoch, err)
	}
	return nil
}

// dropRemote cancels the requests to an added remote agent, closes its
// segment and deletes it. reason is what its requests report.
func (a *Agent) dropRemote(name string, reason error) error {
	a.mu.Lock()
	r := a.remotes[name]
	delete(a.remotes, name)
	var xs []*xfer
	if r != nil {
		for x := range r.xfers {
			xs = append(xs, x)
		}
	}
	a.mu.Unlock()
	if r == nil {
		return fmt.Errorf("agent %q: remote agent %q: %w", a.cfg.Name, name, ErrUnknownAgent)
	}
	var errs []error
	for _, x := range xs {
		if err := a.stop(x, reason); err != nil {
			errs = append(errs, err)
		}
	}
	r.conn.close()
	if err := r.seg.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// RemoteAgents returns the names of the added remote agents.
func (a *Agent) RemoteAgents() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]string, 0, len(a.remotes))
	for n := range a.remotes {
		out = append(out, n)
	}
	return out
}

// RemoteRegions returns the regions an added remote agent registered, as
// its segment RPC last described them, sorted by address. Errors:
// ErrUnknownAgent.
func (a *Agent) RemoteRegions(name string) ([]transport.RegionDesc, error) {
	a.mu.Lock()
	r := a.remotes[name]
	a.mu.Unlock()
	if r == nil {
		return nil, fmt.Errorf("agent %q: regions of %q: %w", a.cfg.Name, name, ErrUnknownAgent)
	}
	return r.seg.Descriptor().Regions, nil
}

// handle answers a control request.
func (a *Agent) handle(req *request) ([][]byte, error) {
	if req.To != a.cfg.Name {
		return nil, fmt.Errorf("this is agent %q, not %q (stale metadata? fetch it again)", a.cfg.Name, req.To)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, fmt.Errorf("agent %q is closing", a.cfg.Name)
	}
	if inst, ok := a.removed[req.From]; ok && inst == req.Instance {
		return nil, fmt.Errorf("agent %q removed agent %q (remove_remote_agent): its transfers and notifications are refused until %q adds it again", a.cfg.Name, req.From, a.cfg.Name)
	}
	switch req.Type {
	case msgHello:
		a.seq++
		in := &inbound{instance: req.Instance, peer: fmt.Sprintf("agent:%s#%x.%d", req.From, req.Instance&0xffffffff, a.seq)}
		if a.fencer != nil {
			in.epoch = transport.NewEpoch()
			if !a.handshk {
				if err := a.fencer.AdmitEpoch(in.peer, in.epoch); err != nil {
					return nil, fmt.Errorf("agent %q: admit a data path for %q: %w", a.cfg.Name, req.From, err)
				}
				in.admitted = true
			}
		}
		// A new HELLO replaces the peer's older paths: it adds one agent at a
		// time and only after it dropped the previous add (or restarted).
		for _, old := range a.inbound[req.From] {
			go func(old *inbound) { // no longer used by the peer; cut it
				ctx, cancel := context.WithTimeout(context.Background(), a.cfg.DrainTimeout)
				defer cancel()
				if err := a.fence(ctx, req.From, old); err != nil {
					a.log.Warn("fencing a restarted peer's old data path failed", "peer", req.From, "err", err)
				}
			}(old)
		}
		a.inbound[req.From] = []*inbound{in}
		return [][]byte{[]byte(in.peer), []byte(strconv.FormatUint(in.epoch, 10))}, nil
	case msgOpened:
		in := a.findInbound(req.From, req.Instance, req.Peer)
		if in == nil || in.epoch != req.Epoch {
			return nil, fmt.Errorf("agent %q: OPENED from %q for peer %q epoch %d: no such data path (removed meanwhile?)", a.cfg.Name, req.From, req.Peer, req.Epoch)
		}
		if a.fencer != nil && a.handshk && !in.admitted {
			if err := a.fencer.AdmitEpoch(in.peer, in.epoch); err != nil {
				return nil, fmt.Errorf("agent %q: admit the data path of %q: %w", a.cfg.Name, req.From, err)
			}
			in.admitted = true
		}
		return nil, nil
	case msgNotif:
		if a.findInbound(req.From, req.Instance, "") == nil {
			return nil, fmt.Errorf("agent %q does not know agent %q (instance %#x): it must add this agent (add_remote_agent) before notifying it: %w", a.cfg.Name, req.From, req.Instance, ErrUnknownAgent)
		}
		if a.notifN[req.From] >= a.cfg.MaxNotifs {
			return nil, fmt.Errorf("agent %q holds %d unread notifications from %q: %w", a.cfg.Name, a.notifN[req.From], req.From, ErrNotifQueueFull)
		}
		a.notifs[req.From] = append(a.notifs[req.From], req.Msg)
		a.notifN[req.From]++
		close(a.notifSig)
		a.notifSig = make(chan struct{})
		return nil, nil
	}
	return nil, fmt.Errorf("unknown request %q", req.Type)
}

func (a *Agent) findInbound(name string, instance uint64, peer string) *inbound {
	for _, in := range a.inbound[name] {
		if in.instance == instance && (peer == "" || in.peer == peer) {
			return in
		}
	}
	return nil
}

// GetNotifs returns the notifications received since the last call, by
// sending agent, each agent's in arrival order (get_new_notifs), and
// forgets them.
func (a *Agent) GetNotifs() map[string][][]byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := a.notifs
	a.notifs = map[string][][]byte{}
	a.notifN = map[string]int{}
	return out
}

// NotifSignal returns a channel closed when the next notification arrives
// (for callers that wait instead of polling GetNotifs).
func (a *Agent) NotifSignal() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.notifSig
}

// SendNotif sends msg to an added remote agent on its own (send_notif),
// and returns once the peer queued it. Errors: ErrUnknownAgent, a message
// longer than MaxNotifBytes, ErrRefused (the peer removed this agent, or
// its queue is full), ErrAgentUnreachable.
func (a *Agent) SendNotif(ctx context.Context, name string, msg []byte) error {
	if len(msg) > MaxNotifBytes {
		return fmt.Errorf("agent %q: send notification to %q: %d bytes, longer than %d", a.cfg.Name, name, len(msg), MaxNotifBytes)
	}
	a.mu.Lock()
	r := a.remotes[name]
	a.mu.Unlock()
	if r == nil {
		return fmt.Errorf("agent %q: send notification to %q: %w (add it with its metadata first)", a.cfg.Name, name, ErrUnknownAgent)
	}
	return a.notify(ctx, r, msg)
}

func (a *Agent) notify(ctx context.Context, r *remote, msg []byte) error {
	cctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	_, err := r.conn.call(cctx, &request{Type: msgNotif, From: a.cfg.Name, Instance: a.instance, To: r.md.Name, Msg: msg})
	if err != nil {
		return fmt.Errorf("agent %q: notify %q: %w", a.cfg.Name, r.md.Name, err)
	}
	return nil
}

// PrepDlist prepares a descriptor list (prep_xfer_dlist). agent is
// LocalAgent (or "") for this agent's memory: every descriptor must lie in
// memory registered here, of kind kind. Otherwise agent names an added
// remote agent: every descriptor must lie in a region it registered
// (refreshed from its segment RPC once when one misses). Errors wrap
// ErrBadDescriptor or ErrUnknownAgent and name the descriptor's index.
func (a *Agent) PrepDlist(ctx context.Context, agent string, kind transport.MemoryKind, descs []Desc) (DlistHandle, error) {
	if agent == LocalAgent {
		agent = ""
	}
	if err := a.usable("prepare descriptor list"); err != nil {
		return 0, err
	}
	var seg *segengine.RemoteSegment
	var inst uint64
	regions := make([]transport.RegionID, len(descs))
	if agent != "" {
		a.mu.Lock()
		r := a.remotes[agent]
		a.mu.Unlock()
		if r == nil {
			return 0, fmt.Errorf("agent %q: prepare descriptor list for %q: %w (add it with its metadata first, or name %q for local memory)", a.cfg.Name, agent, ErrUnknownAgent, LocalAgent)
		}
		seg, inst = r.seg, r.md.Instance
	}
	for i, d := range descs {
		if d.Len == 0 || d.Addr+d.Len < d.Addr {
			return 0, fmt.Errorf("agent %q: descriptor %d [%#x, +%d bytes): %w: empty or wrapping", a.cfg.Name, i, d.Addr, d.Len, ErrBadDescriptor)
		}
		if seg == nil {
			m, rd, ok := a.te.LocalRegion(uintptr(d.Addr), d.Len)
			if !ok {
				return 0, fmt.Errorf("agent %q: local descriptor %d [%#x, +%d bytes): %w: %w with this agent (register_memory first)", a.cfg.Name, i, d.Addr, d.Len, ErrBadDescriptor, ErrNotRegistered)
			}
			if m.Kind != kind {
				return 0, fmt.Errorf("agent %q: local descriptor %d [%#x, +%d bytes): %w: the list is %s memory, the registered range is %s", a.cfg.Name, i, d.Addr, d.Len, ErrBadDescriptor, kind, m.Kind)
			}
			regions[i] = rd.ID
			continue
		}
		id, _, err := seg.Translate(ctx, d.Addr, d.Len)
		if err != nil {
			return 0, fmt.Errorf("agent %q: descriptor %d of remote agent %q: %w: %w", a.cfg.Name, i, agent, ErrBadDescriptor, err)
		}
		regions[i] = id
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	h := DlistHandle(a.next())
	a.dlists[h] = &dlist{agent: agent, inst: inst, kind: kind, descs: append([]Desc(nil), descs...), regions: regions}
	return h, nil
}

// ReleaseDlist forgets a prepared list (release_dlist_handle); requests
// made from it keep working. Errors: an unknown handle.
func (a *Agent) ReleaseDlist(h DlistHandle) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.dlists[h]; !ok {
		return fmt.Errorf("agent %q: release descriptor list %d: %w", a.cfg.Name, h, ErrBadHandle)
	}
	delete(a.dlists, h)
	return nil
}

// MakeXfer makes a transfer request from two prepared lists addressed by
// index (make_prepped_xfer): local[localIdx[i]] pairs with
// remote[remoteIdx[i]], both of the same length; op READ copies the remote
// descriptors into the local ones, WRITE the other way. notif, when not
// empty, is delivered to the remote agent once the data landed. Adjacent
// pairs (both sides contiguous) are merged into one request. Errors:
// unknown handles (ErrBadHandle), a local list that names an agent or a
// remote list that does not, a removed agent (ErrUnknownAgent), index
// counts that differ or are 0, an index out of range (ErrBadIndex, naming
// the list, the position and the list's length), pairs of different
// lengths (ErrBadDescriptor), a notification longer than MaxNotifBytes.
func (a *Agent) MakeXfer(op Op, local DlistHandle, localIdx []int, remoteH DlistHandle, remoteIdx []int, notif []byte) (XferHandle, error) {
	if op != OpRead && op != OpWrite {
		return 0, fmt.Errorf("agent %q: make transfer: operation %v: want READ or WRITE", a.cfg.Name, op)
	}
	if len(notif) > MaxNotifBytes {
		return 0, fmt.Errorf("agent %q: make transfer: notification of %d bytes, longer than %d", a.cfg.Name, len(notif), MaxNotifBytes)
	}
	if len(localIdx) != len(remoteIdx) || len(localIdx) == 0 {
		return 0, fmt.Errorf("agent %q: make transfer: %d local and %d remote indices: %w: want the same number, at least 1", a.cfg.Name, len(localIdx), len(remoteIdx), ErrBadIndex)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return 0, fmt.Errorf("agent %q: make transfer: agent %w", a.cfg.Name, transport.ErrClosed)
	}
	ld, rd := a.dlists[local], a.dlists[remoteH]
	switch {
	case ld == nil:
		return 0, fmt.Errorf("agent %q: make transfer: local descriptor list %d: %w", a.cfg.Name, local, ErrBadHandle)
	case rd == nil:
		return 0, fmt.Errorf("agent %q: make transfer: remote descriptor list %d: %w", a.cfg.Name, remoteH, ErrBadHandle)
	case ld.agent != "":
		return 0, fmt.Errorf("agent %q: make transfer: the local list %d was prepared for remote agent %q (prepare it with %q)", a.cfg.Name, local, ld.agent, LocalAgent)
	case rd.agent == "":
		return 0, fmt.Errorf("agent %q: make transfer: the remote list %d was prepared for local memory (prepare it with the remote agent's name)", a.cfg.Name, remoteH)
	}
	rem := a.remotes[rd.agent]
	if rem == nil {
		return 0, fmt.Errorf("agent %q: make transfer to %q: %w (removed after its list was prepared? add it again)", a.cfg.Name, rd.agent, ErrUnknownAgent)
	}
	if err := a.sameInstance(rd.agent, rd.inst, rem); err != nil {
		return 0, fmt.Errorf("agent %q: make transfer: remote list %d: %w", a.cfg.Name, remoteH, err)
	}
	x := &xfer{op: op, agent: rd.agent, inst: rd.inst, descs: len(localIdx), notif: append([]byte(nil), notif...)}
	var cur *segengine.PeerRead
	var reqs []segengine.PeerRead
	var curL, curR transport.RegionID
	for i := range localIdx {
		li, ri := localIdx[i], remoteIdx[i]
		if li < 0 || li >= len(ld.descs) {
			return 0, fmt.Errorf("agent %q: make transfer: local index %d at position %d: %w: the local list %d has %d descriptors", a.cfg.Name, li, i, ErrBadIndex, local, len(ld.descs))
		}
		if ri < 0 || ri >= len(rd.descs) {
			return 0, fmt.Errorf("agent %q: make transfer: remote index %d at position %d: %w: the list %d of %q has %d descriptors", a.cfg.Name, ri, i, ErrBadIndex, remoteH, rd.agent, len(rd.descs))
		}
		l, r := ld.descs[li], rd.descs[ri]
		if l.Len != r.Len {
			return 0, fmt.Errorf("agent %q: make transfer: position %d pairs local descriptor %d (%d bytes) with remote descriptor %d (%d bytes): %w: lengths differ", a.cfg.Name, i, li, l.Len, ri, r.Len, ErrBadDescriptor)
		}
		x.bytes += l.Len
		lr, rr := ld.regions[li], rd.regions[ri]
		if cur != nil && uint64(cur.Local)+cur.Length == l.Addr && cur.PeerAddr+cur.Length == r.Addr && lr == curL && rr == curR {
			cur.Length += l.Len // adjacent on both sides, in the same regions
			continue
		}
		reqs = append(reqs, segengine.PeerRead{Local: uintptr(l.Addr), PeerAddr: r.Addr, Length: l.Len})
		cur, curL, curR = &reqs[len(reqs)-1], lr, rr
	}
	if op == OpRead {
		x.reads = reqs
	} else {
		for _, r := range reqs {
			x.writes = append(x.writes, segengine.PeerWrite{Local: r.Local, PeerAddr: r.PeerAddr, Length: r.Length})
		}
	}
	x.h = XferHandle(a.next())
	a.xfers[x.h] = x
	return x.h, nil
}

// Post starts a transfer request (transfer): it submits the batch and
// returns XferProc; a goroutine waits for it, sends the notification (notif
// when not nil, else the request's) once the data landed, and sets the
// state. A request may be posted again once it is not PROC. Errors:
// ErrBadHandle, ErrBusy, ErrUnknownAgent (its agent was removed), the
// submit's errors (then the state is XferErr and nothing moved).
func (a *Agent) Post(h XferHandle, notif []byte) (XferState, error) {
	if len(notif) > MaxNotifBytes {
		return XferErr, fmt.Errorf("agent %q: post transfer %d: notification of %d bytes, longer than %d", a.cfg.Name, h, len(notif), MaxNotifBytes)
	}
	a.mu.Lock()
	x := a.xfers[h]
	if x == nil {
		a.mu.Unlock()
		return XferErr, fmt.Errorf("agent %q: post transfer %d: %w (released?)", a.cfg.Name, h, ErrBadHandle)
	}
	if x.active {
		a.mu.Unlock()
		return XferProc, fmt.Errorf("agent %q: post transfer %d: %w", a.cfg.Name, h, ErrBusy)
	}
	r := a.remotes[x.agent]
	if r == nil || r.dead != nil {
		err := fmt.Errorf("agent %q: post transfer %d to %q: %w (removed, or its segment was closed to stop a request: add it again)", a.cfg.Name, h, x.agent, ErrUnknownAgent)
		x.state, x.err = XferErr, err
		a.mu.Unlock()
		return XferErr, err
	}
	if err := a.sameInstance(x.agent, x.inst, r); err != nil {
		err = fmt.Errorf("agent %q: post transfer %d: %w", a.cfg.Name, h, err)
		x.state, x.err = XferErr, err
		a.mu.Unlock()
		return XferErr, err
	}
	if notif != nil {
		x.notif = append([]byte(nil), notif...)
	}
	x.gen++
	gen := x.gen
	x.active, x.stop, x.why, x.notifying = true, false, nil, false
	x.state, x.err = XferProc, nil
	x.seg = r.seg
	x.start, x.end, x.post = time.Now(), time.Time{}, 0
	x.done = make(chan struct{})
	r.xfers[x] = struct{}{}
	seg := r.seg
	a.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.Timeout)
	var id transport.BatchID
	var err error
	if x.op == OpRead {
		id, err = seg.SubmitPeerReads(ctx, x.reads)
	} else {
		id, err = seg.SubmitPeerWrites(ctx, x.writes)
	}
	cancel()
	a.mu.Lock()
	x.post = time.Since(x.start)
	if err != nil {
		err = fmt.Errorf("agent %q: post %v transfer %d (%d bytes) to %q: %w", a.cfg.Name, x.op, h, x.bytes, x.agent, err)
		a.finishLocked(x, r, XferErr, err)
		a.mu.Unlock()
		return XferErr, err
	}
	x.batch = id
	a.mu.Unlock()
	go a.run(x, r, gen, seg, id)
	return XferProc, nil
}

// sameInstance fails when remote agent name was added again with another
// instance (it restarted) since a list was prepared against inst: the
// addresses it names belong to the dead process.
func (a *Agent) sameInstance(name string, inst uint64, r *remote) error {
	if r.md.Instance == inst {
		return nil
	}
	return fmt.Errorf("prepared for instance %#x of agent %q, which restarted (now %#x): prepare the lists again from its new metadata: %w: %w",
		inst, name, r.md.Instance, segengine.ErrSegmentStale, transport.ErrPeerLost)
}

// finishLocked ends a post (under a.mu).
func (a *Agent) finishLocked(x *xfer, r *remote, st XferState, err error) {
	x.state, x.err = st, err
	x.end = time.Now()
	x.active, x.notifying = false, false
	delete(r.xfers, x)
	close(x.done)
}

// run waits for a posted batch, then notifies.
func (a *Agent) run(x *xfer, r *remote, gen uint64, seg *segengine.RemoteSegment, id transport.BatchID) {
	md := r.md
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.TransferTimeout)
	defer cancel()
	st, werr := seg.Wait(ctx, id)
	if werr != nil { // deadline: stop the batch before reporting
		_ = seg.Cancel(id)
		dctx, dcancel := context.WithTimeout(context.Background(), a.cfg.DrainTimeout)
		st2, err2 := seg.Wait(dctx, id)
		dcancel()
		if err2 != nil || !st2.State.Terminal() {
			a.kill(r, fmt.Errorf("agent %q: a timed-out transfer to %q did not stop within %v; its segment was closed", a.cfg.Name, md.Name, a.cfg.DrainTimeout))
		}
	}
	seg.Release(id)
	a.mu.Lock()
	if x.gen != gen {
		a.mu.Unlock()
		return
	}
	switch {
	case x.stop && x.why != nil:
		a.finishLocked(x, r, XferErr, x.why)
		a.mu.Unlock()
		return
	case x.stop:
		a.finishLocked(x, r, XferCanceled, fmt.Errorf("agent %q: %v transfer %d to %q: %w", a.cfg.Name, x.op, x.h, x.agent, transport.ErrCanceled))
		a.mu.Unlock()
		return
	case werr != nil:
		a.finishLocked(x, r, XferErr, fmt.Errorf("agent %q: %v transfer %d (%d bytes) to %q did not finish within %v: %w", a.cfg.Name, x.op, x.h, x.bytes, x.agent, a.cfg.TransferTimeout, werr))
		a.mu.Unlock()
		return
	case st.State != transport.BatchCompleted:
		a.finishLocked(x, r, XferErr, fmt.Errorf("agent %q: %v transfer %d (%d bytes) to %q %v after %d bytes: %w", a.cfg.Name, x.op, x.h, x.bytes, x.agent, st.State, st.BytesDone, st.Err))
		a.mu.Unlock()
		return
	case len(x.notif) == 0:
		a.finishLocked(x, r, XferDone, nil)
		a.mu.Unlock()
		return
	}
	x.notifying = true
	msg := x.notif
	a.mu.Unlock()
	err := a.notify(ctx, r, msg)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.finishLocked(x, r, XferErr, fmt.Errorf("agent %q: %v transfer %d: the data landed but the notification was not delivered: %w", a.cfg.Name, x.op, x.h, err))
		return
	}
	a.finishLocked(x, r, XferDone, nil)
}

// kill closes a remote agent's segment so that no batch of it moves a byte
// any more; its requests fail and it must be added again.
func (a *Agent) kill(r *remote, reason error) {
	a.mu.Lock()
	if r.dead == nil {
		r.dead = reason
	}
	a.mu.Unlock()
	a.log.Warn("segment closed to stop a transfer", "peer", r.md.Name, "reason", reason)
	_ = r.seg.Close()
}

// State returns a transfer's state (check_xfer_state) and, for every
// state but XferProc and XferDone, why: the transfer's error, or one
// wrapping ErrBadHandle for a handle that is not (or no longer) this
// agent's.
func (a *Agent) State(h XferHandle) (XferState, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	x := a.xfers[h]
	if x == nil {
		return XferErr, fmt.Errorf("agent %q: transfer %d: %w (released?)", a.cfg.Name, h, ErrBadHandle)
	}
	if x.state == XferNotPosted {
		return XferNotPosted, fmt.Errorf("agent %q: transfer %d was never posted", a.cfg.Name, h)
	}
	return x.state, x.err
}

// Wait blocks until the transfer's current post ends or ctx ends, and
// returns its state (for Go callers; NIXL's callers poll State).
func (a *Agent) Wait(ctx context.Context, h XferHandle) (XferState, error) {
	a.mu.Lock()
	x := a.xfers[h]
	if x == nil {
		a.mu.Unlock()
		return XferErr, fmt.Errorf("agent %q: wait for transfer %d: %w", a.cfg.Name, h, ErrBadHandle)
	}
	done := x.done
	a.mu.Unlock()
	if done != nil {
		select {
		case <-done:
		case <-ctx.Done():
			return XferProc, ctx.Err()
		}
	}
	return a.State(h)
}

// Telemetry returns the last post's telemetry (get_xfer_telemetry).
// Errors: ErrBadHandle, a request never posted.
func (a *Agent) Telemetry(h XferHandle) (Telemetry, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	x := a.xfers[h]
	if x == nil {
		return Telemetry{}, fmt.Errorf("agent %q: telemetry of transfer %d: %w", a.cfg.Name, h, ErrBadHandle)
	}
	if x.start.IsZero() {
		return Telemetry{}, fmt.Errorf("agent %q: telemetry of transfer %d: never posted", a.cfg.Name, h)
	}
	end := x.end
	if end.IsZero() {
		end = time.Now()
	}
	return Telemetry{Start: x.start, Post: x.post, Xfer: end.Sub(x.start), Bytes: x.bytes, Descs: x.descs}, nil
}

// Cancel stops an in-flight transfer: when it returns, the request moves
// no byte and sends no notification any more. It returns the final state:
// XferCanceled, or XferDone/XferErr when the transfer ended first (a
// notification already on its way is waited for). A batch that does not
// stop within DrainTimeout closes the segment to its agent (add it again).
// Errors: ErrBadHandle.
func (a *Agent) Cancel(h XferHandle) (XferState, error) {
	a.mu.Lock()
	x := a.xfers[h]
	a.mu.Unlock()
	if x == nil {
		return XferErr, fmt.Errorf("agent %q: cancel transfer %d: %w", a.cfg.Name, h, ErrBadHandle)
	}
	if err := a.stop(x, nil); err != nil {
		return XferErr, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return x.state, nil
}

// stop cancels x's post (if any) and waits until it ended.
func (a *Agent) stop(x *xfer, reason error) error {
	a.mu.Lock()
	if !x.active {
		a.mu.Unlock()
		return nil
	}
	x.stop, x.why = true, reason
	seg, id, done, notifying := x.seg, x.batch, x.done, x.notifying
	r := a.remotes[x.agent]
	a.mu.Unlock()
	if !notifying && id != 0 {
		_ = seg.Cancel(id)
	}
	t := time.NewTimer(a.cfg.DrainTimeout)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
	}
	if r == nil || r.seg != seg { // removed or re-added meanwhile: close the segment this post used
		_ = seg.Close()
	} else {
		a.kill(r, fmt.Errorf("agent %q: transfer %d to %q did not stop within %v of its cancel", a.cfg.Name, x.h, x.agent, a.cfg.DrainTimeout))
	}
	select {
	case <-done:
		return nil
	case <-time.After(a.cfg.DrainTimeout):
		return fmt.Errorf("agent %q: transfer %d to %q: did not stop within %v even after its segment was closed", a.cfg.Name, x.h, x.agent, 2*a.cfg.DrainTimeout)
	}
}

// Release forgets a transfer request (release_xfer_handle), cancelling it
// first when it is in flight (see Cancel). Errors: ErrBadHandle, a request
// that could not be stopped (then it is kept).
func (a *Agent) Release(h XferHandle) error {
	a.mu.Lock()
	x := a.xfers[h]
	a.mu.Unlock()
	if x == nil {
		return fmt.Errorf("agent %q: release transfer %d: %w (released twice?)", a.cfg.Name, h, ErrBadHandle)
	}
	if err := a.stop(x, nil); err != nil {
		return err
	}
	a.mu.Lock()
	delete(a.xfers, h)
	a.mu.Unlock()
	return nil
}

// Close cancels every in-flight request, closes the remote segments, the
// control channel, the engine and the transport. Idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	var xs []*xfer
	for _, x := range a.xfers {
		xs = append(xs, x)
	}
	a.mu.Unlock()
	for _, x := range xs {
		_ = a.stop(x, nil)
	}
	a.mu.Lock()
	for _, r := range a.remotes {
		r.conn.close() // before the zmq context terminates
	}
	a.mu.Unlock()
	a.ctl.Close()
	err := a.te.Close()
	_ = a.zctx.Term()
	return err
}
