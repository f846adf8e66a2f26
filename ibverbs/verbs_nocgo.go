//go:build !cgo

package ibverbs

import "time"

// Available reports whether cgo support is compiled in (false in this build:
// every call returns ErrNoCgo).
const Available = false

// DeviceInfo names one RDMA device visible to libibverbs.
type DeviceInfo struct {
	Name string
	GUID uint64
}

// Devices returns ErrNoCgo.
func Devices() ([]DeviceInfo, error) { return nil, ErrNoCgo }

// Context is an open device; unusable without cgo.
type Context struct{}

// Open returns ErrNoCgo.
func Open(name string) (*Context, error) { return nil, ErrNoCgo }

// Name returns "".
func (c *Context) Name() string { return "" }

// Close returns nil.
func (c *Context) Close() error { return nil }

// QueryDevice returns ErrNoCgo.
func (c *Context) QueryDevice() (DeviceAttr, error) { return DeviceAttr{}, ErrNoCgo }

// QueryPort returns ErrNoCgo.
func (c *Context) QueryPort(port uint8) (PortAttr, error) { return PortAttr{}, ErrNoCgo }

// QueryGID returns ErrNoCgo.
func (c *Context) QueryGID(port uint8, index int) (GID, error) { return GID{}, ErrNoCgo }

// GIDType returns ErrNoCgo (use SysfsGIDType directly).
func (c *Context) GIDType(port uint8, index int) (GIDType, error) {
	return GIDTypeUnknown, ErrNoCgo
}

// AllocPD returns ErrNoCgo.
func (c *Context) AllocPD() (*PD, error) { return nil, ErrNoCgo }

// CreateCompChannel returns ErrNoCgo.
func (c *Context) CreateCompChannel() (*CompChannel, error) { return nil, ErrNoCgo }

// CreateCQ returns ErrNoCgo.
func (c *Context) CreateCQ(cqe int, ch *CompChannel) (*CQ, error) { return nil, ErrNoCgo }

// PD is a protection domain; unusable without cgo.
type PD struct{}

// Close returns nil.
func (p *PD) Close() error { return nil }

// RegMR returns ErrNoCgo.
func (p *PD) RegMR(addr uintptr, length uint64, access Access) (*MR, error) { return nil, ErrNoCgo }

// RegDmaBufMR returns ErrNoCgo.
func (p *PD) RegDmaBufMR(offset, length, iova uint64, fd int, access Access) (*MR, error) {
	return nil, ErrNoCgo
}

// CreateQP returns ErrNoCgo.
func (p *PD) CreateQP(a QPInitAttr) (*QP, error) { return nil, ErrNoCgo }

// MR is a memory region; unusable without cgo.
type MR struct{}

// Addr returns 0.
func (m *MR) Addr() uint64 { return 0 }

// Len returns 0.
func (m *MR) Len() uint64 { return 0 }

// LKey returns 0.
func (m *MR) LKey() uint32 { return 0 }

// RKey returns 0.
func (m *MR) RKey() uint32 { return 0 }

// Close returns nil.
func (m *MR) Close() error { return nil }

// CompChannel is a completion channel; unusable without cgo.
type CompChannel struct{}

// Wait returns ErrNoCgo.
func (ch *CompChannel) Wait(timeout time.Duration) error { return ErrNoCgo }

// Close returns nil.
func (ch *CompChannel) Close() error { return nil }

// FD returns -1: there is no channel without cgo.
func (ch *CompChannel) FD() int { return -1 }

// TryGet returns ErrNoCgo.
func (ch *CompChannel) TryGet() (bool, error) { return false, ErrNoCgo }

// CQ is a completion queue; unusable without cgo.
type CQ struct{}

// CQE returns 0.
func (q *CQ) CQE() int { return 0 }

// Poll returns ErrNoCgo.
func (q *CQ) Poll(wcs []WC) (int, error) { return 0, ErrNoCgo }

// ReqNotify returns ErrNoCgo.
func (q *CQ) ReqNotify(solicitedOnly bool) error { return ErrNoCgo }

// Close returns nil.
func (q *CQ) Close() error { return nil }

// QP is a queue pair; unusable without cgo.
type QP struct{}

// QPN returns 0.
func (q *QP) QPN() uint32 { return 0 }

// ToInit returns ErrNoCgo.
func (q *QP) ToInit(port uint8, access Access) error { return ErrNoCgo }

// ToRTR returns ErrNoCgo.
func (q *QP) ToRTR(a RTRAttr) error { return ErrNoCgo }

// ToRTS returns ErrNoCgo.
func (q *QP) ToRTS(a RTSAttr) error { return ErrNoCgo }

// ToError returns ErrNoCgo.
func (q *QP) ToError() error { return ErrNoCgo }

// State returns ErrNoCgo.
func (q *QP) State() (QPState, error) { return 0, ErrNoCgo }

// PostSend refuses a WR that cannot run (*WRError, as with cgo), else
// returns ErrNoCgo.
func (q *QP) PostSend(wrs []SendWR) (int, error) {
	for i := range wrs {
		if err := checkSendWR(i, &wrs[i]); err != nil {
			return 0, err
		}
	}
	return 0, ErrNoCgo
}

// PostRecv returns ErrNoCgo.
func (q *QP) PostRecv(wrs []RecvWR) (int, error) { return 0, ErrNoCgo }

// Close returns nil.
func (q *QP) Close() error { return nil }
