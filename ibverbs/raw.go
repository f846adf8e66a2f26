//go:build cgo

package ibverbs

/*
#cgo pkg-config: libibverbs
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

// Flat descriptors the Go side fills in C memory; the helpers below build the
// real ibv_* structs (whose unions cgo cannot address) in one cgo call.
struct kvx_wr {
	uint64_t id, addr, raddr;
	uint32_t len, lkey, rkey, imm, flags, opcode;
};

struct kvx_wc {
	uint64_t wr_id;
	uint32_t status, opcode, vendor_err, byte_len, imm, qp_num, wc_flags, pad;
};

static int kvx_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {
	return ibv_query_port(c, port, a);
}

static struct ibv_mr *kvx_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t len, int access) {
	return ibv_reg_mr(pd, (void *)addr, len, access);
}

static struct ibv_mr *kvx_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t off, size_t len, uint64_t iova, int fd, int access) {
	return ibv_reg_dmabuf_mr(pd, off, len, iova, fd, access);
}

static int kvx_post_send(struct ibv_qp *qp, const struct kvx_wr *w, int n,
                         struct ibv_send_wr *wrs, struct ibv_sge *sges, int *bad_idx) {
	struct ibv_send_wr *bad = NULL;
	int i, rc;
	for (i = 0; i < n; i++) {
		memset(&wrs[i], 0, sizeof(wrs[i]));
		sges[i].addr = w[i].addr;
		sges[i].length = w[i].len;
		sges[i].lkey = w[i].lkey;
		wrs[i].wr_id = w[i].id;
		wrs[i].sg_list = w[i].len ? &sges[i] : NULL;
		wrs[i].num_sge = w[i].len ? 1 : 0;
		wrs[i].opcode = (enum ibv_wr_opcode)w[i].opcode;
		wrs[i].send_flags = w[i].flags;
		wrs[i].wr.rdma.remote_addr = w[i].raddr;
		wrs[i].wr.rdma.rkey = w[i].rkey;
		wrs[i].imm_data = htonl(w[i].imm);
		wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
	}
	rc = ibv_post_send(qp, wrs, &bad);
	*bad_idx = (rc && bad) ? (int)(bad - wrs) : -1;
	return rc;
}

static int kvx_post_recv(struct ibv_qp *qp, const struct kvx_wr *w, int n,
                         struct ibv_recv_wr *wrs, struct ibv_sge *sges, int *bad_idx) {
	struct ibv_recv_wr *bad = NULL;
	int i, rc;
	for (i = 0; i < n; i++) {
		memset(&wrs[i], 0, sizeof(wrs[i]));
		sges[i].addr = w[i].addr;
		sges[i].length = w[i].len;
		sges[i].lkey = w[i].lkey;
		wrs[i].wr_id = w[i].id;
		wrs[i].sg_list = w[i].len ? &sges[i] : NULL;
		wrs[i].num_sge = w[i].len ? 1 : 0;
		wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
	}
	rc = ibv_post_recv(qp, wrs, &bad);
	*bad_idx = (rc && bad) ? (int)(bad - wrs) : -1;
	return rc;
}

static int kvx_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc, struct kvx_wc *out) {
	int i, got = ibv_poll_cq(cq, n, wc);
	for (i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].vendor_err = wc[i].vendor_err;
		out[i].byte_len = wc[i].byte_len;
		out[i].imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
		out[i].qp_num = wc[i].qp_num;
		out[i].wc_flags = wc[i].wc_flags;
	}
	return got;
}

static int kvx_qp_to_init(struct ibv_qp *qp, uint8_t port, int access) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = port;
	a.qp_access_flags = access;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int kvx_qp_to_rtr(struct ibv_qp *qp, int mtu, uint32_t dqpn, uint32_t rqpsn, uint16_t dlid,
                         int is_global, const uint8_t *dgid, uint8_t sgid_idx, uint8_t hop,
                         uint8_t max_dest_rd, uint8_t min_rnr, uint8_t port) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = (enum ibv_mtu)mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = rqpsn;
	a.max_dest_rd_atomic = max_dest_rd;
	a.min_rnr_timer = min_rnr;
	a.ah_attr.dlid = dlid;
	a.ah_attr.sl = 0;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = port;
	if (is_global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
		a.ah_attr.grh.sgid_index = sgid_idx;
		a.ah_attr.grh.hop_limit = hop;
		a.ah_attr.grh.traffic_class = 0;
		a.ah_attr.grh.flow_label = 0;
	}
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
	                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static int kvx_qp_to_rts(struct ibv_qp *qp, uint32_t sqpsn, uint8_t timeout, uint8_t retry,
                         uint8_t rnr, uint8_t max_rd) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = sqpsn;
	a.timeout = timeout;
	a.retry_cnt = retry;
	a.rnr_retry = rnr;
	a.max_rd_atomic = max_rd;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
	                     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static int kvx_qp_to_err(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

static int kvx_qp_state(struct ibv_qp *qp, int *state) {
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	int rc = ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
	*state = a.qp_state;
	return rc;
}

static struct ibv_qp *kvx_create_rc_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
                                       uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_send_sge,
                                       uint32_t max_recv_sge, uint32_t max_inline, int sig_all) {
	struct ibv_qp_init_attr ia;
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = scq;
	ia.recv_cq = rcq;
	ia.qp_type = IBV_QPT_RC;
	ia.sq_sig_all = sig_all;
	ia.cap.max_send_wr = max_send_wr;
	ia.cap.max_recv_wr = max_recv_wr;
	ia.cap.max_send_sge = max_send_sge;
	ia.cap.max_recv_sge = max_recv_sge;
	ia.cap.max_inline_data = max_inline;
	return ibv_create_qp(pd, &ia);
}

static const char *kvx_dev_name(struct ibv_context *c) { return ibv_get_device_name(c->device); }
static struct ibv_device *kvx_dev_at(struct ibv_device **l, int i) { return l[i]; }
static int kvx_channel_fd(struct ibv_comp_channel *ch) { return ch->fd; }
static uint32_t kvx_qp_num(struct ibv_qp *qp) { return qp->qp_num; }
static uint32_t kvx_mr_lkey(struct ibv_mr *mr) { return mr->lkey; }
static uint32_t kvx_mr_rkey(struct ibv_mr *mr) { return mr->rkey; }
static int kvx_cq_cqe(struct ibv_cq *cq) { return cq->cqe; }
static int kvx_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq) {
	void *ctx;
	return ibv_get_cq_event(ch, cq, &ctx);
}
*/
import "C"

