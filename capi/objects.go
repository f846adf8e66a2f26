//go:build cgo

package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// Handle tables. Objects are removed from their table before they are
// closed, so a concurrent call sees either the live object or a bad handle.
var (
	engines    = newTable[*engineObj]()
	segments   = newTable[*segmentObj]()
	batches    = newTable[*batchObj]()
	hostBufs   = newTable[*transport.HostBuffer]()
	bootstraps = newTable[*bootstrapObj]()
	metaSrvs   = newTable[*metaServerObj]()
)

// opTimeout bounds control operations that talk to a peer (Endpoint,
// OpenSegment, bootstrap start) so that a vanished peer cannot hang a C
// caller.
const opTimeout = 30 * time.Second

// engineObj is one kvx_engine_t: an segengine.TransferEngine (transport,
// registered regions, segment name, RPC listener, optional metadata store)
// plus the segments opened through it.
type engineObj struct {
	role          int32
	bootstrapAddr string
	te            *segengine.TransferEngine
	tr            transport.Transport        // the TransferEngine's (segmentTransport)
	trs           []transport.Transport      // every transport opened, highest priority first (KV managers use them all)
	meta          transport.SegmentDirectory // nil in P2P mode; closed with the engine
	metaClose     func() error
	timeout       time.Duration
	notify        *notifier

	mu       sync.Mutex
	closed   bool
	segments map[uint64]struct{}
}

// engineConfig is kvx_engine_config in Go types.
type engineConfig struct {
	role           int32
	transport      string
	listenHost     string
	listenPort     int
	bootstrapAddr  string
	streams        int
	localHostname  string
	metadataServer string
	segmentName    string
	rpcTimeout     time.Duration
	devices        []string // kvx_engine_config.devices split at commas
}

func newEngine(cfg engineConfig) (*engineObj, error) {
	const op = "kvx_engine_create"
	if cfg.role != 0 && cfg.role != 1 {
		return nil, fail(stInvalidArgument, "%s: role %d is not KVX_ROLE_PREFILL (0) or KVX_ROLE_DECODE (1)", op, cfg.role)
	}
	if cfg.bootstrapAddr != "" {
		if _, _, err := splitHostPort(cfg.bootstrapAddr); err != nil {
			return nil, failWrap(stInvalidArgument, err, "%s: bootstrap_addr %q", op, cfg.bootstrapAddr)
		}
	}
	if cfg.rpcTimeout <= 0 {
		cfg.rpcTimeout = segengine.DefaultRPCTimeout
	}
	meta, metaClose, err := openMetadata(cfg.metadataServer, cfg.rpcTimeout)
	if err != nil {
		return nil, err
	}
	listenHost, err := resolveBindHost(cfg.listenHost)
	if err != nil {
		if metaClose != nil {
			_ = metaClose()
		}
		return nil, failWrap(stInvalidArgument, err, "%s: listen_host %q", op, cfg.listenHost)
	}
	opts, err := transportOptions(getenv)
	if err != nil {
		if metaClose != nil {
			_ = metaClose()
		}
		return nil, failWrap(stInvalidArgument, err, "%s", op)
	}
	if listenHost != "" {
		opts.ListenHost = listenHost
	}
	opts.ListenPort = cfg.listenPort
	opts.Streams = cfg.streams
	opts.Devices = cfg.devices
	name := cfg.transport
	if name == "" {
		name = "auto"
	}
	// transport.OpenTransports is the CLI's meaning of the name too: "auto"
	// opens every transport usable here. The segment API (TransferEngine)
	// moves bytes on the first, highest-priority one; KV managers offer
	// them all, so a peer on another host falls back from shm to tcp.
	trs, err := transport.OpenTransports(name, opts)
	if err != nil {
		if metaClose != nil {
			_ = metaClose()
		}
		code := stUnavailable
		if errors.Is(err, transport.ErrUnknownTransport) {
			code = stInvalidArgument
		}
		return nil, failWrap(code, err, "%s: transport %q (compiled in: %s)", op, name, strings.Join(transport.Transports(), ", "))
	}
	tr := segmentTransport(name, trs)
	closeRest := func() {
		for _, t := range trs {
			if t != tr {
				_ = t.Close()
			}
		}
	}
	local := cfg.localHostname
	if local == "" {
		local = opts.ListenHost
	}
	bindLocal, named, err := resolveLocalHostname(local)
	if err != nil {
		closeRest()
		_ = tr.Close()
		if metaClose != nil {
			_ = metaClose()
		}
		return nil, failWrap(stInvalidArgument, err, "%s: local_hostname %q", op, local)
	}
	advertise := getenv("KVXFER_ADVERTISE_HOST")
	if advertise == "" {
		advertise = named // a host name is advertised as given, as Mooncake does
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.rpcTimeout)
	defer cancel()
	te, err := segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{
		Transport: tr, LocalHostname: bindLocal, SegmentName: cfg.segmentName, Directory: meta,
		RPCTimeout: cfg.rpcTimeout, Devices: opts.Devices, AdvertiseHost: advertise, OnSubmit: countSubmit,
	})
	if err != nil { // NewTransferEngine closed the transport
		closeRest()
		if metaClose != nil {
			_ = metaClose()
		}
		code := stOK
		if !errors.Is(err, transport.ErrMetadataUnavailable) {
			code = stInvalidArgument
		}
		return nil, failWrap(code, err, "%s: local_hostname %q", op, local)
	}
	return &engineObj{
		role:          cfg.role,
		bootstrapAddr: cfg.bootstrapAddr,
		te:            te,
		tr:            tr,
		trs:           trs,
		meta:          meta,
		metaClose:     metaClose,
		timeout:       cfg.rpcTimeout,
		segments:      map[uint64]struct{}{},
		notify:        newNotifier(),
	}, nil
}

