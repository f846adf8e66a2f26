//go:build cgo

package ibverbs

import (
	"fmt"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Available reports whether cgo support is compiled in (true in this build).
const Available = true

// DeviceInfo names one RDMA device visible to libibverbs.
type DeviceInfo struct {
	Name string // e.g. "mlx5_0", "rxe0"
	GUID uint64 // node GUID in network byte order, as ibv_get_device_guid returns it
}

// Devices lists the RDMA devices (ibv_get_device_list). An empty list with a
// nil error means the library works but no device is present.
func Devices() ([]DeviceInfo, error) {
	names, guids, err := rawDeviceNames()
	if err != nil {
		return nil, err
	}
	out := make([]DeviceInfo, len(names))
	for i := range names {
		out[i] = DeviceInfo{Name: names[i], GUID: guids[i]}
	}
	return out, nil
}

// Context is an open device (struct ibv_context). Safe for concurrent use.
type Context struct {
	mu     sync.Mutex
	c      cContext
	name   string
	id     uintptr
	closed bool
}

// Open opens the named device. Errors: ErrNoDevice when no device has that
// name, *Error from ibv_get_device_list/ibv_open_device otherwise.
func Open(name string) (*Context, error) {
	c, err := rawOpenDevice(name)
	if err != nil {
		if err == ErrNoDevice {
			return nil, fmt.Errorf("%w: %q (see ibv_devices)", ErrNoDevice, name)
		}
		return nil, err
	}
	return &Context{c: c, name: rawDeviceName(c), id: track("Context " + name)}, nil
}

// Name returns the device name.
func (c *Context) Name() string { return c.name }

func (c *Context) handle() (cContext, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, fmt.Errorf("%w: context %s", ErrClosed, c.name)
	}
	return c.c, nil
}

// Close closes the device; idempotent. Close every PD, CQ, QP and channel of
// the context first (ibv_close_device does not check).
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	untrack(c.id)
	return rawCloseDevice(c.c)
}

// QueryDevice returns the device attributes (ibv_query_device).
func (c *Context) QueryDevice() (DeviceAttr, error) {
	h, err := c.handle()
	if err != nil {
		return DeviceAttr{}, err
	}
	return rawQueryDevice(h)
}

// QueryPort returns the attributes of a 1-based port (ibv_query_port).
func (c *Context) QueryPort(port uint8) (PortAttr, error) {
	h, err := c.handle()
	if err != nil {
		return PortAttr{}, err
	}
	return rawQueryPort(h, port)
}

// QueryGID returns GID table entry index of a port (ibv_query_gid). An unused
// entry is the zero GID.
func (c *Context) QueryGID(port uint8, index int) (GID, error) {
	h, err := c.handle()
	if err != nil {
		return GID{}, err
	}
	return rawQueryGID(h, port, index)
}

// GIDType reads the type of a GID entry from sysfs under /sys.
func (c *Context) GIDType(port uint8, index int) (GIDType, error) {
	return SysfsGIDType("/sys", c.name, int(port), index)
}

// PD is a protection domain. Safe for concurrent use.
type PD struct {
	mu     sync.Mutex
	ctx    *Context
	p      cPD
	id     uintptr
	closed bool
}

// AllocPD allocates a protection domain (ibv_alloc_pd).
func (c *Context) AllocPD() (*PD, error) {
	h, err := c.handle()
	if err != nil {
		return nil, err
	}
	p, err := rawAllocPD(h)
	if err != nil {
		return nil, err
	}
	return &PD{ctx: c, p: p, id: track("PD on " + c.name)}, nil
}

func (p *PD) handle() (cPD, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, fmt.Errorf("%w: PD", ErrClosed)
	}
	return p.p, nil
}

// Close deallocates the PD; idempotent. Fails with EBUSY while MRs or QPs
// still use it.
func (p *PD) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if err := rawDeallocPD(p.p); err != nil {
		return err
	}
	p.closed = true
	untrack(p.id)
	return nil
}

// MR is a registered memory region.
type MR struct {
	mu     sync.Mutex
	m      cMR
	addr   uint64
	length uint64
	lkey   uint32
	rkey   uint32
	id     uintptr
	closed bool
}

// RegMR registers length bytes of host memory at addr (ibv_reg_mr). The
// memory must be C- or mmap-allocated (never Go heap: the NIC reads it
// asynchronously) and stay mapped until Close. ENOMEM usually means
// RLIMIT_MEMLOCK is too low (ulimit -l).
func (p *PD) RegMR(addr uintptr, length uint64, access Access) (*MR, error) {
	h, err := p.handle()
	if err != nil {
		return nil, err
	}
	m, err := rawRegMR(h, addr, length, access)
	if err != nil {
		return nil, err
	}
	lk, rk := rawMRKeys(m)
	return &MR{m: m, addr: uint64(addr), length: length, lkey: lk, rkey: rk, id: track(fmt.Sprintf("MR %#x+%d", addr, length))}, nil
}