import (
	"syscall"
	"unsafe"
)

// The raw layer: lowercase, one-to-one wrappers of the C calls. Each returns
// the C result and, for errno-setting calls, the errno (cgo two-value form).
// Callers in verbs.go turn these into *Error values.

type (
	cContext     = *C.struct_ibv_context
	cPD          = *C.struct_ibv_pd
	cMR          = *C.struct_ibv_mr
	cCQ          = *C.struct_ibv_cq
	cQP          = *C.struct_ibv_qp
	cCompChannel = *C.struct_ibv_comp_channel
	cWR          = C.struct_kvx_wr
	cWC          = C.struct_kvx_wc
	cIbvWC       = C.struct_ibv_wc
	cSendWR      = C.struct_ibv_send_wr
	cRecvWR      = C.struct_ibv_recv_wr
	cSGE         = C.struct_ibv_sge
)

func rawDeviceNames() ([]string, []uint64, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, nil, errnoErr("ibv_get_device_list", err)
	}
	defer C.ibv_free_device_list(list)
	names := make([]string, int(n))
	guids := make([]uint64, int(n))
	for i := range names {
		d := C.kvx_dev_at(list, C.int(i))
		names[i] = C.GoString(C.ibv_get_device_name(d))
		guids[i] = uint64(C.ibv_get_device_guid(d))
	}
	return names, guids, nil
}

func rawOpenDevice(name string) (cContext, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, errnoErr("ibv_get_device_list", err)
	}
	defer C.ibv_free_device_list(list)
	for i := 0; i < int(n); i++ {
		d := C.kvx_dev_at(list, C.int(i))
		if C.GoString(C.ibv_get_device_name(d)) != name {
			continue
		}
		c, err := C.ibv_open_device(d)
		if c == nil {
			return nil, errnoErr("ibv_open_device", err)
		}
		return c, nil
	}
	return nil, ErrNoDevice
}

