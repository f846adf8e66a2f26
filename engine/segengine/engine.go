package segengine

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// TransferEngineConfig configures a TransferEngine.
type TransferEngineConfig struct {
	// Transport is the opened transport the engine moves bytes with
	// (required). The engine owns it from NewTransferEngine on: Close closes
	// it, and NewTransferEngine closes it when it fails.
	Transport transport.Transport
	// LocalHostname is Mooncake's local_hostname: "host" or "host:port". The
	// host is where the segment RPC listener binds and what the default
	// segment name and the published RPC address carry; a wildcard
	// (0.0.0.0, ::) binds every interface and advertises AdvertiseHost, or
	// else the default-route interface's address (loopback only when the
	// host has no other, with a warning), the KV manager's rule.
	// The port is the RPC port (absent or 0: a free port, see RPCPort).
	// Default "127.0.0.1".
	LocalHostname string
	// SegmentName is the name peers open; default "host:rpc_port"
	// (Mooncake's P2PHANDSHAKE naming). With a Directory any unique string
	// works; without one, peers must be able to dial the name, so leave it
	// empty.
	SegmentName string
	// AdvertiseHost, when set, is the host the segment name and published
	// RPC address carry instead of the bind host (a wildcard bind needs it
	// when the default-route interface is not the one peers reach).
	AdvertiseHost string
	// Directory, when set, is where the engine publishes its descriptor
	// (etcd) and where OpenSegment resolves names; nil is P2P. The engine
	// does not close it.
	Directory transport.SegmentDirectory
	// RPCTimeout bounds each segment RPC request and directory call made by
	// the engine (default DefaultRPCTimeout).
	RPCTimeout time.Duration
	// Devices are the NIC/GPU names to list in the descriptor (informational).
	Devices []string
	// Logger receives the engine's logs (slog.Default when nil).
	Logger *slog.Logger
	// OnSubmit, when set, is told of every accepted batch's request and
	// descriptor counts (a SubmitObserver: how the C library exports
	// them as Prometheus counters). nil: counted (CoalesceStats) only.
	OnSubmit SubmitObserver
}

// regionEntry is one registered local region.
type regionEntry struct {
	mem  transport.Memory
	desc transport.RegionDesc
}

// TransferEngine is one node of the Mooncake-style transfer API: a
// transport, the memory registered with it, a segment name and epoch, a
// segment RPC listener that hands peers this engine's SegmentDescriptor, and
// optionally a SegmentDirectory it publishes to. Senders open a peer's
// segment by name with OpenSegment and write to it by region or by the
// peer's virtual address.
//
// A TransferEngine is safe for concurrent use. Close it once done
// (idempotent); it closes its transport and the segments it opened.
type TransferEngine struct {
	cfg     TransferEngineConfig
	tr      transport.Transport
	caps    transport.Caps
	log     *slog.Logger
	name    string
	epoch   uint64
	rpcHost string // advertised
	zctx    *zmq.Context
	rpc     *rpcListener
	client  *rpcClient
	shared  []byte // the transport's endpoint when it is not per peer
	timeout time.Duration
	connSeq atomic.Uint64
	met     *teMetrics

	mu      sync.Mutex
	closed  bool
	regions map[transport.RegionID]regionEntry
	segs    map[*RemoteSegment]struct{}
	watches map[string]*segWatch

	pubKick chan struct{}
	pubDone chan struct{}
	stop    chan struct{}
}

// segWatch is one directory watch shared by the segments open to a name.
type segWatch struct {
	stop func()
	segs map[*RemoteSegment]struct{}
}