// RegDmaBufMR registers length bytes at offset inside a dma-buf fd (GPU
// memory exported by the CUDA driver) with I/O virtual address iova, which
// remote peers then use as the remote address (ibv_reg_dmabuf_mr). The fd
// may be closed after registration.
func (p *PD) RegDmaBufMR(offset, length, iova uint64, fd int, access Access) (*MR, error) {
	h, err := p.handle()
	if err != nil {
		return nil, err
	}
	m, err := rawRegDmaBufMR(h, offset, length, iova, fd, access)
	if err != nil {
		return nil, err
	}
	lk, rk := rawMRKeys(m)
	return &MR{m: m, addr: iova, length: length, lkey: lk, rkey: rk, id: track(fmt.Sprintf("dma-buf MR fd %d+%d", fd, length))}, nil
}

// Addr returns the first registered address (the iova for dma-buf MRs).
func (m *MR) Addr() uint64 { return m.addr }

// Len returns the registered length in bytes.
func (m *MR) Len() uint64 { return m.length }

// LKey returns the local key for scatter/gather entries.
func (m *MR) LKey() uint32 { return m.lkey }

// RKey returns the remote key peers use in RDMA WRITEs.
func (m *MR) RKey() uint32 { return m.rkey }

// Close deregisters the MR; idempotent.
func (m *MR) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	if err := rawDeregMR(m.m); err != nil {
		return err
	}
	m.closed = true
	untrack(m.id)
	return nil
}

// CompChannel is a completion event channel (struct ibv_comp_channel).
type CompChannel struct {
	mu     sync.Mutex
	ch     cCompChannel
	id     uintptr
	closed bool
}

// CreateCompChannel creates a completion channel whose fd is non-blocking.
func (c *Context) CreateCompChannel() (*CompChannel, error) {
	h, err := c.handle()
	if err != nil {
		return nil, err
	}
	ch, err := rawCreateCompChannel(h)
	if err != nil {
		return nil, err
	}
	if err := unix.SetNonblock(rawChannelFD(ch), true); err != nil {
		_ = rawDestroyCompChannel(ch)
		return nil, fmt.Errorf("ibverbs: set completion channel non-blocking: %w", err)
	}
	return &CompChannel{ch: ch, id: track("CompChannel on " + c.name)}, nil
}

// Wait blocks up to timeout for one completion event, consumes and
// acknowledges it. It returns nil on an event, an error wrapping
// unix.ETIMEDOUT on timeout. Re-arm the CQ (ReqNotify) before polling it
// empty, then Wait again.
func (ch *CompChannel) Wait(timeout time.Duration) error {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed {
		return fmt.Errorf("%w: completion channel", ErrClosed)
	}
	fds := []unix.PollFd{{Fd: int32(rawChannelFD(ch.ch)), Events: unix.POLLIN}}
	deadline := time.Now().Add(timeout)
	for {
		ms := int(time.Until(deadline) / time.Millisecond)
		if ms < 0 {
			ms = 0
		}
		n, err := unix.Poll(fds, ms)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("ibverbs: poll completion channel: %w", err)
		}
		if n == 0 {
			return fmt.Errorf("ibverbs: no completion event within %v: %w", timeout, unix.ETIMEDOUT)
		}
		cq, err := rawGetCQEvent(ch.ch)
		if err != nil {
			if e, ok := err.(*Error); ok && e.Errno == unix.EAGAIN {
				continue
			}
			return err
		}
		rawAckCQEvents(cq, 1)
		return nil
	}
}

// FD returns the channel's file descriptor (non-blocking) so an event loop
// can wait for it to become readable (Go's netpoller: dup it and hand the
// copy to os.NewFile) and then call TryGet. The descriptor stays owned by
// the channel: do not close it, and stop watching before Close.
func (ch *CompChannel) FD() int {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed {
		return -1
	}
	return rawChannelFD(ch.ch)
}

// TryGet consumes and acknowledges one pending completion event without
// blocking (ibv_get_cq_event on the non-blocking fd, then
// ibv_ack_cq_events). It reports whether there was one; no pending event is
// (false, nil). Errors: ErrClosed, or the *Error of ibv_get_cq_event.
func (ch *CompChannel) TryGet() (bool, error) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed {
		return false, fmt.Errorf("%w: completion channel", ErrClosed)
	}
	cq, err := rawGetCQEvent(ch.ch)
	if err != nil {
		if e, ok := err.(*Error); ok && e.Errno == unix.EAGAIN {
			return false, nil
		}
		return false, err
	}
	rawAckCQEvents(cq, 1)
	return true, nil
}

