package ibverbs

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
)

// Sentinel errors. *Error values match them with errors.Is as well as the raw
// syscall.Errno they carry.
var (
	// ErrNoCgo: the package was built without cgo (CGO_ENABLED=0), so no verbs
	// call can run. Rebuild with CGO_ENABLED=1 and libibverbs-dev installed.
	ErrNoCgo = errors.New("ibverbs: built without cgo; rebuild with CGO_ENABLED=1 and libibverbs-dev")
	// ErrNoDevice: no RDMA device is visible (ibv_get_device_list found none,
	// or the named device does not exist).
	ErrNoDevice = errors.New("ibverbs: no such RDMA device")
	// ErrNotSupported matches errno EOPNOTSUPP, ENOSYS and EPROTONOSUPPORT:
	// the device or driver does not implement the operation.
	ErrNotSupported = errors.New("ibverbs: operation not supported by the device")
	// ErrOutOfMemory matches errno ENOMEM: pinning failed (often RLIMIT_MEMLOCK)
	// or the device ran out of resources.
	ErrOutOfMemory = errors.New("ibverbs: out of memory or memlock limit")
	// ErrClosed: the object was closed.
	ErrClosed = errors.New("ibverbs: object closed")
)

// Error is a failed verbs call: Op is the C function ("ibv_reg_mr"), Errno
// the errno it reported (for ibv_post_send/ibv_post_recv/ibv_modify_qp the
// returned value, otherwise errno). Ret is set instead of Errno for a call
// whose negative return value is not an errno: ibv_poll_cq returns a
// provider-specific negative number (e.g. -1, or mlx5's -2 for a CQ in
// error) and sets no errno.
type Error struct {
	Op    string
	Errno syscall.Errno
	Ret   int
}

// Error returns "ibverbs: OP: strerror (errno N)", or for a return value
// that is not an errno "ibverbs: OP: returned N".
func (e *Error) Error() string {
	if e.Errno == 0 && e.Ret != 0 {
		return fmt.Sprintf("ibverbs: %s: returned %d (a provider failure, not an errno: the CQ overran or is in error, or the device was lost)", e.Op, e.Ret)
	}
	return fmt.Sprintf("ibverbs: %s: %v (errno %d)", e.Op, e.Errno, int(e.Errno))
}

// Unwrap returns the syscall.Errno (nil when the call reported none).
func (e *Error) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}

// Is matches the package sentinels ErrNotSupported and ErrOutOfMemory.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrNotSupported:
		return e.Errno == syscall.EOPNOTSUPP || e.Errno == syscall.ENOSYS || e.Errno == syscall.EPROTONOSUPPORT
	case ErrOutOfMemory:
		return e.Errno == syscall.ENOMEM
	}
	return false
}

// errnoErr builds an *Error, mapping a zero or non-Errno error to EIO so that
// a failed call never reads as success.
func errnoErr(op string, err error) error {
	var en syscall.Errno
	if errors.As(err, &en) && en != 0 {
		return &Error{Op: op, Errno: en}
	}
	return &Error{Op: op, Errno: syscall.EIO}
}

// Access are memory-region and QP access flags (enum ibv_access_flags).
type Access uint32

// Access flags, values from <infiniband/verbs.h>.
const (
	AccessLocalWrite       Access = 1
	AccessRemoteWrite      Access = 1 << 1
	AccessRemoteRead       Access = 1 << 2
	AccessRemoteAtomic     Access = 1 << 3
	AccessRelaxedOrdering  Access = 1 << 20
	AccessDefaultRemoteAll        = AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead
)

// MTU is a path MTU enum (enum ibv_mtu): 1 = 256 B ... 5 = 4096 B.
type MTU uint8

// Path MTU values.
const (
	MTU256  MTU = 1
	MTU512  MTU = 2
	MTU1024 MTU = 3
	MTU2048 MTU = 4
	MTU4096 MTU = 5
)

// Bytes returns the MTU in bytes (0 for an invalid value).
func (m MTU) Bytes() int {
	if m < MTU256 || m > MTU4096 {
		return 0
	}
	return 128 << m
}

// String returns e.g. "1024".
func (m MTU) String() string {
	if b := m.Bytes(); b != 0 {
		return fmt.Sprint(b)
	}
	return fmt.Sprintf("mtu(%d)", uint8(m))
}

// GID is a 128-bit port GID (an IPv6 address for RoCE).
type GID [16]byte

// String returns the IPv6 text form (IPv4-mapped GIDs print as ::ffff:a.b.c.d).
func (g GID) String() string {
	if ip := net.IP(g[:]); ip.To4() != nil {
		return "::ffff:" + ip.To4().String()
	}
	return net.IP(g[:]).String()
}

// IsZero reports whether the GID is all zeros (an unused table entry).
func (g GID) IsZero() bool { return g == GID{} }

