package rdma

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/ibverbs"
)

func init() {
	transport.RegisterTransport("rdma", 300, Probe, func(o transport.Options) (transport.Transport, error) { return New(o) })
}

// Device-memory registration seams. Tests replace them to exercise the
// dma-buf → peer-memory fallback in regDevice without a GPU or a NIC.
var (
	// dmaBufRange exports the page-aligned device range enclosing
	// [ptr, ptr+size) as a dma-buf fd and returns the offset of ptr inside
	// it, in bytes (cuda.DmaBufRange). The caller closes fd.
	dmaBufRange = cuda.DmaBufRange
	// regDmaBufMR is ibv_reg_dmabuf_mr ((*ibverbs.PD).RegDmaBufMR).
	regDmaBufMR = (*ibverbs.PD).RegDmaBufMR
	// regMR is ibv_reg_mr ((*ibverbs.PD).RegMR); on a device pointer it works
	// only when the nvidia-peermem module is loaded.
	regMR = (*ibverbs.PD).RegMR
)

// peerMemHint is the fix named when GPU memory can be registered neither as
// a dma-buf MR nor as a peer-memory MR.
const peerMemHint = "load the nvidia-peermem module (`modprobe nvidia-peermem`) " +
	"or use a kernel (>= 5.12) and NVIDIA driver with dma-buf support (open kernel modules, CUDA >= 11.7)"

// deviceRegError reports that a GPU range could be registered with neither
// ibv_reg_dmabuf_mr nor ibv_reg_mr. It wraps transport.ErrUnsupportedMemory and
// both causes (errors.Is finds any of them).
type deviceRegError struct {
	nic    string  // RDMA device name, e.g. "mlx5_0"
	gpu    int     // CUDA device ordinal
	addr   uintptr // first byte of the MR (device pointer)
	length uint64  // MR length in bytes
	dmaBuf error   // why the dma-buf MR failed (export or ibv_reg_dmabuf_mr)
	plain  error   // why ibv_reg_mr on the device pointer failed
}

func (e *deviceRegError) Error() string {
	return fmt.Sprintf("%v: GPU cuda:%d range %#x+%d on %s: dma-buf MR failed (%v); plain MR (peer memory) failed (%v); %s",
		transport.ErrUnsupportedMemory, e.gpu, e.addr, e.length, e.nic, e.dmaBuf, e.plain, peerMemHint)
}

func (e *deviceRegError) Unwrap() []error {
	return []error{transport.ErrUnsupportedMemory, e.dmaBuf, e.plain}
}

// regDevice registers n bytes of GPU memory at m.Addr+off on the RDMA device
// nic (protection domain pd). It tries a dma-buf MR first (the page-aligned
// export enclosing the range, so any address and length work), then a plain
// MR on the device pointer (peer memory, nvidia-peermem). Both MRs use the
// device pointer as their address, so remote writes name the same address
// whichever succeeded. When both fail it returns a *deviceRegError.
func regDevice(pd *ibverbs.PD, nic string, m transport.Memory, off, n uint64) (*ibverbs.MR, error) {
	ptr := m.Addr + uintptr(off)
	var dmaErr error
	fd, bufOff, err := dmaBufRange(ptr, n)
	if err != nil {
		dmaErr = fmt.Errorf("export: %w", err)
	} else {
		mr, err := regDmaBufMR(pd, bufOff, n, uint64(ptr), fd, mrAccess)
		_ = syscall.Close(fd) // the MR holds its own reference to the dma-buf
		if err == nil {
			return mr, nil
		}
		dmaErr = fmt.Errorf("ibv_reg_dmabuf_mr: %w", err)
	}
	mr, err := regMR(pd, ptr, n, mrAccess)
	if err == nil {
		return mr, nil
	}
	return nil, &deviceRegError{nic: nic, gpu: m.Device, addr: ptr, length: n, dmaBuf: dmaErr, plain: fmt.Errorf("ibv_reg_mr: %w", err)}
}

// DefaultStreams is the number of RC QPs per device per peer when
// transport.Options.Streams is 0.
const DefaultStreams = 2