// Close destroys the channel; idempotent. Destroy its CQs first.
func (ch *CompChannel) Close() error {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed {
		return nil
	}
	if err := rawDestroyCompChannel(ch.ch); err != nil {
		return err
	}
	ch.closed = true
	untrack(ch.id)
	return nil
}

// CQ is a completion queue. Poll is not safe for concurrent use: one poller
// goroutine owns a CQ (a mutex guards the scratch arrays regardless).
type CQ struct {
	mu     sync.Mutex
	cq     cCQ
	batch  int
	wc     unsafe.Pointer // batch struct ibv_wc
	out    unsafe.Pointer // batch struct kvx_wc
	id     uintptr
	closed bool
}

// maxPollBatch bounds one Poll call's C scratch arrays.
const maxPollBatch = 256

// CreateCQ creates a CQ with at least cqe entries, bound to ch for events
// (ch may be nil).
func (c *Context) CreateCQ(cqe int, ch *CompChannel) (*CQ, error) {
	h, err := c.handle()
	if err != nil {
		return nil, err
	}
	var cch cCompChannel
	if ch != nil {
		cch = ch.ch
	}
	cq, err := rawCreateCQ(h, cqe, cch)
	if err != nil {
		return nil, err
	}
	return &CQ{
		cq:    cq,
		batch: maxPollBatch,
		wc:    cAlloc(maxPollBatch, sizeofIbvWC),
		out:   cAlloc(maxPollBatch, sizeofWC),
		id:    track(fmt.Sprintf("CQ(%d) on %s", cqe, c.name)),
	}, nil
}

// CQE returns the CQ's actual capacity in entries.
func (q *CQ) CQE() int { return rawCQE(q.cq) }

// Poll fills wcs with up to len(wcs) completions (at most 256 per call) in
// one cgo call and no allocation; it returns how many it filled. An error
// means ibv_poll_cq itself failed; failed work requests come back as WCs
// with a non-success Status (see WC.Err).
func (q *CQ) Poll(wcs []WC) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return 0, ErrClosed
	}
	n := len(wcs)
	if n > q.batch {
		n = q.batch
	}
	if n == 0 {
		return 0, nil
	}
	got, err := rawPollCQ(q.cq, n, (*cIbvWC)(q.wc), (*cWC)(q.out))
	if err != nil {
		return 0, err
	}
	outs := unsafe.Slice((*cWC)(q.out), got)
	for i := range outs {
		readWC(&outs[i], &wcs[i])
	}
	return got, nil
}

// ReqNotify arms the CQ to raise one event on its channel at the next
// completion (solicitedOnly: only solicited ones).
func (q *CQ) ReqNotify(solicitedOnly bool) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return ErrClosed
	}
	return rawReqNotifyCQ(q.cq, solicitedOnly)
}

// Close destroys the CQ; idempotent. Destroy its QPs first.
func (q *CQ) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return nil
	}
	if err := rawDestroyCQ(q.cq); err != nil {
		return err
	}
	q.closed = true
	cFree(q.wc)
	cFree(q.out)
	untrack(q.id)
	return nil
}

// QP is a reliable-connected queue pair. Post calls are serialized by an
// internal mutex; state transitions must not race with posts.
type QP struct {
	mu      sync.Mutex
	qp      cQP
	qpn     uint32
	chain   int
	descs   unsafe.Pointer // chain struct kvx_wr
	sendWRs unsafe.Pointer // chain struct ibv_send_wr
	recvWRs unsafe.Pointer // chain struct ibv_recv_wr
	sges    unsafe.Pointer // chain struct ibv_sge
	id      uintptr
	closed  bool
}

// maxChain bounds the WRs built per cgo call; longer chains are posted in
// pieces.
const maxChain = 128