// NewTransferEngine starts the segment RPC listener, chooses the epoch and,
// with a Directory, publishes the descriptor (failing with an error that
// wraps ErrMetadataUnavailable and names the store when it cannot). Errors
// also: no transport, a LocalHostname that is not host or host:port, an RPC
// bind failure (port in use, host not local).
func NewTransferEngine(ctx context.Context, cfg TransferEngineConfig) (te *TransferEngine, err error) {
	if cfg.Transport == nil {
		return nil, errors.New("engine: transfer engine: a transport is required (engine.OpenTransport)")
	}
	defer func() {
		if err != nil {
			_ = cfg.Transport.Close()
		}
	}()
	host, port, err := splitLocalHostname(cfg.LocalHostname)
	if err != nil {
		return nil, err
	}
	if cfg.RPCTimeout <= 0 {
		cfg.RPCTimeout = DefaultRPCTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	te = &TransferEngine{
		cfg: cfg, tr: cfg.Transport, caps: cfg.Transport.Capabilities(), timeout: cfg.RPCTimeout,
		regions: map[transport.RegionID]regionEntry{}, segs: map[*RemoteSegment]struct{}{}, watches: map[string]*segWatch{},
		pubKick: make(chan struct{}, 1), pubDone: make(chan struct{}), stop: make(chan struct{}),
	}
	te.epoch = newEpoch()
	te.met = &teMetrics{observe: cfg.OnSubmit}
	if !te.caps.Has(transport.CapHandshake) {
		ectx, cancel := context.WithTimeout(ctx, cfg.RPCTimeout)
		te.shared, err = te.tr.Endpoint(ectx, "")
		cancel()
		if err != nil {
			return nil, fmt.Errorf("engine: transfer engine: %s endpoint: %w", te.tr.Name(), err)
		}
	}
	if te.zctx, err = zmq.NewContext(); err != nil {
		return nil, fmt.Errorf("engine: transfer engine: zmq context: %w", err)
	}
	te.client = &rpcClient{zctx: te.zctx}
	te.rpcHost = hostaddr.Advertise(cfg.AdvertiseHost, host, "segment RPC listener", cfg.Logger)
	te.rpc, err = listenRPC(te.zctx, host, port, te.handleRPC, cfg.RPCTimeout, cfg.Logger)
	if err != nil {
		_ = te.zctx.Term()
		return nil, err
	}
	te.name = cfg.SegmentName
	if te.name == "" {
		te.name = te.RPCAddr()
	}
	te.log = cfg.Logger.With("segment", te.name)
	if cfg.Directory != nil {
		pctx, cancel := context.WithTimeout(ctx, cfg.RPCTimeout)
		d := te.publishedDescriptor()
		err = cfg.Directory.Publish(pctx, d)
		cancel()
		if err != nil {
			te.rpc.Close()
			_ = te.zctx.Term()
			return nil, fmt.Errorf("engine: transfer engine %q: publish segment descriptor: %w", te.name, err)
		}
		go te.publisher()
	} else {
		close(te.pubDone)
	}
	te.log.Debug("transfer engine ready", "epoch", te.epoch, "rpc", te.RPCAddr(), "transport", te.tr.Name(), "directory", te.directoryName())
	return te, nil
}

// splitLocalHostname parses "host" or "host:port" ("" = 127.0.0.1).
func splitLocalHostname(s string) (string, int, error) {
	if s == "" {
		return "127.0.0.1", 0, nil
	}
	if ip := net.ParseIP(s); ip != nil { // a bare IPv6 address has colons
		return s, 0, nil
	}
	if h, p, err := net.SplitHostPort(s); err == nil {
		n, perr := strconv.Atoi(p)
		if perr != nil || n < 0 || n > 65535 || h == "" {
			return "", 0, fmt.Errorf("engine: local hostname %q: want host or host:port with a port 0..65535", s)
		}
		return h, n, nil
	}
	if s[0] == '[' {
		return "", 0, fmt.Errorf("engine: local hostname %q: want host, [ipv6]:port or host:port", s)
	}
	return s, 0, nil
}

// newEpoch returns a random non-zero epoch.
func newEpoch() uint64 {
	var b [8]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			// crypto/rand does not fail on Linux ≥ 3.17; fall back to time.
			return uint64(time.Now().UnixNano()) | 1
		}
		if v := binary.LittleEndian.Uint64(b[:]); v != 0 {
			return v
		}
	}
}

// Name returns the engine's segment name.
func (te *TransferEngine) Name() string { return te.name }

// Epoch returns the engine's incarnation (random, non-zero, new on every
// start).
func (te *TransferEngine) Epoch() uint64 { return te.epoch }