// Defaults of the transport.RDMAOptions settings.
const (
	defaultSliceSize = 1 << 20 // bytes per RDMA WRITE when striping
	defaultSQDepth   = 256     // send WRs in flight per QP
	defaultTimeout   = 14      // QP ACK timeout code: 4.096 us * 2^14 ~ 67 ms
	defaultRetry     = 7       // transport retries before IBV_WC_RETRY_EXC_ERR
)

// config holds the transport's tunables (transport.RDMAOptions fields in
// parentheses).
type config struct {
	sliceSize uint64 // SliceSize: max bytes per WRITE WR (4 KiB..1 GiB)
	sqDepth   int    // SQDepth: send queue depth per QP
	streams   int    // transport.Options.Streams: QPs per device per peer
	timeout   uint8  // QPTimeout: ACK timeout code (0..31)
	retry     uint8  // RetryCount: 0..7
	maxMR     uint64 // MaxMRSize: split regions into MRs of at most this (default: device max_mr_size)
	gidIndex  int
	// stall (StallTimeout, default 10s): with WRs in
	// flight and no completion for this long, the segment declares the peer
	// lost, moves its QPs to ERR and fails the batches with ErrPeerLost. A
	// NIC reports a vanished peer itself (IBV_WC_RETRY_EXC_ERR after about
	// 4.096 us * 2^qp_timeout * (retry_cnt+1)); this is the backstop for
	// devices that retry silently (rxe on Linux 6.1 was seen to).
	stall time.Duration
	// cqEvents (not CQPoll, the default): a segment's
	// pump sleeps on a completion channel (ibv_req_notify_cq, the channel
	// fd in Go's netpoller) while WRs are in flight, instead of polling
	// its CQs with a 20 us..1 ms backoff.
	cqEvents bool
	// log is transport.Options.Logger (slog.Default() when nil).
	log *slog.Logger
}

func parseConfig(o transport.Options) (config, error) {
	c := config{sliceSize: defaultSliceSize, sqDepth: defaultSQDepth, streams: o.Streams,
		timeout: defaultTimeout, retry: defaultRetry, gidIndex: -1, stall: 10 * time.Second, cqEvents: true, log: o.Log()}
	if o.GIDIndex != nil {
		if *o.GIDIndex < 0 || *o.GIDIndex > 255 {
			return c, fmt.Errorf("rdma: GIDIndex %d: want a GID table index 0..255, or nil for automatic selection", *o.GIDIndex)
		}
		c.gidIndex = *o.GIDIndex
	}
	r := o.RDMA
	c.cqEvents = !r.CQPoll
	if r.StallTimeout != 0 {
		if r.StallTimeout < 10*time.Millisecond {
			return c, fmt.Errorf("rdma: RDMAOptions.StallTimeout %v: want at least 10ms, such as 10s (0 for the default)", r.StallTimeout)
		}
		c.stall = r.StallTimeout
	}
	if c.streams <= 0 {
		c.streams = DefaultStreams
	}
	// num checks a set (non-zero) field against its range.
	num := func(field string, v, lo, hi uint64, dst func(uint64)) error {
		if v < lo || v > hi {
			return fmt.Errorf("rdma: RDMAOptions.%s %d: want an integer in [%d, %d] (0 for the default)", field, v, lo, hi)
		}
		dst(v)
		return nil
	}
	var errs []error
	if r.SliceSize != 0 {
		errs = append(errs, num("SliceSize", r.SliceSize, 4096, 1<<30, func(v uint64) { c.sliceSize = v }))
	}
	if r.SQDepth != 0 {
		if r.SQDepth < 0 {
			return c, fmt.Errorf("rdma: RDMAOptions.SQDepth %d: want an integer in [4, 16384] (0 for the default)", r.SQDepth)
		}
		errs = append(errs, num("SQDepth", uint64(r.SQDepth), 4, 16384, func(v uint64) { c.sqDepth = int(v) }))
	}
	if r.QPTimeout != nil {
		errs = append(errs, num("QPTimeout", uint64(*r.QPTimeout), 0, 31, func(v uint64) { c.timeout = uint8(v) }))
	}
	if r.RetryCount != nil {
		errs = append(errs, num("RetryCount", uint64(*r.RetryCount), 0, 7, func(v uint64) { c.retry = uint8(v) }))
	}
	if r.MaxMRSize != 0 {
		errs = append(errs, num("MaxMRSize", r.MaxMRSize, 4096, 1<<62, func(v uint64) { c.maxMR = v }))
	}
	for _, e := range errs {
		if e != nil {
			return c, e
		}
	}
	return c, nil
}

