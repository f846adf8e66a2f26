//go:build cgo

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// Handle tables. Objects are removed from their table before they are
// closed, so a concurrent call sees either the live object or a bad handle.
var (
	engines    = newTable[*engineObj]()
	segments   = newTable[*segmentObj]()
	batches    = newTable[*batchObj]()
	hostBufs   = newTable[*engine.HostBuffer]()
	bootstraps = newTable[*bootstrapObj]()
)

// opTimeout bounds control operations that talk to a peer (Endpoint,
// OpenSegment, bootstrap start) so that a vanished peer cannot hang a C
// caller.
const opTimeout = 30 * time.Second

// engineObj is one kvx_engine_t: a transport instance plus the regions and
// segments opened through it.
type engineObj struct {
	role          int32
	bootstrapAddr string
	tr            engine.Transport
	notify        *notifier

	mu       sync.Mutex
	closed   bool
	regions  map[engine.RegionID]regionInfo
	segments map[uint64]struct{}
}

type regionInfo struct {
	mem  engine.Memory
	desc engine.RegionDesc
}

// engineConfig is kvx_engine_config in Go types.
type engineConfig struct {
	role          int32
	transport     string
	listenHost    string
	listenPort    int
	bootstrapAddr string
	streams       int
}

func newEngine(cfg engineConfig) (*engineObj, error) {
	if cfg.role != 0 && cfg.role != 1 {
		return nil, fail(stInvalidArgument, "kvx_engine_create: role %d is not KVX_ROLE_PREFILL (0) or KVX_ROLE_DECODE (1)", cfg.role)
	}
	if cfg.bootstrapAddr != "" {
		if _, _, err := splitHostPort(cfg.bootstrapAddr); err != nil {
			return nil, failWrap(stInvalidArgument, err, "kvx_engine_create: bootstrap_addr %q", cfg.bootstrapAddr)
		}
	}
	opts := engine.DefaultOptions()
	if cfg.listenHost != "" {
		opts.ListenHost = cfg.listenHost
	}
	opts.ListenPort = cfg.listenPort
	opts.Streams = cfg.streams
	name := cfg.transport
	if name == "" {
		name = "auto"
	}
	tr, err := engine.OpenTransport(name, opts)
	if err != nil {
		code := stUnavailable
		if strings.Contains(err.Error(), "unknown transport") {
			code = stInvalidArgument
		}
		return nil, failWrap(code, err, "kvx_engine_create: transport %q (compiled in: %s)", name, strings.Join(engine.Transports(), ", "))
	}
	e := &engineObj{
		role:          cfg.role,
		bootstrapAddr: cfg.bootstrapAddr,
		tr:            tr,
		regions:       map[engine.RegionID]regionInfo{},
		segments:      map[uint64]struct{}{},
	}
	e.notify = newNotifier()
	return e, nil
}

// close closes the engine's segments (failing their pending batches), its
// transport and its notifier.
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
	err := e.tr.Close()
	e.notify.stop()
	return err
}

// parseLocation turns "cpu", "host", "" or "cuda:N" into a memory kind and
// device ordinal.
func parseLocation(loc string) (engine.MemoryKind, int, error) {
	switch strings.ToLower(loc) {
	case "", "cpu", "host":
		return engine.MemoryHost, 0, nil
	}
	rest, ok := strings.CutPrefix(strings.ToLower(loc), "cuda:")
	if !ok {
		return 0, 0, fmt.Errorf("location %q is not \"cpu\", \"host\" or \"cuda:N\"", loc)
	}
	n, err := strconv.Atoi(rest)
	if err != nil || n < 0 {
		return 0, 0, fmt.Errorf("location %q: device ordinal %q is not a non-negative integer", loc, rest)
	}
	return engine.MemoryCUDA, n, nil
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

func (e *engineObj) register(addr uintptr, n uint64, loc string) (engine.RegionID, error) {
	kind, dev, err := parseLocation(loc)
	if err != nil {
		return 0, failWrap(stInvalidArgument, err, "kvx_register_memory")
	}
	m := engine.Memory{Addr: addr, Length: n, Kind: kind, Device: dev, FD: -1}
	if kind == engine.MemoryHost {
		if fd, off, ok := hostBufferFor(addr, n); ok {
			m.FD, m.FDOffset = fd, off
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return 0, fail(stClosed, "kvx_register_memory: engine is destroyed")
	}
	for id, r := range e.regions {
		if r.mem.Kind == m.Kind && r.mem.Device == m.Device && addr < r.mem.Addr+uintptr(r.mem.Length) && r.mem.Addr < addr+uintptr(n) {
			return 0, fail(stInvalidArgument, "kvx_register_memory: range [%#x, +%d) overlaps region %d [%#x, +%d); deregister it first or register one range covering both", addr, n, id, r.mem.Addr, r.mem.Length)
		}
	}
	desc, err := e.tr.RegisterMemory(m)
	if err != nil {
		return 0, failWrap(stOK, err, "kvx_register_memory: %s range [%#x, +%d bytes) on transport %s", loc, addr, n, e.tr.Name())
	}
	e.regions[desc.ID] = regionInfo{mem: m, desc: desc}
	return desc.ID, nil
}

func (e *engineObj) deregister(id engine.RegionID) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fail(stClosed, "kvx_deregister_memory: engine is destroyed")
	}
	if _, ok := e.regions[id]; !ok {
		return fail(stUnknownRegion, "kvx_deregister_memory: region %d is not registered with this engine (already deregistered?)", id)
	}
	delete(e.regions, id)
	if err := e.tr.DeregisterMemory(id); err != nil {
		return failWrap(stOK, err, "kvx_deregister_memory: region %d", id)
	}
	return nil
}