// RPCPort returns the port of the segment RPC listener (Mooncake's
// get_rpc_port).
func (te *TransferEngine) RPCPort() int { return te.rpc.Port }

// RPCAddr returns "host:rpc_port", the address peers dial (the default
// segment name).
func (te *TransferEngine) RPCAddr() string {
	return net.JoinHostPort(te.rpcHost, strconv.Itoa(te.rpc.Port))
}

// Transport returns the engine's transport.
func (te *TransferEngine) Transport() transport.Transport { return te.tr }

// Directory returns the configured directory (nil in P2P mode).
func (te *TransferEngine) Directory() transport.SegmentDirectory { return te.cfg.Directory }

func (te *TransferEngine) directoryName() string {
	if te.cfg.Directory == nil {
		return "p2p"
	}
	return te.cfg.Directory.String()
}

// RegisterMemory registers m with the transport and adds it to the
// engine's descriptor (published again when a Directory is set; peers with
// an open segment find it when a write misses: they refresh once). Errors:
// a closed engine, a range overlapping a registered region (peer virtual
// addresses must map to one region), and the transport's errors.
func (te *TransferEngine) RegisterMemory(m transport.Memory) (transport.RegionDesc, error) {
	if m.Length == 0 {
		return transport.RegionDesc{}, fmt.Errorf("engine: register memory at %#x: length is 0 bytes", m.Addr)
	}
	if uint64(m.Addr)+m.Length < uint64(m.Addr) {
		return transport.RegionDesc{}, fmt.Errorf("engine: register memory [%#x, +%d bytes): range wraps the address space", m.Addr, m.Length)
	}
	te.mu.Lock()
	defer te.mu.Unlock()
	if te.closed {
		return transport.RegionDesc{}, fmt.Errorf("engine: register memory: transfer engine %w", transport.ErrClosed)
	}
	for id, r := range te.regions {
		if m.Addr < r.mem.Addr+uintptr(r.mem.Length) && r.mem.Addr < m.Addr+uintptr(m.Length) {
			return transport.RegionDesc{}, fmt.Errorf("engine: register memory [%#x, +%d bytes): %w %d [%#x, +%d bytes); deregister it first or register one range covering both", m.Addr, m.Length, ErrRegionOverlap, id, r.mem.Addr, r.mem.Length)
		}
	}
	desc, err := te.tr.RegisterMemory(m)
	if err != nil {
		return transport.RegionDesc{}, err
	}
	te.regions[desc.ID] = regionEntry{mem: m, desc: desc}
	te.kickPublish()
	return desc, nil
}

// DeregisterMemory removes a region from the transport and the descriptor.
// Errors: a closed engine, a region this engine did not register, the
// transport's error.
func (te *TransferEngine) DeregisterMemory(id transport.RegionID) error {
	te.mu.Lock()
	defer te.mu.Unlock()
	if te.closed {
		return fmt.Errorf("engine: deregister region %d: transfer engine %w", id, transport.ErrClosed)
	}
	if _, ok := te.regions[id]; !ok {
		return fmt.Errorf("engine: deregister region %d: not registered with this engine (already deregistered?): %w", id, transport.ErrUnknownRegion)
	}
	delete(te.regions, id)
	te.kickPublish()
	return te.tr.DeregisterMemory(id)
}

// Regions returns the registered regions sorted by address.
func (te *TransferEngine) Regions() []transport.RegionDesc {
	te.mu.Lock()
	defer te.mu.Unlock()
	return te.regionsLocked()
}

func (te *TransferEngine) regionsLocked() []transport.RegionDesc {
	out := make([]transport.RegionDesc, 0, len(te.regions))
	for _, r := range te.regions {
		out = append(out, r.desc)
	}
	transport.SortRegions(out)
	return out
}