// device is one opened NIC port the transport uses.
type device struct {
	nic    NIC
	name   string
	port   uint8
	gid    ibverbs.GID
	gidIdx int
	pattr  ibverbs.PortAttr
	maxMR  uint64
	// rdAtom is how many incoming RDMA READs one of our QPs serves at
	// once (RTR max_dest_rd_atomic), initRdAtom how many READs one keeps
	// outstanding (RTS max_rd_atomic, also bounded by the peer's rdAtom):
	// the device's limits, capped at maxRdAtomic.
	rdAtom, initRdAtom uint8
	ctx                *ibverbs.Context
	pd                 *ibverbs.PD
	rcq                *ibverbs.CQ // receive-side CQ shared by the receiver's QPs
}

func (d *device) info(qpn, psn uint32) qpInfo {
	return qpInfo{Dev: d.name, QPN: qpn, PSN: psn, GID: d.gid.String(), LID: d.pattr.LID,
		MTU: uint8(d.pattr.ActiveMTU), Global: d.pattr.LinkLayer == ibverbs.LinkLayerEthernet, RdAtom: d.rdAtom}
}

// maxRdAtomic caps the RDMA READs a QP serves or keeps outstanding at once
// (16, what mlx5 devices offer; rxe offers 128): one READ at a time would
// leave a READ stream a round trip per slice.
const maxRdAtomic = 16

// rdDepth clamps a device's READ limit to 1..maxRdAtomic.
func rdDepth(dev int) uint8 { return uint8(min(max(dev, 1), maxRdAtomic)) }

// usable picks the first active port of nic with a selectable GID.
func usable(n NIC, gidIndex int, addrs func(string) ([]net.IP, error)) (Port, GID, error) {
	var errs []error
	for _, p := range n.Ports {
		if !p.Active() {
			errs = append(errs, fmt.Errorf("%s port %d is %q, not ACTIVE", n.Name, p.Num, p.State))
			continue
		}
		g, err := SelectGID(n, p.Num, gidIndex, addrs)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		return p, g, nil
	}
	if len(errs) == 0 {
		errs = append(errs, fmt.Errorf("%s has no ports", n.Name))
	}
	return Port{}, GID{}, errors.Join(errs...)
}

// Probe reports whether the rdma transport can run here: cgo built in, at
// least one RDMA device with an ACTIVE port and a usable GID. Otherwise it
// returns an error wrapping transport.ErrUnavailable that says why.
func Probe() error {
	if !ibverbs.Available {
		return fmt.Errorf("rdma: %w: %w", transport.ErrUnavailable, ibverbs.ErrNoCgo)
	}
	nics, err := Discover()
	if err != nil {
		return fmt.Errorf("rdma: %w: %w", transport.ErrUnavailable, err)
	}
	if len(nics) == 0 {
		return fmt.Errorf("rdma: %w: no RDMA device in /sys/class/infiniband (load the NIC driver, or rdma_rxe for Soft-RoCE)", transport.ErrUnavailable)
	}
	c := newConfig(nil)
	var errs []error
	for _, n := range nics {
		if _, _, err := usable(n, -1, c.addrs); err != nil {
			errs = append(errs, err)
			continue
		}
		return nil
	}
	return fmt.Errorf("rdma: %w: no usable device: %w", transport.ErrUnavailable, errors.Join(errs...))
}

// Transport is the RDMA transport: one node's devices, registered regions,
// receiver-side QPs per peer and sender segments. Safe for concurrent use.
type Transport struct {
	cfg  config
	devs []*device

	mu      sync.Mutex
	closed  bool
	regions map[transport.RegionID]*region
	nextID  transport.RegionID
	peers   map[string]*peerConn
	segs    map[*segment]struct{}
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Acceptor  = (*Transport)(nil)
	_ transport.Fencer    = (*Transport)(nil)
)

// region is a registered memory range, split into MRs per device.
type region struct {
	id    transport.RegionID
	mem   transport.Memory
	mrs   [][]*ibverbs.MR // [device][chunk]
	chunk []uint64        // per-device chunk size in bytes
	desc  transport.RegionDesc
}