func rawCloseDevice(c cContext) error {
	if rc := C.ibv_close_device(c); rc != 0 {
		return &Error{Op: "ibv_close_device", Errno: syscall.EIO}
	}
	return nil
}

func rawDeviceName(c cContext) string { return C.GoString(C.kvx_dev_name(c)) }

func rawQueryDevice(c cContext) (DeviceAttr, error) {
	var a C.struct_ibv_device_attr
	if rc := C.ibv_query_device(c, &a); rc != 0 {
		return DeviceAttr{}, &Error{Op: "ibv_query_device", Errno: syscall.Errno(rc)}
	}
	return DeviceAttr{
		FWVer:           C.GoString(&a.fw_ver[0]),
		NodeGUID:        uint64(a.node_guid),
		VendorID:        uint32(a.vendor_id),
		VendorPartID:    uint32(a.vendor_part_id),
		MaxMRSize:       uint64(a.max_mr_size),
		MaxQP:           int(a.max_qp),
		MaxQPWR:         int(a.max_qp_wr),
		MaxSGE:          int(a.max_sge),
		MaxCQ:           int(a.max_cq),
		MaxCQE:          int(a.max_cqe),
		MaxMR:           int(a.max_mr),
		MaxPD:           int(a.max_pd),
		MaxQPRdAtom:     int(a.max_qp_rd_atom),
		MaxQPInitRdAtom: int(a.max_qp_init_rd_atom),
		PhysPortCnt:     int(a.phys_port_cnt),
	}, nil
}

func rawQueryPort(c cContext, port uint8) (PortAttr, error) {
	var a C.struct_ibv_port_attr
	if rc := C.kvx_query_port(c, C.uint8_t(port), &a); rc != 0 {
		return PortAttr{}, &Error{Op: "ibv_query_port", Errno: syscall.Errno(rc)}
	}
	return PortAttr{
		State:       PortState(a.state),
		MaxMTU:      MTU(a.max_mtu),
		ActiveMTU:   MTU(a.active_mtu),
		GIDTblLen:   int(a.gid_tbl_len),
		LID:         uint16(a.lid),
		LinkLayer:   uint8(a.link_layer),
		ActiveSpeed: uint8(a.active_speed),
		ActiveWidth: uint8(a.active_width),
	}, nil
}

func rawQueryGID(c cContext, port uint8, index int) (GID, error) {
	var g C.union_ibv_gid
	rc, err := C.ibv_query_gid(c, C.uint8_t(port), C.int(index), &g)
	if rc != 0 {
		return GID{}, errnoErr("ibv_query_gid", err)
	}
	var out GID
	copy(out[:], C.GoBytes(unsafe.Pointer(&g), 16))
	return out, nil
}

func rawAllocPD(c cContext) (cPD, error) {
	p, err := C.ibv_alloc_pd(c)
	if p == nil {
		return nil, errnoErr("ibv_alloc_pd", err)
	}
	return p, nil
}