// LocalRegion returns the registered memory that holds [addr, addr+n)
// entirely, and false when none does.
func (te *TransferEngine) LocalRegion(addr uintptr, n uint64) (transport.Memory, transport.RegionDesc, bool) {
	te.mu.Lock()
	defer te.mu.Unlock()
	for _, r := range te.regions {
		m := r.mem
		if addr >= m.Addr && uint64(addr-m.Addr) <= m.Length && n <= m.Length-uint64(addr-m.Addr) {
			return m, r.desc, true
		}
	}
	return transport.Memory{}, transport.RegionDesc{}, false
}

// baseDescriptor is the descriptor without transport endpoints.
func (te *TransferEngine) baseDescriptor() transport.SegmentDescriptor {
	host, _ := os.Hostname()
	te.mu.Lock()
	regs := te.regionsLocked()
	te.mu.Unlock()
	return transport.SegmentDescriptor{Name: te.name, Epoch: te.epoch, RPC: te.RPCAddr(), Kind: "engine", Hostname: host, PID: os.Getpid(),
		Devices: te.cfg.Devices, Regions: regs}
}

// publishedDescriptor is the descriptor as stored in a directory: the
// shared endpoint, or none for a per-peer transport.
func (te *TransferEngine) publishedDescriptor() transport.SegmentDescriptor {
	d := te.baseDescriptor()
	d.Transports = []transport.SegmentTransport{{Name: te.tr.Name(), Endpoint: te.shared, PerPeer: te.caps.Has(transport.CapHandshake)}}
	return d
}

// Describe returns the descriptor prepared for peer: for a per-peer
// transport (CapHandshake) the transport prepares its endpoint for that peer
// id (an RDMA receiver creates QPs) and the sender must send its handshake
// reply back (TransferEngine.OpenSegment does). peer "" returns the regions
// and shared endpoints only. This is what the segment RPC answers and what
// kvx_segment_export writes.
func (te *TransferEngine) Describe(ctx context.Context, peer string) (transport.SegmentDescriptor, error) {
	te.mu.Lock()
	closed := te.closed
	te.mu.Unlock()
	if closed {
		return transport.SegmentDescriptor{}, fmt.Errorf("engine: describe segment %q: transfer engine %w", te.name, transport.ErrClosed)
	}
	d := te.publishedDescriptor()
	if te.caps.Has(transport.CapHandshake) && peer != "" {
		ep, err := te.tr.Endpoint(ctx, peer)
		if err != nil {
			return transport.SegmentDescriptor{}, fmt.Errorf("engine: segment %q: prepare %s endpoint for peer %q: %w", te.name, te.tr.Name(), peer, err)
		}
		d.Transports[0].Endpoint = ep
		d.PreparedFor = peer
	}
	return d, nil
}

// refusedTransport ends the RPC listener's refusal of a request for another
// transport; describePeer recognises it (ErrTransportMismatch).
const refusedTransport = "(create both engines with the same transport)"

// handleRPC answers the segment RPC listener's requests.
func (te *TransferEngine) handleRPC(ctx context.Context, req *segmentRequest) ([]byte, error) {
	if req.Transport != "" && req.Transport != te.tr.Name() {
		return nil, fmt.Errorf("segment %q runs transport %s, not %s %s", te.name, te.tr.Name(), req.Transport, refusedTransport)
	}
	switch req.Type {
	case rpcDescribe:
		d, err := te.Describe(ctx, req.Peer)
		if err != nil {
			return nil, err
		}
		return d.Encode(), nil
	case rpcAccept:
		acc, ok := te.tr.(transport.Acceptor)
		if !ok {
			return nil, fmt.Errorf("segment %q: transport %s takes no handshake reply", te.name, te.tr.Name())
		}
		if err := acc.Accept(ctx, req.Peer, req.Reply); err != nil {
			return nil, fmt.Errorf("segment %q: accept handshake of peer %q: %w", te.name, req.Peer, err)
		}
		return nil, nil
	}
	return nil, fmt.Errorf("segment %q: unknown request type %q", te.name, req.Type)
}

// kickPublish asks the publisher to publish the descriptor again.
func (te *TransferEngine) kickPublish() {
	if te.cfg.Directory == nil {
		return
	}
	select {
	case te.pubKick <- struct{}{}:
	default:
	}
}