// peerConn is the receiver's QPs prepared for one sender peer; epoch is the
// segment epoch admitted for them (AdmitEpoch; 0 = none).
type peerConn struct {
	qps   []*ibverbs.QP
	devs  []*device
	infos []qpInfo
	epoch uint64
}

// New opens the rdma transport on every usable device (o.Devices filters by
// name, a non-nil o.GIDIndex forces a GID index, o.Streams sets QPs per device per
// peer; o.RDMA tunes slices, queues, QP timeouts and retries, MR size, the
// stall timeout and CQ polling; o.Logger gets its logs). Each batch's writes are
// posted per QP as chains of up to SQDepth/4 WRs with only the last one
// signaled (one doorbell and one completion per chain), at most sq_depth
// WRs in flight per QP. Errors wrap transport.ErrUnavailable when no device is usable.
func New(o transport.Options) (*Transport, error) {
	cfg, err := parseConfig(o)
	if err != nil {
		return nil, err
	}
	if !ibverbs.Available {
		return nil, fmt.Errorf("rdma: %w: %w", transport.ErrUnavailable, ibverbs.ErrNoCgo)
	}
	dc := newConfig([]Option{WithDevices(o.Devices...)})
	nics, err := discover(dc)
	if err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, regions: map[transport.RegionID]*region{}, peers: map[string]*peerConn{}, segs: map[*segment]struct{}{}}
	var errs []error
	for _, n := range nics {
		p, g, err := usable(n, cfg.gidIndex, dc.addrs)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		d, err := openDevice(n, p, g, cfg)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		t.devs = append(t.devs, d)
	}
	if len(t.devs) == 0 {
		if len(nics) == 0 {
			errs = append(errs, fmt.Errorf("no RDMA device found (devices filter %v)", o.Devices))
		}
		return nil, fmt.Errorf("rdma: %w: %w", transport.ErrUnavailable, errors.Join(errs...))
	}
	return t, nil
}

func openDevice(n NIC, p Port, g GID, cfg config) (*device, error) {
	ctx, err := ibverbs.Open(n.Name)
	if err != nil {
		return nil, fmt.Errorf("rdma: open %s: %w", n.Name, err)
	}
	d := &device{nic: n, name: n.Name, port: uint8(p.Num), gidIdx: g.Index, ctx: ctx}
	fail := func(stage string, err error) (*device, error) {
		d.close()
		return nil, fmt.Errorf("rdma: %s port %d: %s: %w", n.Name, p.Num, stage, err)
	}
	if d.gid, err = ibverbs.ParseGID(g.Value); err != nil {
		return fail("parse GID", err)
	}
	if d.pattr, err = ctx.QueryPort(d.port); err != nil {
		return fail("query port", err)
	}
	attr, err := ctx.QueryDevice()
	if err != nil {
		return fail("query device", err)
	}
	d.maxMR = attr.MaxMRSize
	d.rdAtom, d.initRdAtom = rdDepth(attr.MaxQPRdAtom), rdDepth(attr.MaxQPInitRdAtom)
	if cfg.maxMR != 0 && (d.maxMR == 0 || cfg.maxMR < d.maxMR) {
		d.maxMR = cfg.maxMR
	}
	if d.pd, err = ctx.AllocPD(); err != nil {
		return fail("alloc PD", err)
	}
	if d.rcq, err = ctx.CreateCQ(64, nil); err != nil {
		return fail("create receive CQ", err)
	}
	return d, nil
}

func (d *device) close() {
	if d.rcq != nil {
		_ = d.rcq.Close()
	}
	if d.pd != nil {
		_ = d.pd.Close()
	}
	_ = d.ctx.Close()
}

// Name returns "rdma".
func (t *Transport) Name() string { return "rdma" }

// Capabilities: host memory, device memory (dma-buf), cross-host,
// zero-copy, the two-step QP handshake, and one-sided READ (RDMA READ work
// requests on the segment's QPs).
func (t *Transport) Capabilities() transport.Caps {
	return transport.CapHostMemory | transport.CapDeviceMemory | transport.CapCrossHost | transport.CapZeroCopy | transport.CapHandshake | transport.CapRead
}

// Devices returns the names of the devices in use, in striping order.
func (t *Transport) Devices() []string {
	out := make([]string, len(t.devs))
	for i, d := range t.devs {
		out[i] = d.name
	}
	return out
}