// segmentTransport picks the one transport the segment API
// (TransferEngine) moves bytes on: the highest-priority one opened, except
// that for "auto" (or "") cma goes before shm. The segment API chooses
// before any memory is registered, and its callers (Mooncake's) register
// their own memory (numpy arrays, tensors), which shm cannot share and cma
// can; cma also moves the memfd memory shm would. KV managers are not
// affected: they register on every transport and use shm where it can
// register their buffers.
func segmentTransport(spec string, trs []transport.Transport) transport.Transport {
	if s := strings.TrimSpace(spec); (s == "" || s == "auto") && trs[0].Name() == "shm" {
		for _, t := range trs {
			if t.Name() == "cma" {
				return t
			}
		}
	}
	return trs[0]
}

// resolveBindHost turns a host name given as a bind host into the address
// of this machine it stands for (hostaddr.ResolveLocal); an IP address, a
// wildcard or "" is returned as is.
func resolveBindHost(host string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	return hostaddr.ResolveLocal(ctx, host)
}

// resolveLocalHostname splits Mooncake's local_hostname ("host" or
// "host:port") and, when host is a name rather than an address, returns
// the same form with the name's local address (what the RPC listener binds)
// and the name itself (what the engine advertises); named is "" for an
// address.
func resolveLocalHostname(local string) (bind, named string, err error) {
	host, port, serr := net.SplitHostPort(local)
	if serr != nil {
		host, port = local, ""
	}
	if _, perr := netip.ParseAddr(strings.Trim(host, "[]")); perr == nil || host == "" {
		return local, "", nil
	}
	ip, err := resolveBindHost(host)
	if err != nil {
		return "", "", err
	}
	if port == "" {
		return ip, host, nil
	}
	return net.JoinHostPort(ip, port), host, nil
}

// close closes the engine's KV managers (and their rooms), segments,
// batches and transfer engine (transport, RPC listener, published
// descriptor), its metadata store connection and its notifier.
func (e *engineObj) close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	segs := make([]uint64, 0, len(e.segments))
	for h := range e.segments {
		segs = append(segs, h)
	}
	e.mu.Unlock()
	// KV managers on this engine go first: they use its transport.
	kvs.mu.Lock()
	var mine []uint64
	for h, k := range kvs.m {
		if k.eng == e {
			mine = append(mine, h)
		}
	}
	kvs.mu.Unlock()
	for _, h := range mine {
		if k, ok := kvs.take(h); ok {
			k.close()
		}
	}
	for _, h := range segs {
		if s, ok := segments.take(h); ok {
			s.close()
		}
	}
	err := e.te.Close() // closes e.tr
	for _, t := range e.trs {
		if t == e.tr {
			continue
		}
		if cerr := t.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close transport %s: %w", t.Name(), cerr)
		}
	}
	if e.metaClose != nil {
		if merr := e.metaClose(); err == nil {
			err = merr
		}
	}
	e.notify.stop()
	return err
}