// publisher publishes the descriptor after every registration change,
// retrying (with backoff up to 5 s) while the directory is unreachable.
func (te *TransferEngine) publisher() {
	defer close(te.pubDone)
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	backoff := 100 * time.Millisecond
	for {
		select {
		case <-te.stop:
			retry.Stop()
			return
		case <-te.pubKick:
		case <-retry.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), te.timeout)
		err := te.cfg.Directory.Publish(ctx, te.publishedDescriptor())
		cancel()
		if err != nil {
			te.log.Warn("publishing the segment descriptor failed; retrying (peers see the previous one; a write that misses refreshes over RPC)", "directory", te.directoryName(), "err", err)
			retry.Reset(backoff)
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
	}
}

// Close closes the segments this engine opened, removes the descriptor from
// the directory (best effort, bounded by RPCTimeout), stops the RPC
// listener and closes the transport. Idempotent.
func (te *TransferEngine) Close() error {
	te.mu.Lock()
	if te.closed {
		te.mu.Unlock()
		return nil
	}
	te.closed = true
	segs := make([]*RemoteSegment, 0, len(te.segs))
	for s := range te.segs {
		segs = append(segs, s)
	}
	watches := te.watches
	te.watches = map[string]*segWatch{}
	te.mu.Unlock()
	for _, w := range watches {
		w.stop()
	}
	for _, s := range segs {
		_ = s.Close()
	}
	close(te.stop)
	<-te.pubDone
	if te.cfg.Directory != nil {
		ctx, cancel := context.WithTimeout(context.Background(), te.timeout)
		if err := te.cfg.Directory.Unpublish(ctx, te.name); err != nil {
			te.log.Warn("could not remove the segment descriptor; it expires with the lease", "err", err)
		}
		cancel()
	}
	te.rpc.Close()
	err := te.tr.Close()
	_ = te.zctx.Term()
	return err
}

// OpenSegment opens the named peer segment: with a Directory the name is
// resolved there (and the peer's RPC listener is asked for a per-peer
// endpoint when the transport needs one), without one the name is the
// peer's "host:rpc_port" and its RPC listener answers. The descriptor's
// regions become the segment's translation table for peer virtual
// addresses. With a Directory the engine watches the peer's entry: when it
// vanishes (crash, partition) or changes epoch (restart), the segment
// becomes stale (ErrSegmentStale): its transport connection is closed and
// later submits fail at once; reopen by name.
//
// Errors name the segment and wrap ErrSegmentNotFound, ErrSegmentUnreachable,
// ErrSegmentRefused, ErrMetadataUnavailable, context.DeadlineExceeded (each
// request is bounded by RPCTimeout) or the transport's open error.
func (te *TransferEngine) OpenSegment(ctx context.Context, name string) (*RemoteSegment, error) {
	return te.OpenSegmentWith(ctx, name, SegmentOptions{})
}

// SegmentOptions are the choices OpenSegmentWith leaves to its caller.
type SegmentOptions struct {
	// Peer is the peer id the remote engine prepares its endpoint for (the
	// id a transport with CapHandshake keys its per-peer state by, e.g. the
	// RDMA QPs the remote Fencer destroys when it fences this data path).
	// "" = a fresh id of this engine ("name#epoch.seq").
	Peer string
	// Epoch is carried on the data path (transport.SegmentInfo.Epoch): a
	// remote transport that fences (transport.Fencer) serves only an epoch
	// it admitted and has not fenced. 0 = no epoch.
	Epoch uint64
}