// IP returns the GID as an IP address.
func (g GID) IP() net.IP { return net.IP(append([]byte(nil), g[:]...)) }

// ParseGID parses a GID in IPv6 text form (also "fe80:0000:...").
func ParseGID(s string) (GID, error) {
	ip := net.ParseIP(strings.TrimSpace(s))
	if ip == nil {
		return GID{}, fmt.Errorf("ibverbs: bad GID %q: not an IPv6 address", s)
	}
	var g GID
	copy(g[:], ip.To16())
	return g, nil
}

// GIDType is the kind of a GID table entry (from sysfs gid_attrs/types).
type GIDType uint8

//go:generate go run golang.org/x/tools/cmd/stringer@v0.51.0 -type GIDType -linecomment -output gidtype_string.go

// GID types.
const (
	// GIDTypeUnknown: the type could not be read.
	GIDTypeUnknown GIDType = iota // unknown
	// GIDTypeIB: InfiniBand or RoCE v1.
	GIDTypeIB // IB/RoCE v1
	// GIDTypeRoCEv2: RoCE v2, routable UDP.
	GIDTypeRoCEv2 // RoCE v2
)

// ParseGIDType maps the sysfs text ("RoCE v2", "IB/RoCE v1") to a GIDType.
func ParseGIDType(s string) GIDType {
	switch strings.TrimSpace(s) {
	case "RoCE v2":
		return GIDTypeRoCEv2
	case "IB/RoCE v1", "RoCE v1", "IB":
		return GIDTypeIB
	}
	return GIDTypeUnknown
}

// SysfsGIDType reads /sys/class/infiniband/DEV/ports/PORT/gid_attrs/types/IDX
// under sysfsRoot ("/sys" on a real host).
func SysfsGIDType(sysfsRoot, dev string, port, index int) (GIDType, error) {
	p := filepath.Join(sysfsRoot, "class/infiniband", dev, "ports", fmt.Sprint(port), "gid_attrs/types", fmt.Sprint(index))
	b, err := os.ReadFile(p)
	if err != nil {
		return GIDTypeUnknown, fmt.Errorf("ibverbs: GID type of %s port %d index %d: %w", dev, port, index, err)
	}
	return ParseGIDType(string(b)), nil
}

// PortState is enum ibv_port_state.
type PortState uint8

// Port states.
const (
	PortNop         PortState = 0
	PortDown        PortState = 1
	PortInit        PortState = 2
	PortArmed       PortState = 3
	PortActive      PortState = 4
	PortActiveDefer PortState = 5
)

// LinkLayer values of PortAttr.LinkLayer.
const (
	LinkLayerUnspecified uint8 = 0
	LinkLayerInfiniBand  uint8 = 1
	LinkLayerEthernet    uint8 = 2
)

// DeviceAttr is the subset of struct ibv_device_attr the transport uses.
type DeviceAttr struct {
	FWVer        string
	NodeGUID     uint64
	VendorID     uint32
	VendorPartID uint32
	MaxMRSize    uint64 // bytes one MR may span
	MaxQP        int
	MaxQPWR      int // max outstanding WRs per QP queue
	MaxSGE       int
	MaxCQ        int
	MaxCQE       int
	MaxMR        int
	MaxPD        int
	// MaxQPRdAtom is the most RDMA READ (and atomic) requests a QP of this
	// device serves at once as the responder (max_qp_rd_atom): the upper
	// bound of RTRAttr.MaxDestRdAtomic.
	MaxQPRdAtom int
	// MaxQPInitRdAtom is the most RDMA READ (and atomic) requests a QP of
	// this device keeps outstanding as the initiator (max_qp_init_rd_atom):
	// the upper bound of RTSAttr.MaxRdAtomic.
	MaxQPInitRdAtom int
	PhysPortCnt     int
}

// PortAttr is the subset of struct ibv_port_attr the transport uses.
type PortAttr struct {
	State       PortState
	MaxMTU      MTU
	ActiveMTU   MTU
	GIDTblLen   int
	LID         uint16
	LinkLayer   uint8 // LinkLayerEthernet for RoCE
	ActiveSpeed uint8
	ActiveWidth uint8
}

// QPState is enum ibv_qp_state.
type QPState uint8

// QP states.
const (
	QPStateReset QPState = 0
	QPStateInit  QPState = 1
	QPStateRTR   QPState = 2
	QPStateRTS   QPState = 3
	QPStateSQD   QPState = 4
	QPStateSQE   QPState = 5
	QPStateErr   QPState = 6
)