// hostBufferFor finds the kvx_alloc_host buffer that contains [addr,
// addr+n), so its memfd can back the registration (shm transport).
func hostBufferFor(addr uintptr, n uint64) (fd int, off uint64, ok bool) {
	hostBufs.mu.Lock()
	defer hostBufs.mu.Unlock()
	for _, hb := range hostBufs.m {
		m := hb.Memory()
		if addr >= m.Addr && uint64(addr-m.Addr)+n <= m.Length {
			return m.FD, uint64(addr - m.Addr), true
		}
	}
	return -1, 0, false
}

// detectLocation says where memory given with no location lives (a NULL or
// empty location, or Mooncake's wildcard "*"), as Mooncake does for "*":
// on a host where CUDA may be present (cuda.MayBePresent: the NVIDIA
// driver, or KVXFER_CUDART/KVXFER_LIBCUDA set) the driver's
// cuPointerGetAttribute tells device memory (cuda:N) from host memory;
// elsewhere, or where CUDA does not load (cuda.ErrNotSupported), it is host
// memory. A driver that errors is an error naming the address: treating a
// device pointer as host memory would fault in the first transfer.
func detectLocation(addr uintptr) (transport.MemoryKind, int, error) {
	if !cuda.MayBePresent() {
		return transport.MemoryHost, 0, nil
	}
	if err := cuda.Available(); err != nil {
		if errors.Is(err, cuda.ErrNotSupported) {
			return transport.MemoryHost, 0, nil
		}
		return 0, 0, fmt.Errorf("no location given and CUDA did not load to tell whether %#x is device memory: %v; pass location \"cpu\" or \"cuda:N\"", addr, err)
	}
	dev, ok, err := cuda.PointerDevice(addr)
	if err != nil {
		return 0, 0, fmt.Errorf("no location given and the CUDA driver cannot tell whether %#x is device memory: %v; pass location \"cpu\" or \"cuda:N\"", addr, err)
	}
	if ok {
		return transport.MemoryCUDA, dev, nil
	}
	return transport.MemoryHost, 0, nil
}

func (e *engineObj) register(addr uintptr, n uint64, loc string) (transport.RegionID, error) {
	var kind transport.MemoryKind
	var dev int
	var err error
	if l := strings.TrimSpace(loc); l == "" || l == "*" {
		kind, dev, err = detectLocation(addr)
		loc = "host"
		if kind == transport.MemoryCUDA {
			loc = fmt.Sprintf("cuda:%d (detected)", dev)
		}
	} else {
		kind, dev, err = transport.ParseLocation(loc)
	}
	if err != nil {
		return 0, failWrap(stInvalidArgument, err, "kvx_register_memory")
	}
	m := transport.Memory{Addr: addr, Length: n, Kind: kind, Device: dev, FD: -1}
	if kind == transport.MemoryHost {
		if fd, off, ok := hostBufferFor(addr, n); ok {
			m.FD, m.FDOffset = fd, off
		}
	}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return 0, fail(stClosed, "kvx_register_memory: engine is destroyed")
	}
	desc, err := e.te.RegisterMemory(m)
	if err != nil {
		code := stOK
		if errors.Is(err, segengine.ErrRegionOverlap) {
			code = stInvalidArgument
		}
		if kind == transport.MemoryHost && errors.Is(err, transport.ErrUnsupportedMemory) {
			// The transport's own remedy names Go APIs; say the C ones.
			return 0, failWrap(code, err, "kvx_register_memory: %s range [%#x, +%d bytes) on transport %s (allocate the memory with kvx_alloc_host, or create the engine with transport \"cma\" or \"auto\", which register any host memory on this host)", loc, addr, n, e.tr.Name())
		}
		return 0, failWrap(code, err, "kvx_register_memory: %s range [%#x, +%d bytes) on transport %s", loc, addr, n, e.tr.Name())
	}
	return desc.ID, nil
}

func (e *engineObj) deregister(id transport.RegionID) error {
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return fail(stClosed, "kvx_deregister_memory: engine is destroyed")
	}
	if err := e.te.DeregisterMemory(id); err != nil {
		return failWrap(stOK, err, "kvx_deregister_memory: region %d", id)
	}
	return nil
}

// checkLocal verifies that every block a request reads (or, for a read,
// fills) lies inside one registered local region.
func (e *engineObj) checkLocal(op string, i int, r transport.WriteRequest) error {
	if r.Length == 0 {
		return fail(stInvalidArgument, "%s: request %d has length 0 bytes", op, i)
	}
	span := r.Length
	if r.Blocks() > 1 {
		span = (r.Blocks()-1)*r.LocalStride + r.Length
	}
	if _, _, ok := e.te.LocalRegion(r.Local, span); ok {
		return nil
	}
	return fail(stNotRegistered, "%s: request %d uses local [%#x, +%d bytes), which is not inside memory registered with this engine (call kvx_register_memory first)", op, i, r.Local, span)
}