// checkLocal verifies that every block a request reads lies inside one
// registered local region.
func (e *engineObj) checkLocal(i int, r engine.WriteRequest) error {
	if r.Length == 0 {
		return fail(stInvalidArgument, "kvx_batch_submit: request %d has length 0 bytes", i)
	}
	span := r.Length
	if r.Blocks() > 1 {
		span = (r.Blocks()-1)*r.LocalStride + r.Length
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, reg := range e.regions {
		m := reg.mem
		if r.Local >= m.Addr && uint64(r.Local-m.Addr) <= m.Length && span <= m.Length-uint64(r.Local-m.Addr) {
			return nil
		}
	}
	return fail(stNotRegistered, "kvx_batch_submit: request %d reads [%#x, +%d bytes), which is not inside memory registered with the sending engine (call kvx_register_memory first)", i, r.Local, span)
}

// segmentDesc is the blob kvx_segment_export writes: what a sender needs to
// open a segment. JSON keeps it debuggable; it is opaque to C callers.
type segmentDesc struct {
	Version   int                 `json:"v"`
	Transport string              `json:"transport"`
	Peer      string              `json:"peer"`
	Endpoint  []byte              `json:"endpoint"`
	Regions   []engine.RegionDesc `json:"regions"`
}

// segmentDescVersion is the blob format version; decoders refuse others.
const segmentDescVersion = 1

// maxSegmentDesc bounds the blob a sender accepts (1 MiB).
const maxSegmentDesc = 1 << 20

func (e *engineObj) exportSegment(peer string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	ep, err := e.tr.Endpoint(ctx, peer)
	if err != nil {
		return nil, failWrap(stOK, err, "kvx_segment_export: endpoint of transport %s for peer %q", e.tr.Name(), peer)
	}
	e.mu.Lock()
	d := segmentDesc{Version: segmentDescVersion, Transport: e.tr.Name(), Peer: peer, Endpoint: ep}
	for _, r := range e.regions {
		d.Regions = append(d.Regions, r.desc)
	}
	e.mu.Unlock()
	sort.Slice(d.Regions, func(i, j int) bool { return d.Regions[i].ID < d.Regions[j].ID })
	return json.Marshal(d)
}

// decodeSegmentDesc parses and validates a blob from kvx_segment_export.
func decodeSegmentDesc(b []byte) (segmentDesc, error) {
	var d segmentDesc
	if len(b) == 0 {
		return d, fail(stInvalidArgument, "segment descriptor is empty (pass the bytes kvx_segment_export wrote)")
	}
	if len(b) > maxSegmentDesc {
		return d, fail(stInvalidArgument, "segment descriptor is %d bytes, over the %d-byte limit", len(b), maxSegmentDesc)
	}
	if err := json.Unmarshal(b, &d); err != nil {
		return d, failWrap(stInvalidArgument, err, "segment descriptor is not a kvx_segment_export blob")
	}
	if d.Version != segmentDescVersion {
		return d, fail(stInvalidArgument, "segment descriptor version %d is not %d (sender and receiver run different kvxfer versions)", d.Version, segmentDescVersion)
	}
	if d.Transport == "" || len(d.Endpoint) == 0 {
		return d, fail(stInvalidArgument, "segment descriptor has no transport or endpoint")
	}
	seen := map[engine.RegionID]bool{}
	for _, r := range d.Regions {
		if r.Length == 0 {
			return d, fail(stInvalidArgument, "segment descriptor: region %d has length 0", r.ID)
		}
		if seen[r.ID] {
			return d, fail(stInvalidArgument, "segment descriptor: region %d listed twice", r.ID)
		}
		seen[r.ID] = true
	}
	return d, nil
}

// segmentObj is one kvx_segment_t.
type segmentObj struct {
	eng     *engineObj
	engH    uint64
	seg     engine.Segment
	regions map[engine.RegionID]engine.RegionDesc

	mu      sync.Mutex
	closed  bool
	batches map[uint64]struct{}
}

func (e *engineObj) openSegment(engH uint64, blob []byte) (uint64, error) {
	d, err := decodeSegmentDesc(blob)
	if err != nil {
		return 0, failWrap(stOK, err, "kvx_segment_open")
	}
	if d.Transport != e.tr.Name() {
		return 0, fail(stInvalidArgument, "kvx_segment_open: descriptor is for transport %q but this engine runs %q; create both engines with the same transport", d.Transport, e.tr.Name())
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	seg, err := e.tr.OpenSegment(ctx, engine.SegmentInfo{Endpoint: d.Endpoint, Regions: d.Regions})
	if err != nil {
		return 0, failWrap(stOK, err, "kvx_segment_open: connect to receiver over %s", d.Transport)
	}
	s := &segmentObj{eng: e, engH: engH, seg: seg, regions: map[engine.RegionID]engine.RegionDesc{}, batches: map[uint64]struct{}{}}
	for _, r := range d.Regions {
		s.regions[r.ID] = r
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		seg.Close()
		return 0, fail(stClosed, "kvx_segment_open: engine destroyed during the call")
	}
	h := segments.add(s)
	e.segments[h] = struct{}{}
	e.mu.Unlock()
	return h, nil
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

// batchPart is one kvx_batch_submit call: one engine TransferBatch.
type batchPart struct {
	first, count uint32
	id           engine.BatchID
	bytes        []uint64 // per-request payload
	cancel       context.CancelFunc
	done         chan struct{}
	st           engine.BatchStatus // valid after done is closed
}

func (b *batchObj) submit(batchH uint64, reqs []engine.WriteRequest) error {
	for i, r := range reqs {
		if err := b.seg.eng.checkLocal(i, r); err != nil {
			return err
		}
		rd, ok := b.seg.regions[r.Remote]
		if !ok {
			return fail(stUnknownRegion, "kvx_batch_submit: request %d names remote region %d, which the receiver had not registered when it exported the segment (register it before kvx_segment_export)", i, r.Remote)
		}
		end := r.RemoteOffset + r.Length
		if r.Blocks() > 1 {
			end = r.RemoteOffset + (r.Blocks()-1)*r.RemoteStride + r.Length
		}
		if end < r.RemoteOffset || end > rd.Length {
			return fail(stOutOfBounds, "kvx_batch_submit: request %d writes up to byte %d of remote region %d, which has %d bytes", i, end, r.Remote, rd.Length)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return fail(stBadHandle, "kvx_batch_submit: batch %d was freed", batchH)
	}
	if uint64(b.n)+uint64(len(reqs)) > uint64(b.capacity) {
		return fail(stBusy, "kvx_batch_submit: %d requests do not fit: batch capacity %d, %d already submitted (allocate a larger batch)", len(reqs), b.capacity, b.n)
	}
	tb := &engine.TransferBatch{Requests: reqs}
	id, err := b.seg.seg.Submit(context.Background(), tb)
	if err != nil {
		return failWrap(stOK, err, "kvx_batch_submit: submit %d requests (%d bytes)", len(reqs), tb.Bytes())
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &batchPart{first: b.n, count: uint32(len(reqs)), id: id, cancel: cancel, done: make(chan struct{})}
	for _, r := range reqs {
		p.bytes = append(p.bytes, r.Bytes())
	}
	b.parts = append(b.parts, p)
	b.n += uint32(len(reqs))
	eng := b.seg.eng
	go func() {
		st, err := b.seg.seg.Wait(ctx, id)
		if err != nil && !st.State.Terminal() {
			// The wait was abandoned (free or close); poll once more.
			if s2, err2 := b.seg.seg.Poll(id); err2 == nil && s2.State.Terminal() {
				st = s2
			} else {
				st = engine.BatchStatus{State: engine.BatchFailed, Err: err}
			}
		}
		p.st = st
		close(p.done)
		eng.notify.post(eventBatch(batchH, p))
	}()
	return nil
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
func transferState(s engine.BatchState) int32 {
	switch s {
	case engine.BatchPending:
		return 1
	case engine.BatchCompleted:
		return 2
	case engine.BatchFailed:
		return 3
	case engine.BatchCanceled:
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
		if st.State == engine.BatchCompleted {
			bytes = p.bytes[i-p.first]
		} else {
			code = codeOf(st.Err)
			if st.State == engine.BatchCanceled {
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
		select {
		case <-p.done:
		case <-t.C:
			return fail(stTimeout, "kvx_batch_wait: requests %d..%d still pending after %v", p.first, p.first+p.count-1, timeout)
		}
		if p.st.State != engine.BatchCompleted && first == nil {
			code := codeOf(p.st.Err)
			if p.st.State == engine.BatchCanceled {
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
func registeredAnywhere(addr uintptr, n uint64) (uint64, engine.RegionID, bool) {
	engines.mu.Lock()
	all := make(map[uint64]*engineObj, len(engines.m))
	for h, e := range engines.m {
		all[h] = e
	}
	engines.mu.Unlock()
	for h, e := range all {
		e.mu.Lock()
		for id, r := range e.regions {
			if addr < r.mem.Addr+uintptr(r.mem.Length) && r.mem.Addr < addr+uintptr(n) {
				e.mu.Unlock()
				return h, id, true
			}
		}
		e.mu.Unlock()
	}
	return 0, 0, false
}