const mrAccess = ibverbs.AccessLocalWrite | ibverbs.AccessRemoteWrite | ibverbs.AccessRemoteRead

// regHint adds the usual fix to a registration error.
func regHint(err error, kind transport.MemoryKind) error {
	var dre *deviceRegError
	switch {
	case errors.As(err, &dre):
		return err // names its own fix
	case errors.Is(err, syscall.ENOMEM):
		return fmt.Errorf("%w (pinned-memory limit too low? raise RLIMIT_MEMLOCK: `ulimit -l unlimited`, or LimitMEMLOCK=infinity / --ulimit memlock=-1)", err)
	case errors.Is(err, syscall.EFAULT) && kind == transport.MemoryCUDA:
		return fmt.Errorf("%w (GPU memory: needs dma-buf support (kernel >= 5.12, CUDA >= 11.7 open driver) or the nvidia-peermem module)", err)
	case errors.Is(err, syscall.EFAULT):
		return fmt.Errorf("%w (address range not mapped in this process)", err)
	}
	return err
}

// RegisterMemory registers m on every device, split into MRs of at most the
// device's max_mr_size. Device memory (transport.MemoryCUDA) is registered as a
// dma-buf MR, falling back to a plain peer-memory MR (see regDevice); when
// neither works the error wraps transport.ErrUnsupportedMemory and names both
// causes and the fix.
func (t *Transport) RegisterMemory(m transport.Memory) (transport.RegionDesc, error) {
	if m.Length == 0 || m.Addr == 0 {
		return transport.RegionDesc{}, fmt.Errorf("rdma: register %#x+%d: empty or null range", m.Addr, m.Length)
	}
	if m.Addr+uintptr(m.Length) < m.Addr {
		return transport.RegionDesc{}, fmt.Errorf("rdma: register %#x+%d: range wraps the address space", m.Addr, m.Length)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return transport.RegionDesc{}, fmt.Errorf("rdma: register: %w", transport.ErrClosed)
	}
	r := &region{mem: m}
	cleanup := func() {
		for _, ms := range r.mrs {
			for _, mr := range ms {
				_ = mr.Close()
			}
		}
	}
	var key regionKey
	for _, d := range t.devs {
		chunk := m.Length
		if d.maxMR > 0 && chunk > d.maxMR {
			chunk = d.maxMR
		}
		var mrs []*ibverbs.MR
		dk := devKey{Dev: d.name}
		for off := uint64(0); off < m.Length; off += chunk {
			n := min(chunk, m.Length-off)
			mr, err := t.regChunk(d, m, off, n)
			if err != nil {
				for _, x := range mrs {
					_ = x.Close()
				}
				cleanup()
				return transport.RegionDesc{}, fmt.Errorf("rdma: register %s memory %#x+%d on %s (MR at offset %d, %d bytes): %w",
					m.Kind, m.Addr, m.Length, d.name, off, n, regHint(err, m.Kind))
			}
			mrs = append(mrs, mr)
			dk.Chunks = append(dk.Chunks, mrChunkDesc{Off: off, Len: n, RKey: mr.RKey()})
		}
		r.mrs = append(r.mrs, mrs)
		r.chunk = append(r.chunk, chunk)
		key.Devs = append(key.Devs, dk)
	}
	t.nextID++
	r.id = t.nextID
	key.ID = uint32(r.id)
	r.desc = transport.RegionDesc{ID: r.id, Addr: uint64(m.Addr), Length: m.Length, Kind: m.Kind, Key: encodeRegionKey(key)}
	t.regions[r.id] = r
	return r.desc, nil
}

func (t *Transport) regChunk(d *device, m transport.Memory, off, n uint64) (*ibverbs.MR, error) {
	switch m.Kind {
	case transport.MemoryHost:
		return d.pd.RegMR(m.Addr+uintptr(off), n, mrAccess)
	case transport.MemoryCUDA:
		return regDevice(d.pd, d.name, m, off, n)
	}
	return nil, fmt.Errorf("memory kind %v: %w", m.Kind, transport.ErrUnsupportedMemory)
}