// QPInitAttr configures CreateQP (an RC QP).
type QPInitAttr struct {
	SendCQ, RecvCQ *CQ
	// MaxSendWR and MaxRecvWR are the queue depths in work requests.
	MaxSendWR, MaxRecvWR int
	// MaxSendSGE and MaxRecvSGE are scatter/gather entries per WR (>= 1).
	MaxSendSGE, MaxRecvSGE int
	// MaxInlineData is the largest inline payload in bytes (0 = none).
	MaxInlineData int
	// SignalAll makes every send WR generate a completion.
	SignalAll bool
}

// RTRAttr are the INIT->RTR parameters: the remote QP's address.
type RTRAttr struct {
	MTU     MTU
	DestQPN uint32
	RQPSN   uint32 // the remote side's initial send PSN (24 bits)
	DLID    uint16 // remote LID (InfiniBand); 0 for RoCE
	// IsGlobal adds a GRH (required for RoCE): DGID, SGIDIndex, HopLimit.
	IsGlobal  bool
	DGID      GID
	SGIDIndex uint8
	HopLimit  uint8
	// MaxDestRdAtomic is responder resources for RDMA READ/atomics: how
	// many incoming READs the QP serves at once (at most
	// DeviceAttr.MaxQPRdAtom; the peer's RTSAttr.MaxRdAtomic must not
	// exceed it).
	MaxDestRdAtomic uint8
	// MinRNRTimer is the RNR NAK timer code (IB spec table, 12 = 0.64 ms).
	MinRNRTimer uint8
	Port        uint8
}

// RTSAttr are the RTR->RTS parameters.
type RTSAttr struct {
	SQPSN uint32 // own initial send PSN (24 bits)
	// Timeout is the local ACK timeout code: 4.096 us * 2^Timeout (14 ~ 67 ms,
	// 18 ~ 1.07 s); 0 waits forever.
	Timeout uint8
	// RetryCnt is the transport retry count (0..7).
	RetryCnt uint8
	// RNRRetry is the RNR retry count (0..7, 7 = infinite).
	RNRRetry uint8
	// MaxRdAtomic is the initiator depth: how many RDMA READs (and
	// atomics) the QP keeps outstanding (at most
	// DeviceAttr.MaxQPInitRdAtom and the peer's RTRAttr.MaxDestRdAtomic);
	// more READs posted wait in the send queue.
	MaxRdAtomic uint8
}

// Opcode is a send WR opcode (enum ibv_wr_opcode).
type Opcode uint8

// Send opcodes.
const (
	OpRDMAWrite        Opcode = 0
	OpRDMAWriteWithImm Opcode = 1
	OpSend             Opcode = 2
	OpSendWithImm      Opcode = 3
	OpRDMARead         Opcode = 4
)

// SendFlags are send WR flags (enum ibv_send_flags).
type SendFlags uint32

// Send flags.
const (
	SendFence     SendFlags = 1
	SendSignaled  SendFlags = 1 << 1
	SendSolicited SendFlags = 1 << 2
	SendInline    SendFlags = 1 << 3
)

// SendWR is one send work request with one scatter/gather entry. A chain is a
// []SendWR posted with one QP.PostSend call.
type SendWR struct {
	ID     uint64 // returned in WC.WRID
	Opcode Opcode
	Flags  SendFlags
	// Addr, Length, LKey describe the local buffer (inside a registered MR).
	Addr   uintptr
	Length uint32
	LKey   uint32
	// RemoteAddr and RKey address the remote MR for RDMA opcodes.
	RemoteAddr uint64
	RKey       uint32
	// Imm is the 32-bit immediate (host order) for the *WithImm opcodes.
	Imm uint32
}

// RecvWR is one receive work request with at most one scatter/gather entry
// (Length 0 posts a WR with no buffer, enough for WRITE_WITH_IMM).
type RecvWR struct {
	ID     uint64
	Addr   uintptr
	Length uint32
	LKey   uint32
}

// WCStatus is enum ibv_wc_status.
type WCStatus uint32

// Completion statuses (the common ones; others print numerically).
const (
	WCSuccess        WCStatus = 0
	WCLocLenErr      WCStatus = 1
	WCLocQPOpErr     WCStatus = 2
	WCLocProtErr     WCStatus = 4
	WCWRFlushErr     WCStatus = 5
	WCRemInvReqErr   WCStatus = 9
	WCRemAccessErr   WCStatus = 10
	WCRemOpErr       WCStatus = 11
	WCRetryExcErr    WCStatus = 12
	WCRNRRetryExcErr WCStatus = 13
	WCFatalErr       WCStatus = 19
	WCRespTimeoutErr WCStatus = 20
	WCGeneralErr     WCStatus = 21
)