// maxSegmentDesc bounds the blob kvx_segment_open accepts.
const maxSegmentDesc = transport.MaxSegmentDescriptorBytes

func (e *engineObj) exportSegment(peer string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	d, err := e.te.Describe(ctx, peer)
	if err != nil {
		return nil, failWrap(stOK, err, "kvx_segment_export: peer %q", peer)
	}
	return d.Encode(), nil
}

// segmentObj is one kvx_segment_t: an segengine.RemoteSegment.
type segmentObj struct {
	eng  *engineObj
	engH uint64
	seg  *segengine.RemoteSegment

	mu      sync.Mutex
	closed  bool
	batches map[uint64]struct{}
}

// addSegment registers an opened segment under a new handle.
func (e *engineObj) addSegment(op string, engH uint64, rs *segengine.RemoteSegment) (uint64, error) {
	s := &segmentObj{eng: e, engH: engH, seg: rs, batches: map[uint64]struct{}{}}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		_ = rs.Close()
		return 0, fail(stClosed, "%s: engine destroyed during the call", op)
	}
	h := segments.add(s)
	e.segments[h] = struct{}{}
	return h, nil
}

func (e *engineObj) openSegment(engH uint64, blob []byte) (uint64, error) {
	const op = "kvx_segment_open"
	d, err := transport.DecodeSegmentDescriptor(blob)
	if err != nil {
		return 0, failWrap(stInvalidArgument, err, "%s: not a kvx_segment_export blob", op)
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	rs, err := e.te.OpenSegmentDescriptor(ctx, d)
	if err != nil {
		return 0, failWrap(openCode(err), err, "%s", op)
	}
	return e.addSegment(op, engH, rs)
}

func (e *engineObj) openSegmentName(engH uint64, name string) (uint64, error) {
	const op = "kvx_segment_open_name"
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	rs, err := e.te.OpenSegment(ctx, name)
	if err != nil {
		return 0, failWrap(openCode(err), err, "%s", op)
	}
	return e.addSegment(op, engH, rs)
}

// openCode picks the status of a failed open: a transport mismatch or
// malformed name is the caller's argument, the rest follows codeOf.
func openCode(err error) status {
	if errors.Is(err, segengine.ErrTransportMismatch) || errors.Is(err, segengine.ErrBadSegmentName) {
		return stInvalidArgument
	}
	return stOK
}

// close closes the segment and its batches (failing pending ones).
func (s *segmentObj) close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	bs := make([]uint64, 0, len(s.batches))
	for h := range s.batches {
		bs = append(bs, h)
	}
	s.mu.Unlock()
	err := s.seg.Close()
	for _, h := range bs {
		if b, ok := batches.take(h); ok {
			b.release()
		}
	}
	return err
}

// resolve checks that every request's local blocks lie in memory
// registered with the engine and translates the requests addressed by peer
// virtual address (KVX_REGION_PEER_ADDRESS) to (region, offset), in place;
// fn names the exported function in the errors.
func (s *segmentObj) resolve(ctx context.Context, fn string, op transport.Op, reqs []transport.WriteRequest) error {
	for i := range reqs {
		if err := s.eng.checkLocal(fn, i, reqs[i]); err != nil {
			return err
		}
		if reqs[i].Remote != peerAddressRegion {
			continue
		}
		r := reqs[i]
		var tr []transport.WriteRequest
		var err error
		if op == transport.OpRead {
			tr, err = s.seg.ResolveReads(ctx, []segengine.PeerRead{{Local: r.Local, PeerAddr: r.RemoteOffset, Length: r.Length,
				Count: r.Count, LocalStride: r.LocalStride, PeerStride: r.RemoteStride}})
		} else {
			tr, err = s.seg.Resolve(ctx, []segengine.PeerWrite{{Local: r.Local, PeerAddr: r.RemoteOffset, Length: r.Length,
				Count: r.Count, LocalStride: r.LocalStride, PeerStride: r.RemoteStride}})
		}
		if err != nil {
			return failWrap(stOK, err, "%s: request %d", fn, i)
		}
		reqs[i] = tr[0]
	}
	return nil
}