// DeregisterMemory deregisters a region's MRs; later remote writes to it
// fail with a remote access error.
func (t *Transport) DeregisterMemory(id transport.RegionID) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.regions[id]
	if !ok {
		return fmt.Errorf("rdma: deregister region %d: %w", id, transport.ErrUnknownRegion)
	}
	delete(t.regions, id)
	var errs []error
	for _, ms := range r.mrs {
		for _, mr := range ms {
			if err := mr.Close(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("rdma: deregister region %d: %w", id, errors.Join(errs...))
	}
	return nil
}

// localLKey finds the registered region holding [addr, addr+n) and returns
// the lkey for device index di plus the bytes left in that MR from addr.
// Callers hold t.mu.
func (t *Transport) localLKey(di int, addr uintptr, n uint64) (lkey uint32, room uint64, ok bool) {
	for _, r := range t.regions {
		if addr < r.mem.Addr || uint64(addr-r.mem.Addr)+n > r.mem.Length || uint64(addr-r.mem.Addr)+n < n {
			continue
		}
		off := uint64(addr - r.mem.Addr)
		c := off / r.chunk[di]
		mr := r.mrs[di][c]
		return mr.LKey(), (c+1)*r.chunk[di] - off, true
	}
	return 0, 0, false
}

func randPSN() uint32 { return rand.Uint32() & 0xffffff }

// Endpoint creates (or recreates) the receiver's QPs for peer, Streams per
// device, in INIT state, and returns their handshake blob. The sender's
// OpenSegment connects to them; Accept completes the pairing.
func (t *Transport) Endpoint(ctx context.Context, peer string) ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, fmt.Errorf("rdma: endpoint for %q: %w", peer, transport.ErrClosed)
	}
	if old := t.peers[peer]; old != nil {
		old.close()
		delete(t.peers, peer)
	}
	pc := &peerConn{}
	for _, d := range t.devs {
		for s := 0; s < t.cfg.streams; s++ {
			qp, err := d.pd.CreateQP(ibverbs.QPInitAttr{SendCQ: d.rcq, RecvCQ: d.rcq, MaxSendWR: 1, MaxRecvWR: 1, MaxSendSGE: 1, MaxRecvSGE: 1})
			if err == nil {
				err = qp.ToInit(d.port, mrAccess)
				if err != nil {
					_ = qp.Close()
				}
			}
			if err != nil {
				pc.close()
				return nil, fmt.Errorf("rdma: %s: create QP for peer %q (endpoint): %w", d.name, peer, regHint(err, transport.MemoryHost))
			}
			pc.qps = append(pc.qps, qp)
			pc.devs = append(pc.devs, d)
			pc.infos = append(pc.infos, d.info(qp.QPN(), randPSN()))
		}
	}
	t.peers[peer] = pc
	return encodeHandshake(handshake{QPs: pc.infos}), nil
}

func (pc *peerConn) close() {
	for _, q := range pc.qps {
		_ = q.Close()
	}
	pc.qps = nil
}

// AdmitEpoch binds epoch (>= 1) to the QPs Endpoint last prepared for peer:
// on rdma those QPs are the epoch's data path (a sender can only write
// through receiver QPs it was paired with by Accept), so FenceEpoch destroys
// them. Errors: epoch 0, a closed transport, no QPs prepared for peer.
func (t *Transport) AdmitEpoch(peer string, epoch uint64) error {
	if epoch == 0 {
		return fmt.Errorf("rdma: admit epoch 0 for %q: epochs start at 1 (0 means no epoch)", peer)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("rdma: admit epoch %d for %q: %w", epoch, peer, transport.ErrClosed)
	}
	pc := t.peers[peer]
	if pc == nil {
		return fmt.Errorf("rdma: admit epoch %d for %q: no QPs prepared (call Endpoint for this peer first)", epoch, peer)
	}
	pc.epoch = epoch
	return nil
}