var wcStatusNames = map[WCStatus]string{
	0: "success", 1: "local length error", 2: "local QP operation error",
	3: "local EE context operation error", 4: "local protection error",
	5: "work request flushed", 6: "memory management operation error",
	7: "bad response", 8: "local access error", 9: "remote invalid request",
	10: "remote access error", 11: "remote operation error",
	12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
	14: "local RDD violation", 15: "remote invalid RD request",
	16: "remote aborted", 17: "invalid EE context number",
	18: "invalid EE context state", 19: "fatal error",
	20: "response timeout", 21: "general error",
}

// String returns the ibv_wc_status_str text.
func (s WCStatus) String() string {
	if n, ok := wcStatusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("wc status %d", uint32(s))
}

// WCOpcode is enum ibv_wc_opcode.
type WCOpcode uint32

// Completion opcodes.
const (
	WCSend            WCOpcode = 0
	WCRDMAWrite       WCOpcode = 1
	WCRDMARead        WCOpcode = 2
	WCRecv            WCOpcode = 1 << 7
	WCRecvRDMAWithImm WCOpcode = WCRecv + 1
)

// WC is one work completion (struct ibv_wc, the fields the transport uses).
// Opcode is valid only when Status is WCSuccess.
type WC struct {
	WRID      uint64
	Status    WCStatus
	Opcode    WCOpcode
	VendorErr uint32
	ByteLen   uint32
	// Imm is the immediate in host order; valid when HasImm.
	Imm    uint32
	HasImm bool
	QPNum  uint32
}

// WCError is a completion with a non-success status, as an error.
type WCError struct {
	WRID      uint64
	Status    WCStatus
	VendorErr uint32
	QPNum     uint32
}

// Error describes the failed completion.
func (e *WCError) Error() string {
	return fmt.Sprintf("ibverbs: completion error on QP %d, wr_id %d: %v (status %d, vendor_err %#x)",
		e.QPNum, e.WRID, e.Status, uint32(e.Status), e.VendorErr)
}

// Err returns nil for a successful completion, a *WCError otherwise.
func (w *WC) Err() error {
	if w.Status == WCSuccess {
		return nil
	}
	return &WCError{WRID: w.WRID, Status: w.Status, VendorErr: w.VendorErr, QPNum: w.QPNum}
}

// WRError is a work request PostSend refused before posting anything (a
// request the verbs would reject or mis-execute): Index is its position in
// the chain, Reason says what is wrong. It wraps syscall.EINVAL, the errno
// ibv_post_send would return.
type WRError struct {
	Op     string // "ibv_post_send"
	Index  int
	Opcode Opcode
	Reason string
}

// Error describes the refused work request.
func (e *WRError) Error() string {
	return fmt.Sprintf("ibverbs: %s: work request %d (opcode %d): %s", e.Op, e.Index, e.Opcode, e.Reason)
}

// Unwrap returns syscall.EINVAL.
func (e *WRError) Unwrap() error { return syscall.EINVAL }

// checkSendWR refuses work requests that cannot run: an RDMA READ with
// inline data (a READ's local buffer is its destination, which the NIC must
// be able to write through the lkey; IBV_SEND_INLINE would have it read the
// buffer instead) or with the solicited flag (meaningless without a
// receive on the responder).
func checkSendWR(i int, w *SendWR) error {
	if w.Opcode != OpRDMARead {
		return nil
	}
	switch {
	case w.Flags&SendInline != 0:
		return &WRError{Op: "ibv_post_send", Index: i, Opcode: w.Opcode, Reason: "an RDMA READ cannot carry inline data (SendInline): its local buffer is the destination"}
	case w.Flags&SendSolicited != 0:
		return &WRError{Op: "ibv_post_send", Index: i, Opcode: w.Opcode, Reason: "an RDMA READ cannot be solicited (SendSolicited): it raises no event at the responder"}
	}
	return nil
}

// ---- leak tracking

var (
	liveMu     sync.Mutex
	live       = map[uintptr]string{}
	liveNextID uintptr
	// TrackStacks records the creation stack of every object for LiveObjects
	// (tests set it; costs a runtime.Stack per object).
	TrackStacks bool
)

func track(kind string) uintptr {
	desc := kind
	if TrackStacks {
		buf := make([]byte, 4096)
		desc += "\n" + string(buf[:runtime.Stack(buf, false)])
	}
	liveMu.Lock()
	defer liveMu.Unlock()
	liveNextID++
	live[liveNextID] = desc
	return liveNextID
}

func untrack(id uintptr) {
	liveMu.Lock()
	delete(live, id)
	liveMu.Unlock()
}

// LiveObjects describes every verbs object (context, PD, MR, CQ, channel, QP)
// created and not yet closed, oldest first; with TrackStacks each entry holds
// its creation stack. A TestMain calls it after m.Run to catch leaks.
func LiveObjects() []string {
	liveMu.Lock()
	defer liveMu.Unlock()
	ids := make([]uintptr, 0, len(live))
	for id := range live {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = live[id]
	}
	return out
}