// OpenSegmentWith is OpenSegment with a caller-chosen peer id and segment
// epoch (package agent: the remote agent admits the epoch for this peer
// before the open and fences it when it removes this agent).
func (te *TransferEngine) OpenSegmentWith(ctx context.Context, name string, o SegmentOptions) (*RemoteSegment, error) {
	if name == "" {
		return nil, fmt.Errorf("engine: open segment: %w: the segment name is empty (want the peer's name, \"host:rpc_port\" in P2P mode)", ErrBadSegmentName)
	}
	te.mu.Lock()
	closed := te.closed
	te.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("engine: open segment %q: transfer engine %w", name, transport.ErrClosed)
	}
	peer := o.Peer
	if peer == "" {
		peer = te.peerID()
	}
	var (
		d   transport.SegmentDescriptor
		rev int64
		err error
	)
	if dir := te.cfg.Directory; dir != nil {
		rctx, cancel := context.WithTimeout(ctx, te.timeout)
		d, rev, err = dir.Resolve(rctx, name)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("engine: open segment %q: %w", name, err)
		}
		if err := te.checkTransport(d); err != nil {
			return nil, err
		}
		if t, _ := d.Transport(te.tr.Name()); t.PerPeer {
			pd, err := te.describePeer(ctx, d.RPC, peer)
			if err != nil {
				return nil, fmt.Errorf("engine: open segment %q (resolved in %s): %w", name, dir, err)
			}
			if pd.Epoch != d.Epoch {
				return nil, fmt.Errorf("engine: open segment %q: the peer at %s has epoch %#x, the directory still lists %#x (the peer restarted; retry once the directory has its new entry): %w",
					name, d.RPC, pd.Epoch, d.Epoch, ErrSegmentStale)
			}
			d = pd
		}
	} else {
		if _, _, serr := net.SplitHostPort(name); serr != nil {
			return nil, fmt.Errorf("engine: open segment %q: %w: in P2P mode (no metadata server) a segment name is the peer's \"host:rpc_port\": %v", name, ErrBadSegmentName, serr)
		}
		if d, err = te.describePeer(ctx, name, peer); err != nil {
			return nil, fmt.Errorf("engine: open segment %q: %w", name, err)
		}
	}
	return te.open(ctx, name, d, rev, o.Epoch)
}

// OpenSegmentDescriptor opens a segment from a descriptor handed over out of
// band (kvx_segment_export / kvx_segment_open). A per-peer transport's
// handshake reply goes to the descriptor's RPC address for the peer id it
// was prepared for. The segment is not watched (no directory revision).
func (te *TransferEngine) OpenSegmentDescriptor(ctx context.Context, d transport.SegmentDescriptor) (*RemoteSegment, error) {
	if err := te.checkTransport(d); err != nil {
		return nil, err
	}
	if t, _ := d.Transport(te.tr.Name()); len(t.Endpoint) == 0 {
		return nil, fmt.Errorf("engine: open segment %q: the descriptor carries no %s endpoint (export it for a peer: the transport prepares one per peer)", d.Name, te.tr.Name())
	}
	return te.open(ctx, d.Name, d, 0, 0)
}

func (te *TransferEngine) peerID() string {
	return fmt.Sprintf("%s#%x.%d", te.name, te.epoch&0xffffffff, te.connSeq.Add(1))
}

func (te *TransferEngine) checkTransport(d transport.SegmentDescriptor) error {
	if _, ok := d.Transport(te.tr.Name()); !ok {
		return fmt.Errorf("engine: open segment %q: %w: the peer runs %v, this engine runs %s (create both engines with the same transport)", d.Name, ErrTransportMismatch, d.TransportNames(), te.tr.Name())
	}
	return nil
}

// describePeer asks the segment RPC listener at addr for the descriptor
// prepared for peer ("" = regions and shared endpoints only).
func (te *TransferEngine) describePeer(ctx context.Context, addr, peer string) (transport.SegmentDescriptor, error) {
	rctx, cancel := context.WithTimeout(ctx, te.timeout)
	defer cancel()
	b, err := te.client.call(rctx, addr, &segmentRequest{Type: rpcDescribe, Peer: peer, Transport: te.tr.Name()})
	if err != nil {
		if errors.Is(err, ErrSegmentRefused) && strings.HasSuffix(err.Error(), refusedTransport) {
			// The listener's refusal for another transport (handleRPC): the
			// segment RPC carries refusals as text, so the package that
			// writes this one recognises it and gives it its sentinel.
			err = fmt.Errorf("%w: %w", ErrTransportMismatch, err)
		}
		return transport.SegmentDescriptor{}, err
	}
	d, err := transport.DecodeSegmentDescriptor(b)
	if err != nil {
		return transport.SegmentDescriptor{}, fmt.Errorf("engine: segment RPC DESCRIBE to %s: %w", addr, err)
	}
	return d, nil
}