func rawDeallocPD(p cPD) error {
	if rc := C.ibv_dealloc_pd(p); rc != 0 {
		return &Error{Op: "ibv_dealloc_pd", Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawRegMR(p cPD, addr uintptr, length uint64, access Access) (cMR, error) {
	m, err := C.kvx_reg_mr(p, C.uintptr_t(addr), C.size_t(length), C.int(access))
	if m == nil {
		return nil, errnoErr("ibv_reg_mr", err)
	}
	return m, nil
}

func rawRegDmaBufMR(p cPD, offset, length, iova uint64, fd int, access Access) (cMR, error) {
	m, err := C.kvx_reg_dmabuf_mr(p, C.uint64_t(offset), C.size_t(length), C.uint64_t(iova), C.int(fd), C.int(access))
	if m == nil {
		return nil, errnoErr("ibv_reg_dmabuf_mr", err)
	}
	return m, nil
}

func rawDeregMR(m cMR) error {
	if rc := C.ibv_dereg_mr(m); rc != 0 {
		return &Error{Op: "ibv_dereg_mr", Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawMRKeys(m cMR) (lkey, rkey uint32) { return uint32(C.kvx_mr_lkey(m)), uint32(C.kvx_mr_rkey(m)) }

func rawCreateCompChannel(c cContext) (cCompChannel, error) {
	ch, err := C.ibv_create_comp_channel(c)
	if ch == nil {
		return nil, errnoErr("ibv_create_comp_channel", err)
	}
	return ch, nil
}

func rawDestroyCompChannel(ch cCompChannel) error {
	if rc := C.ibv_destroy_comp_channel(ch); rc != 0 {
		return &Error{Op: "ibv_destroy_comp_channel", Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawChannelFD(ch cCompChannel) int { return int(C.kvx_channel_fd(ch)) }

func rawGetCQEvent(ch cCompChannel) (cCQ, error) {
	var cq cCQ
	rc, err := C.kvx_get_cq_event(ch, &cq)
	if rc != 0 {
		return nil, errnoErr("ibv_get_cq_event", err)
	}
	return cq, nil
}

func rawAckCQEvents(cq cCQ, n uint) { C.ibv_ack_cq_events(cq, C.uint(n)) }

func rawCreateCQ(c cContext, cqe int, ch cCompChannel) (cCQ, error) {
	cq, err := C.ibv_create_cq(c, C.int(cqe), nil, ch, 0)
	if cq == nil {
		return nil, errnoErr("ibv_create_cq", err)
	}
	return cq, nil
}

func rawCQE(cq cCQ) int { return int(C.kvx_cq_cqe(cq)) }

func rawDestroyCQ(cq cCQ) error {
	if rc := C.ibv_destroy_cq(cq); rc != 0 {
		return &Error{Op: "ibv_destroy_cq", Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawReqNotifyCQ(cq cCQ, solicitedOnly bool) error {
	s := C.int(0)
	if solicitedOnly {
		s = 1
	}
	if rc := C.ibv_req_notify_cq(cq, s); rc != 0 {
		return &Error{Op: "ibv_req_notify_cq", Errno: syscall.Errno(rc)}
	}
	return nil
}

// rawPollCQ polls up to n completions into the C scratch arrays; a negative
// return from ibv_poll_cq becomes an *Error with Ret set (it is not an
// errno, and ibv_poll_cq sets none).
func rawPollCQ(cq cCQ, n int, wc *cIbvWC, out *cWC) (int, error) {
	got := int(C.kvx_poll_cq(cq, C.int(n), wc, out))
	if got < 0 {
		return 0, &Error{Op: "ibv_poll_cq", Ret: got}
	}
	return got, nil
}

func rawCreateRCQP(p cPD, scq, rcq cCQ, a QPInitAttr) (cQP, error) {
	sig := C.int(0)
	if a.SignalAll {
		sig = 1
	}
	qp, err := C.kvx_create_rc_qp(p, scq, rcq, C.uint32_t(a.MaxSendWR), C.uint32_t(a.MaxRecvWR),
		C.uint32_t(a.MaxSendSGE), C.uint32_t(a.MaxRecvSGE), C.uint32_t(a.MaxInlineData), sig)
	if qp == nil {
		return nil, errnoErr("ibv_create_qp", err)
	}
	return qp, nil
}

func rawDestroyQP(qp cQP) error {
	if rc := C.ibv_destroy_qp(qp); rc != 0 {
		return &Error{Op: "ibv_destroy_qp", Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawQPNum(qp cQP) uint32 { return uint32(C.kvx_qp_num(qp)) }

func modifyErr(op string, rc C.int) error {
	if rc != 0 {
		return &Error{Op: op, Errno: syscall.Errno(rc)}
	}
	return nil
}

func rawQPToInit(qp cQP, port uint8, access Access) error {
	return modifyErr("ibv_modify_qp(INIT)", C.kvx_qp_to_init(qp, C.uint8_t(port), C.int(access)))
}

func rawQPToRTR(qp cQP, a RTRAttr) error {
	g := C.CBytes(a.DGID[:])
	defer C.free(g)
	glob := C.int(0)
	if a.IsGlobal {
		glob = 1
	}
	return modifyErr("ibv_modify_qp(RTR)", C.kvx_qp_to_rtr(qp, C.int(a.MTU), C.uint32_t(a.DestQPN), C.uint32_t(a.RQPSN),
		C.uint16_t(a.DLID), glob, (*C.uint8_t)(g), C.uint8_t(a.SGIDIndex), C.uint8_t(a.HopLimit),
		C.uint8_t(a.MaxDestRdAtomic), C.uint8_t(a.MinRNRTimer), C.uint8_t(a.Port)))
}

func rawQPToRTS(qp cQP, a RTSAttr) error {
	return modifyErr("ibv_modify_qp(RTS)", C.kvx_qp_to_rts(qp, C.uint32_t(a.SQPSN), C.uint8_t(a.Timeout),
		C.uint8_t(a.RetryCnt), C.uint8_t(a.RNRRetry), C.uint8_t(a.MaxRdAtomic)))
}

func rawQPToErr(qp cQP) error { return modifyErr("ibv_modify_qp(ERR)", C.kvx_qp_to_err(qp)) }

func rawQPState(qp cQP) (QPState, error) {
	var s C.int
	if rc := C.kvx_qp_state(qp, &s); rc != 0 {
		return 0, &Error{Op: "ibv_query_qp", Errno: syscall.Errno(rc)}
	}
	return QPState(s), nil
}

// rawPostSend posts n descriptors from w; ibv_post_send returns the errno.
func rawPostSend(qp cQP, w *cWR, n int, wrs *cSendWR, sges *cSGE) (int, error) {
	var bad C.int
	if rc := C.kvx_post_send(qp, w, C.int(n), wrs, sges, &bad); rc != 0 {
		return int(bad), &Error{Op: "ibv_post_send", Errno: syscall.Errno(rc)}
	}
	return n, nil
}

func rawPostRecv(qp cQP, w *cWR, n int, wrs *cRecvWR, sges *cSGE) (int, error) {
	var bad C.int
	if rc := C.kvx_post_recv(qp, w, C.int(n), wrs, sges, &bad); rc != 0 {
		return int(bad), &Error{Op: "ibv_post_recv", Errno: syscall.Errno(rc)}
	}
	return n, nil
}

// cAlloc returns zeroed C memory of n*size bytes (never nil; aborts on OOM as
// malloc failure here means the process is already lost).
func cAlloc(n, size uintptr) unsafe.Pointer { return C.calloc(C.size_t(n), C.size_t(size)) }

func cFree(p unsafe.Pointer) { C.free(p) }

const (
	sizeofWR     = unsafe.Sizeof(C.struct_kvx_wr{})
	sizeofWC     = unsafe.Sizeof(C.struct_kvx_wc{})
	sizeofIbvWC  = unsafe.Sizeof(C.struct_ibv_wc{})
	sizeofSendWR = unsafe.Sizeof(C.struct_ibv_send_wr{})
	sizeofRecvWR = unsafe.Sizeof(C.struct_ibv_recv_wr{})
	sizeofSGE    = unsafe.Sizeof(C.struct_ibv_sge{})
)

func fillWR(w *cWR, id, addr, raddr uint64, length, lkey, rkey, imm, flags, opcode uint32) {
	w.id = C.uint64_t(id)
	w.addr = C.uint64_t(addr)
	w.raddr = C.uint64_t(raddr)
	w.len = C.uint32_t(length)
	w.lkey = C.uint32_t(lkey)
	w.rkey = C.uint32_t(rkey)
	w.imm = C.uint32_t(imm)
	w.flags = C.uint32_t(flags)
	w.opcode = C.uint32_t(opcode)
}

func readWC(c *cWC, w *WC) {
	w.WRID = uint64(c.wr_id)
	w.Status = WCStatus(c.status)
	w.Opcode = WCOpcode(c.opcode)
	w.VendorErr = uint32(c.vendor_err)
	w.ByteLen = uint32(c.byte_len)
	w.Imm = uint32(c.imm)
	w.HasImm = c.wc_flags&C.IBV_WC_WITH_IMM != 0
	w.QPNum = uint32(c.qp_num)
}