// CreateQP creates an RC QP in the RESET state (ibv_create_qp).
func (p *PD) CreateQP(a QPInitAttr) (*QP, error) {
	h, err := p.handle()
	if err != nil {
		return nil, err
	}
	if a.SendCQ == nil || a.RecvCQ == nil {
		return nil, fmt.Errorf("ibverbs: CreateQP needs SendCQ and RecvCQ")
	}
	if a.MaxSendSGE < 1 {
		a.MaxSendSGE = 1
	}
	if a.MaxRecvSGE < 1 {
		a.MaxRecvSGE = 1
	}
	qp, err := rawCreateRCQP(h, a.SendCQ.cq, a.RecvCQ.cq, a)
	if err != nil {
		return nil, err
	}
	qpn := rawQPNum(qp)
	return &QP{
		qp:      qp,
		qpn:     qpn,
		chain:   maxChain,
		descs:   cAlloc(maxChain, sizeofWR),
		sendWRs: cAlloc(maxChain, sizeofSendWR),
		recvWRs: cAlloc(maxChain, sizeofRecvWR),
		sges:    cAlloc(maxChain, sizeofSGE),
		id:      track(fmt.Sprintf("QP %d", qpn)),
	}, nil
}

// QPN returns the QP number (24 bits).
func (q *QP) QPN() uint32 { return q.qpn }

func (q *QP) locked() error {
	if q.closed {
		return fmt.Errorf("%w: QP %d", ErrClosed, q.qpn)
	}
	return nil
}

// ToInit moves RESET -> INIT on a port with the remote access flags the QP
// grants (AccessRemoteWrite for a WRITE target).
func (q *QP) ToInit(port uint8, access Access) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return err
	}
	return rawQPToInit(q.qp, port, access)
}

// ToRTR moves INIT -> RTR, pointing the QP at its remote peer.
func (q *QP) ToRTR(a RTRAttr) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return err
	}
	return rawQPToRTR(q.qp, a)
}

// ToRTS moves RTR -> RTS so the QP can send.
func (q *QP) ToRTS(a RTSAttr) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return err
	}
	return rawQPToRTS(q.qp, a)
}

// ToError moves the QP to ERR: outstanding WRs complete with WCWRFlushErr.
func (q *QP) ToError() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return err
	}
	return rawQPToErr(q.qp)
}

// State returns the current QP state (ibv_query_qp).
func (q *QP) State() (QPState, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return 0, err
	}
	return rawQPState(q.qp)
}

// PostSend posts the chain wrs (one cgo call per 128 WRs; descriptors are
// built in C memory, no allocation). It returns how many WRs were accepted:
// on error the WRs before that index were posted and will complete, the rest
// were not. ibv_post_send's returned errno is in the *Error (ENOMEM: send
// queue full; EINVAL: bad WR). A WR that cannot run (an RDMA READ with
// SendInline or SendSolicited) is refused with a *WRError before anything
// of the chain is posted (0 accepted).
func (q *QP) PostSend(wrs []SendWR) (int, error) {
	for i := range wrs {
		if err := checkSendWR(i, &wrs[i]); err != nil {
			return 0, err
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return 0, err
	}
	done := 0
	for done < len(wrs) {
		n := len(wrs) - done
		if n > q.chain {
			n = q.chain
		}
		d := unsafe.Slice((*cWR)(q.descs), n)
		for i := range d {
			w := &wrs[done+i]
			fillWR(&d[i], w.ID, uint64(w.Addr), w.RemoteAddr, w.Length, w.LKey, w.RKey, w.Imm, uint32(w.Flags), uint32(w.Opcode))
		}
		ok, err := rawPostSend(q.qp, (*cWR)(q.descs), n, (*cSendWR)(q.sendWRs), (*cSGE)(q.sges))
		if err != nil {
			if ok < 0 {
				ok = 0
			}
			return done + ok, err
		}
		done += n
	}
	return done, nil
}

// PostRecv posts receive WRs (needed for SEND and WRITE_WITH_IMM targets),
// with the same chain and error semantics as PostSend.
func (q *QP) PostRecv(wrs []RecvWR) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.locked(); err != nil {
		return 0, err
	}
	done := 0
	for done < len(wrs) {
		n := len(wrs) - done
		if n > q.chain {
			n = q.chain
		}
		d := unsafe.Slice((*cWR)(q.descs), n)
		for i := range d {
			w := &wrs[done+i]
			fillWR(&d[i], w.ID, uint64(w.Addr), 0, w.Length, w.LKey, 0, 0, 0, 0)
		}
		ok, err := rawPostRecv(q.qp, (*cWR)(q.descs), n, (*cRecvWR)(q.recvWRs), (*cSGE)(q.sges))
		if err != nil {
			if ok < 0 {
				ok = 0
			}
			return done + ok, err
		}
		done += n
	}
	return done, nil
}

// Close destroys the QP; idempotent.
func (q *QP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return nil
	}
	if err := rawDestroyQP(q.qp); err != nil {
		return err
	}
	q.closed = true
	cFree(q.descs)
	cFree(q.sendWRs)
	cFree(q.recvWRs)
	cFree(q.sges)
	untrack(q.id)
	return nil
}