// open connects the transport segment for descriptor d.
func (te *TransferEngine) open(ctx context.Context, name string, d transport.SegmentDescriptor, rev int64, epoch uint64) (*RemoteSegment, error) {
	t, _ := d.Transport(te.tr.Name())
	seg, err := te.tr.OpenSegment(ctx, transport.SegmentInfo{Endpoint: t.Endpoint, Regions: d.Regions, Epoch: epoch})
	if err != nil {
		return nil, fmt.Errorf("engine: open segment %q (epoch %#x, %s): %w", name, d.Epoch, te.tr.Name(), err)
	}
	if te.caps.Has(transport.CapHandshake) {
		if d.PreparedFor == "" {
			_ = seg.Close()
			return nil, fmt.Errorf("engine: open segment %q: the %s endpoint was not prepared for a peer; the handshake cannot complete", name, te.tr.Name())
		}
		actx, cancel := context.WithTimeout(ctx, te.timeout)
		_, err := te.client.call(actx, d.RPC, &segmentRequest{Type: rpcAccept, Peer: d.PreparedFor, Transport: te.tr.Name(), Reply: seg.HandshakeReply()})
		cancel()
		if err != nil {
			_ = seg.Close()
			return nil, fmt.Errorf("engine: open segment %q: handshake: %w", name, err)
		}
	}
	s := &RemoteSegment{te: te, name: name, seg: seg}
	s.setDesc(d)
	te.mu.Lock()
	if te.closed {
		te.mu.Unlock()
		_ = seg.Close()
		return nil, fmt.Errorf("engine: open segment %q: transfer engine %w during the open", name, transport.ErrClosed)
	}
	te.segs[s] = struct{}{}
	if te.cfg.Directory != nil && rev > 0 {
		w := te.watches[name]
		if w == nil {
			w = &segWatch{segs: map[*RemoteSegment]struct{}{}}
			te.watches[name] = w
			w.stop = te.cfg.Directory.Watch(name, rev, func(ev transport.SegmentEvent) { te.onSegmentEvent(ev) })
		}
		w.segs[s] = struct{}{}
	}
	te.mu.Unlock()
	return s, nil
}

// onSegmentEvent invalidates the segments open to a peer that vanished or
// restarted.
func (te *TransferEngine) onSegmentEvent(ev transport.SegmentEvent) {
	te.mu.Lock()
	w := te.watches[ev.Name]
	var segs []*RemoteSegment
	if w != nil {
		for s := range w.segs {
			segs = append(segs, s)
		}
	}
	te.mu.Unlock()
	for _, s := range segs {
		epoch := s.Epoch()
		var reason error
		switch {
		case ev.Deleted:
			reason = fmt.Errorf("engine: segment %q (epoch %#x): its descriptor vanished from %s (lease expired: the peer crashed or is partitioned, or it shut down): %w: %w",
				ev.Name, epoch, te.directoryName(), ErrSegmentStale, transport.ErrPeerLost)
		case ev.Desc.Epoch != epoch:
			reason = fmt.Errorf("engine: segment %q: the peer restarted (epoch %#x → %#x in %s); reopen the segment: %w: %w",
				ev.Name, epoch, ev.Desc.Epoch, te.directoryName(), ErrSegmentStale, transport.ErrPeerLost)
		default:
			continue // same incarnation published new regions
		}
		s.invalidate(reason)
	}
}

// forget removes a closed segment from the engine's tables (and stops the
// name's watch with its last segment).
func (te *TransferEngine) forget(s *RemoteSegment) {
	te.mu.Lock()
	delete(te.segs, s)
	var stop func()
	if w := te.watches[s.name]; w != nil {
		delete(w.segs, s)
		if len(w.segs) == 0 {
			delete(te.watches, s.name)
			stop = w.stop
		}
	}
	te.mu.Unlock()
	if stop != nil {
		stop()
	}
}