// batchObj is one kvx_batch_t: up to capacity requests, submitted in one or
// more engine transfer batches ("parts").
type batchObj struct {
	seg      *segmentObj
	capacity uint32

	mu    sync.Mutex
	parts []*batchPart
	n     uint32 // requests submitted so far
	freed bool   // kvx_batch_free won; no more submits
}

// batchPart is one kvx_batch_submit or kvx_batch_submit_read call: one
// engine TransferBatch.
type batchPart struct {
	first, count uint32
	id           transport.BatchID
	bytes        []uint64 // per-request payload
	cancel       context.CancelFunc
	done         chan struct{}
	st           transport.BatchStatus // valid after done is closed
}

// submit submits reqs as one engine transfer batch of op (a WRITE batch
// for kvx_batch_submit, a READ batch for kvx_batch_submit_read); fn is the
// exported function's name for the messages.
func (b *batchObj) submit(fn string, batchH uint64, op transport.Op, reqs []transport.WriteRequest) error {
	ctx, cancel := context.WithTimeout(context.Background(), b.seg.eng.timeout)
	defer cancel()
	if err := b.seg.resolve(ctx, fn, op, reqs); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return fail(stBadHandle, "%s: batch %d was freed", fn, batchH)
	}
	if uint64(b.n)+uint64(len(reqs)) > uint64(b.capacity) {
		return fail(stBusy, "%s: %d requests do not fit: batch capacity %d, %d already submitted (allocate a larger batch)", fn, len(reqs), b.capacity, b.n)
	}
	tb := &transport.TransferBatch{Op: op, Requests: reqs}
	id, err := b.seg.seg.Submit(ctx, tb)
	if err != nil {
		return failWrap(stOK, err, "%s: submit %d %s requests (%d bytes)", fn, len(reqs), op, tb.Bytes())
	}
	bytes := make([]uint64, len(reqs))
	for i, r := range reqs {
		bytes[i] = r.Bytes()
	}
	b.track(batchH, id, bytes)
	return nil
}

// submitEntries submits struct-of-arrays entries (kvx_batch_submit_soa,
// kvx_batch_submit_read_soa) as one engine transfer batch of op.
func (b *batchObj) submitEntries(fn string, batchH uint64, op transport.Op, e segengine.Entries) error {
	ctx, cancel := context.WithTimeout(context.Background(), b.seg.eng.timeout)
	defer cancel()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return fail(stBadHandle, "%s: batch %d was freed", fn, batchH)
	}
	if uint64(b.n)+uint64(len(e.Local)) > uint64(b.capacity) {
		// Checked before the arrays are read: n past what is free says
		// nothing about their length.
		return fail(stBusy, "%s: %d requests do not fit: batch capacity %d, %d already submitted (allocate a larger batch); nothing was read", fn, len(e.Local), b.capacity, b.n)
	}
	id, err := b.seg.seg.SubmitEntries(ctx, op, e)
	if err != nil {
		return failWrap(stOK, err, "%s: submit %d %s requests", fn, len(e.Local), op)
	}
	b.track(batchH, id, append([]uint64(nil), e.Length...))
	return nil
}

// track records a submitted engine batch as the batch's next part (its
// requests get the next len(bytes) indices; bytes[i] is request i's
// payload) and posts its outcome when it is terminal. Called with b.mu held.
func (b *batchObj) track(batchH uint64, id transport.BatchID, bytes []uint64) {
	wctx, wcancel := context.WithCancel(context.Background())
	p := &batchPart{first: b.n, count: uint32(len(bytes)), id: id, bytes: bytes, cancel: wcancel, done: make(chan struct{})}
	b.parts = append(b.parts, p)
	b.n += uint32(len(bytes))
	eng := b.seg.eng
	go func() {
		st, err := b.seg.seg.Wait(wctx, id)
		if err != nil && !st.State.Terminal() {
			// The wait was abandoned (free or close); poll once more.
			if s2, err2 := b.seg.seg.Poll(id); err2 == nil && s2.State.Terminal() {
				st = s2
			} else {
				st = transport.BatchStatus{State: transport.BatchFailed, Err: err}
			}
		}
		p.st = st
		close(p.done)
		eng.notify.post(eventBatch(batchH, p))
	}()
}

// free is the number of request indices not yet submitted.
func (b *batchObj) free() uint32 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.capacity - b.n
}

// partOf returns the part holding request index i.
func (b *batchObj) partOf(i uint32) *batchPart {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parts {
		if i >= p.first && i < p.first+p.count {
			return p
		}
	}
	return nil
}