// FenceEpoch cuts the data path of epoch: the receiver QPs prepared for peer
// under that epoch are moved to the error state (the NIC stops executing
// incoming WRITEs on them; the sender's work requests fail, it sees
// ErrPeerLost) and destroyed, so nothing written through them lands any
// more. The next registration prepares new QPs (Endpoint). QPs of another
// epoch, or none, leave nothing to fence: an older epoch's QPs were destroyed
// when Endpoint recreated them. It does not block; ctx is unused.
func (t *Transport) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	pc := t.peers[peer]
	if pc == nil || pc.epoch != epoch || epoch == 0 {
		return nil
	}
	var errs []error
	var left []*ibverbs.QP
	var leftDevs []*device
	for i, q := range pc.qps {
		_ = q.ToError() // stop executing incoming WRITEs at once; destroy is the fence
		if err := q.Close(); err != nil {
			errs = append(errs, fmt.Errorf("rdma: %s QP %d of peer %q: destroy: %w", pc.devs[i].name, q.QPN(), peer, err))
			left, leftDevs = append(left, q), append(leftDevs, pc.devs[i])
		}
	}
	if len(errs) > 0 {
		pc.qps, pc.devs = left, leftDevs // try again on the next call
		return fmt.Errorf("rdma: fence epoch %d: %w", epoch, errors.Join(errs...))
	}
	pc.qps = nil
	delete(t.peers, peer)
	return nil
}

// Accept moves the QPs prepared for peer to RTR, connected to the sender's
// QPs described in reply (from its Segment.HandshakeReply). Path MTU is the
// smaller of both sides' active MTU.
func (t *Transport) Accept(ctx context.Context, peer string, reply []byte) error {
	h, err := decodeHandshake(reply)
	if err != nil {
		return fmt.Errorf("rdma: accept from peer %q: %w", peer, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("rdma: accept from peer %q: %w", peer, transport.ErrClosed)
	}
	pc := t.peers[peer]
	if pc == nil {
		return fmt.Errorf("rdma: accept from peer %q: no QPs prepared (call Endpoint for this peer first)", peer)
	}
	if len(h.QPs) != len(pc.qps) {
		return fmt.Errorf("rdma: accept from peer %q: reply has %d QPs, endpoint offered %d", peer, len(h.QPs), len(pc.qps))
	}
	for i, qp := range pc.qps {
		d := pc.devs[i]
		if err := connectQP(qp, d, pc.infos[i], h.QPs[i], false, t.cfg); err != nil {
			return fmt.Errorf("rdma: %s QP %d: accept from peer %q (remote QP %d, GID %s): %w", d.name, qp.QPN(), peer, h.QPs[i].QPN, h.QPs[i].GID, err)
		}
	}
	return nil
}

// connectQP moves an INIT QP to RTR towards remote (and on to RTS when
// send is set). The QP serves d.rdAtom incoming READs at once and keeps at
// most min(d.initRdAtom, remote.RdAtom) READs outstanding (a peer of an
// older build advertises no RdAtom and served one: 1).
func connectQP(qp *ibverbs.QP, d *device, local, remote qpInfo, send bool, cfg config) error {
	dgid, err := ibverbs.ParseGID(remote.GID)
	if err != nil {
		return err
	}
	mtu := min(ibverbs.MTU(local.MTU), ibverbs.MTU(remote.MTU))
	if err := qp.ToRTR(ibverbs.RTRAttr{MTU: mtu, DestQPN: remote.QPN, RQPSN: remote.PSN, DLID: remote.LID,
		IsGlobal: local.Global, DGID: dgid, SGIDIndex: uint8(d.gidIdx), HopLimit: 64,
		MaxDestRdAtomic: max(d.rdAtom, 1), MinRNRTimer: 12, Port: d.port}); err != nil {
		return fmt.Errorf("to RTR: %w", err)
	}
	if !send {
		return nil
	}
	if err := qp.ToRTS(ibverbs.RTSAttr{SQPSN: local.PSN, Timeout: cfg.timeout, RetryCnt: cfg.retry, RNRRetry: 7,
		MaxRdAtomic: min(max(d.initRdAtom, 1), max(remote.RdAtom, 1))}); err != nil {
		return fmt.Errorf("to RTS: %w", err)
	}
	return nil
}

// Close fails pending batches, destroys every segment, QP, MR, CQ and PD and
// closes the devices; idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	segs := make([]*segment, 0, len(t.segs))
	for s := range t.segs {
		segs = append(segs, s)
	}
	t.mu.Unlock()
	for _, s := range segs {
		_ = s.Close()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, pc := range t.peers {
		pc.close()
	}
	t.peers = nil
	for id, r := range t.regions {
		for _, ms := range r.mrs {
			for _, mr := range ms {
				_ = mr.Close()
			}
		}
		delete(t.regions, id)
	}
	for _, d := range t.devs {
		d.close()
	}
	return nil
}