// transferState maps an engine batch state to kvx_transfer_state.
func transferState(s transport.BatchState) int32 {
	switch s {
	case transport.BatchPending:
		return 1
	case transport.BatchCompleted:
		return 2
	case transport.BatchFailed:
		return 3
	case transport.BatchCanceled:
		return 4
	}
	return 3
}

// status returns (state, error code, bytes done) of request i.
func (b *batchObj) status(i uint32) (int32, status, uint64, error) {
	if i >= b.capacity {
		return 0, 0, 0, fail(stInvalidArgument, "kvx_batch_status: index %d is past the batch capacity %d", i, b.capacity)
	}
	p := b.partOf(i)
	if p == nil {
		return 0, stOK, 0, nil // KVX_TRANSFER_EMPTY
	}
	select {
	case <-p.done:
		st := p.st
		var bytes uint64
		code := stOK
		if st.State == transport.BatchCompleted {
			bytes = p.bytes[i-p.first]
		} else {
			code = codeOf(st.Err)
			if st.State == transport.BatchCanceled {
				code = stCanceled
			}
		}
		return transferState(st.State), code, bytes, nil
	default:
		return 1, stOK, 0, nil
	}
}

func (b *batchObj) wait(timeout time.Duration) error {
	b.mu.Lock()
	parts := append([]*batchPart(nil), b.parts...)
	b.mu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	var first error
	for _, p := range parts {
		// A part already done counts even when the timer has fired too
		// (timeout_ms 0 polls): select alone picks either at random.
		select {
		case <-p.done:
		default:
			select {
			case <-p.done:
			case <-t.C:
				return fail(stTimeout, "kvx_batch_wait: requests %d..%d still pending after %v", p.first, p.first+p.count-1, timeout)
			}
		}
		if p.st.State != transport.BatchCompleted && first == nil {
			code := codeOf(p.st.Err)
			if p.st.State == transport.BatchCanceled {
				code = stCanceled
			}
			first = failWrap(code, p.st.Err, "kvx_batch_wait: requests %d..%d %s", p.first, p.first+p.count-1, p.st.State)
		}
	}
	return first
}

func (b *batchObj) cancelAll() error {
	b.mu.Lock()
	parts := append([]*batchPart(nil), b.parts...)
	b.mu.Unlock()
	for _, p := range parts {
		select {
		case <-p.done:
		default:
			if err := b.seg.seg.Cancel(p.id); err != nil {
				return failWrap(stOK, err, "kvx_batch_cancel: requests %d..%d", p.first, p.first+p.count-1)
			}
		}
	}
	return nil
}

// markFreed refuses further submits unless a part is still pending, in
// which case it reports false and changes nothing.
func (b *batchObj) markFreed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parts {
		select {
		case <-p.done:
		default:
			return false
		}
	}
	b.freed = true
	return true
}

// release stops the waiters and forgets every part in the segment.
func (b *batchObj) release() {
	b.mu.Lock()
	parts := b.parts
	b.parts = nil
	b.mu.Unlock()
	for _, p := range parts {
		p.cancel()
		<-p.done
		b.seg.seg.Release(p.id)
	}
}

func splitHostPort(addr string) (string, int, error) {
	i := strings.LastIndexByte(addr, ':')
	if i <= 0 {
		return "", 0, fmt.Errorf("%q is not host:port", addr)
	}
	host := strings.Trim(addr[:i], "[]")
	port, err := strconv.Atoi(addr[i+1:])
	if err != nil || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("%q: port %q is not in 1..65535", addr, addr[i+1:])
	}
	return host, port, nil
}

// registeredAnywhere reports an engine and region that still register memory
// overlapping [addr, addr+n).
func registeredAnywhere(addr uintptr, n uint64) (uint64, transport.RegionID, bool) {
	engines.mu.Lock()
	all := make(map[uint64]*engineObj, len(engines.m))
	for h, e := range engines.m {
		all[h] = e
	}
	engines.mu.Unlock()
	for h, e := range all {
		for _, r := range e.te.Regions() {
			if uint64(addr) < r.Addr+r.Length && r.Addr < uint64(addr)+n {
				return h, r.ID, true
			}
		}
	}
	return 0, 0, false
}

// splitDevices turns kvx_engine_config.devices ("mlx5_0, mlx5_1", Mooncake's
// device_name) into names; empty entries are dropped, so "" means every
// device.
func splitDevices(s string) []string {
	var out []string
	for _, d := range strings.Split(s, ",") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}
