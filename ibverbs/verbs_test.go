//go:build cgo

package ibverbs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/testenv"
)

func TestMain(m *testing.M) {
	TrackStacks = true
	code := m.Run()
	if live := LiveObjects(); len(live) > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "ibverbs: %d verbs objects leaked:\n", len(live))
		for _, l := range live {
			fmt.Fprintln(os.Stderr, l)
		}
		code = 1
	}
	os.Exit(code)
}

// requireDevice returns the device the hardware tests use: $KVXFER_RDMA_DEV,
// $RXE_DEV (set inside scripts/rxe-vm.sh) or the first device. It skips when
// there is none, unless $KVXFER_REQUIRE_RDMA is set (then it fails).
func requireDevice(t testing.TB) string {
	t.Helper()
	name := os.Getenv("KVXFER_RDMA_DEV")
	if name == "" {
		name = os.Getenv("RXE_DEV")
	}
	if name == "" {
		devs, err := Devices()
		if err == nil && len(devs) > 0 {
			name = devs[0].Name
		}
		if name == "" {
			testenv.Skip(t, "KVXFER_REQUIRE_RDMA", "no RDMA device (ibv_get_device_list: %v, %d devices); run `make test-rdma` for the Soft-RoCE VM", err, len(devs))
		}
	}
	return name
}

// pickGID returns a usable source GID index of port 1: $RXE_GID_IDX, else the
// first RoCE v2 IPv4-mapped entry, else the first non-zero entry.
func pickGID(t testing.TB, c *Context, pa PortAttr) int {
	t.Helper()
	if s := os.Getenv("RXE_GID_IDX"); s != "" {
		i, err := strconv.Atoi(s)
		if err != nil {
			t.Fatalf("RXE_GID_IDX=%q: %v", s, err)
		}
		return i
	}
	first := -1
	for i := 0; i < pa.GIDTblLen && i < 256; i++ {
		g, err := c.QueryGID(1, i)
		if err != nil || g.IsZero() {
			continue
		}
		if first < 0 {
			first = i
		}
		if ty, _ := c.GIDType(1, i); ty == GIDTypeRoCEv2 && g.IP().To4() != nil {
			return i
		}
	}
	if first < 0 {
		t.Fatalf("%s port 1 has no GID", c.Name())
	}
	return first
}

type pair struct {
	ctx     *Context
	pd      *PD
	cq      *CQ
	a, b    *QP
	closers []func() error
}

func (p *pair) close(t testing.TB) {
	for i := len(p.closers) - 1; i >= 0; i-- {
		if err := p.closers[i](); err != nil {
			t.Errorf("close: %v", err)
		}
	}
}

// newPair opens the device and connects two RC QPs to each other (a sends,
// b is the target); both share one CQ.
func newPair(t *testing.T) *pair { return newPairTimeout(t, 18) }

// newPairTimeout is newPair with an explicit ACK timeout code.
func newPairTimeout(t *testing.T, timeout uint8) *pair {
	t.Helper()
	name := requireDevice(t)
	p := &pair{}
	var err error
	if p.ctx, err = Open(name); err != nil {
		t.Fatal(err)
	}
	p.closers = append(p.closers, p.ctx.Close)
	t.Cleanup(func() { p.close(t) })
	pa, err := p.ctx.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	if pa.State != PortActive {
		t.Fatalf("%s port 1 is not active (state %d)", name, pa.State)
	}
	gidIdx := pickGID(t, p.ctx, pa)
	gid, err := p.ctx.QueryGID(1, gidIdx)
	if err != nil {
		t.Fatal(err)
	}
	if p.pd, err = p.ctx.AllocPD(); err != nil {
		t.Fatal(err)
	}
	p.closers = append(p.closers, p.pd.Close)
	if p.cq, err = p.ctx.CreateCQ(1024, nil); err != nil {
		t.Fatal(err)
	}
	p.closers = append(p.closers, p.cq.Close)
	mk := func() *QP {
		qp, err := p.pd.CreateQP(QPInitAttr{SendCQ: p.cq, RecvCQ: p.cq, MaxSendWR: 256, MaxRecvWR: 64, MaxSendSGE: 1, MaxRecvSGE: 1})
		if err != nil {
			t.Fatal(err)
		}
		p.closers = append(p.closers, qp.Close)
		if err := qp.ToInit(1, AccessLocalWrite|AccessRemoteWrite|AccessRemoteRead); err != nil {
			t.Fatal(err)
		}
		return qp
	}
	p.a, p.b = mk(), mk()
	global := pa.LinkLayer == LinkLayerEthernet
	connect := func(q, peer *QP, sq, rq uint32) {
		if err := q.ToRTR(RTRAttr{MTU: pa.ActiveMTU, DestQPN: peer.QPN(), RQPSN: rq, DLID: pa.LID,
			IsGlobal: global, DGID: gid, SGIDIndex: uint8(gidIdx), HopLimit: 64,
			MaxDestRdAtomic: 1, MinRNRTimer: 12, Port: 1}); err != nil {
			t.Fatal(err)
		}
		// Generous timeouts: TCG stalls of several ms are normal in the VM.
		if err := q.ToRTS(RTSAttr{SQPSN: sq, Timeout: timeout, RetryCnt: 7, RNRRetry: 7, MaxRdAtomic: 1}); err != nil {
			t.Fatal(err)
		}
	}
	connect(p.a, p.b, 100, 200)
	connect(p.b, p.a, 200, 100)
	if s, err := p.a.State(); err != nil || s != QPStateRTS {
		t.Fatalf("QP a state %v, %v; want RTS", s, err)
	}
	return p
}

// mmapBuf returns n bytes of anonymous mmap memory, unmapped at cleanup.
func mmapBuf(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

func (p *pair) reg(t testing.TB, b []byte) *MR {
	t.Helper()
	mr, err := p.pd.RegMR(addrOf(b), uint64(len(b)), AccessLocalWrite|AccessRemoteWrite|AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	p.closers = append(p.closers, mr.Close)
	return mr
}

// waitWC polls cq until n completions arrived or 30 s passed.
func waitWC(t testing.TB, cq *CQ, n int) []WC {
	t.Helper()
	var out []WC
	wcs := make([]WC, 16)
	deadline := time.Now().Add(30 * time.Second)
	for len(out) < n {
		k, err := cq.Poll(wcs)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, wcs[:k]...)
		if k == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("only %d of %d completions within 30 s", len(out), n)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	return out
}

func TestWriteSizes(t *testing.T) {
	p := newPair(t)
	const max = 4 << 20
	src, dst := mmapBuf(t, max), mmapBuf(t, max)
	smr, dmr := p.reg(t, src), p.reg(t, dst)
	for i := range src {
		src[i] = byte(i*7 + i>>12)
	}
	for i, size := range []int{64, 4096, 65536 + 3, 1 << 20, max} {
		clear(dst)
		// Write at an offset so the check also catches misaddressed writes.
		off := 0
		if size < max {
			off = 128
		}
		n, err := p.a.PostSend([]SendWR{{ID: uint64(i), Opcode: OpRDMAWrite, Flags: SendSignaled,
			Addr: addrOf(src), Length: uint32(size), LKey: smr.LKey(),
			RemoteAddr: dmr.Addr() + uint64(off), RKey: dmr.RKey()}})
		if err != nil || n != 1 {
			t.Fatalf("size %d: post: %d, %v", size, n, err)
		}
		wc := waitWC(t, p.cq, 1)[0]
		if err := wc.Err(); err != nil || wc.WRID != uint64(i) || wc.Opcode != WCRDMAWrite {
			t.Fatalf("size %d: completion %+v: %v", size, wc, err)
		}
		if !bytes.Equal(dst[off:off+size], src[:size]) {
			t.Fatalf("size %d: destination differs from source", size)
		}
		if off > 0 && (dst[off-1] != 0 || dst[off+size] != 0) {
			t.Fatalf("size %d: write spilled outside [%d,%d)", size, off, off+size)
		}
	}
}

// TestReadSizes: RDMA READ work requests copy the target's MR into the
// local one (the completion says WCRDMARead); a READ with a bad rkey
// completes with an error and leaves the local buffer untouched.
func TestReadSizes(t *testing.T) {
	p := newPair(t)
	const max = 4 << 20
	local, remote := mmapBuf(t, max), mmapBuf(t, max)
	lmr, rmr := p.reg(t, local), p.reg(t, remote)
	for i := range remote {
		remote[i] = byte(i*11 + i>>12)
	}
	for i, size := range []int{1, 64, 4096, 65536 + 3, 1 << 20, max - 256} {
		clear(local)
		n, err := p.a.PostSend([]SendWR{{ID: uint64(i), Opcode: OpRDMARead, Flags: SendSignaled,
			Addr: addrOf(local) + 128, Length: uint32(size), LKey: lmr.LKey(),
			RemoteAddr: rmr.Addr() + 64, RKey: rmr.RKey()}})
		if err != nil || n != 1 {
			t.Fatalf("size %d: post: %d, %v", size, n, err)
		}
		wc := waitWC(t, p.cq, 1)[0]
		if err := wc.Err(); err != nil || wc.WRID != uint64(i) || wc.Opcode != WCRDMARead {
			t.Fatalf("size %d: completion %+v: %v", size, wc, err)
		}
		if !bytes.Equal(local[128:128+size], remote[64:64+size]) {
			t.Fatalf("size %d: local bytes differ from the remote MR", size)
		}
		if local[127] != 0 || local[128+size] != 0 {
			t.Fatalf("size %d: read spilled outside [128,%d)", size, 128+size)
		}
	}
	clear(local)
	if _, err := p.a.PostSend([]SendWR{{ID: 99, Opcode: OpRDMARead, Flags: SendSignaled, Addr: addrOf(local), Length: 4096,
		LKey: lmr.LKey(), RemoteAddr: rmr.Addr(), RKey: rmr.RKey() ^ 0x5a5a00}}); err != nil {
		t.Fatal(err)
	}
	wc := waitWC(t, p.cq, 1)[0]
	if wc.Err() == nil || wc.WRID != 99 {
		t.Fatalf("read with a bad rkey: %+v, want a completion error", wc)
	}
	t.Logf("read with a bad rkey -> %v", wc.Err())
	if !bytes.Equal(local[:4096], make([]byte, 4096)) {
		t.Fatalf("a refused read changed the local buffer")
	}
}

func TestWriteChain(t *testing.T) {
	p := newPair(t)
	const n, piece = 300, 4096 // > one 128-WR cgo chunk
	src, dst := mmapBuf(t, n*piece), mmapBuf(t, n*piece)
	smr, dmr := p.reg(t, src), p.reg(t, dst)
	for i := range src {
		src[i] = byte(i ^ i>>8)
	}
	wrs := make([]SendWR, n)
	for i := range wrs {
		wrs[i] = SendWR{ID: uint64(i), Opcode: OpRDMAWrite, Addr: addrOf(src) + uintptr(i*piece), Length: piece,
			LKey: smr.LKey(), RemoteAddr: dmr.Addr() + uint64((n-1-i)*piece), RKey: dmr.RKey()}
	}
	wrs[n-1].Flags = SendSignaled // RC completes in order: the last one covers all
	// Post in chunks the send queue (256) can hold.
	for off := 0; off < n; {
		end := min(off+128, n)
		if end < n {
			wrs[end-1].Flags = SendSignaled
		}
		k, err := p.a.PostSend(wrs[off:end])
		if err != nil {
			t.Fatalf("post %d..%d: accepted %d: %v", off, end, k, err)
		}
		waitWC(t, p.cq, 1)
		off = end
	}
	for i := 0; i < n; i++ {
		if !bytes.Equal(dst[(n-1-i)*piece:(n-i)*piece], src[i*piece:(i+1)*piece]) {
			t.Fatalf("piece %d misplaced", i)
		}
	}
}

func TestWriteWithImmAndSend(t *testing.T) {
	p := newPair(t)
	src, dst, rbuf := mmapBuf(t, 8192), mmapBuf(t, 8192), mmapBuf(t, 4096)
	smr, dmr, rmr := p.reg(t, src), p.reg(t, dst), p.reg(t, rbuf)
	copy(src, []byte("kv pages, then the metadata record"))
	if _, err := p.b.PostRecv([]RecvWR{{ID: 1001}, {ID: 1002, Addr: addrOf(rbuf), Length: 4096, LKey: rmr.LKey()}}); err != nil {
		t.Fatal(err)
	}
	_, err := p.a.PostSend([]SendWR{
		{ID: 1, Opcode: OpRDMAWriteWithImm, Flags: SendSignaled, Addr: addrOf(src), Length: 8192, LKey: smr.LKey(),
			RemoteAddr: dmr.Addr(), RKey: dmr.RKey(), Imm: 0xC0FFEE42},
		{ID: 2, Opcode: OpSend, Flags: SendSignaled, Addr: addrOf(src), Length: 34, LKey: smr.LKey()},
	})
	if err != nil {
		t.Fatal(err)
	}
	var sawImm, sawSend, sends int
	for _, wc := range waitWC(t, p.cq, 4) {
		if err := wc.Err(); err != nil {
			t.Fatal(err)
		}
		switch {
		case wc.WRID == 1001:
			if wc.Opcode != WCRecvRDMAWithImm || !wc.HasImm || wc.Imm != 0xC0FFEE42 || wc.ByteLen != 8192 {
				t.Fatalf("WRITE_WITH_IMM completion %+v", wc)
			}
			sawImm++
		case wc.WRID == 1002:
			if wc.Opcode != WCRecv || wc.ByteLen != 34 || wc.HasImm {
				t.Fatalf("SEND completion %+v", wc)
			}
			sawSend++
		case wc.WRID == 1 || wc.WRID == 2:
			sends++
		}
	}
	if sawImm != 1 || sawSend != 1 || sends != 2 {
		t.Fatalf("completions: imm %d send %d sender %d", sawImm, sawSend, sends)
	}
	if !bytes.Equal(dst, src) || string(rbuf[:34]) != "kv pages, then the metadata record" {
		t.Fatal("payload differs")
	}
}

func TestBadRKeyCompletesWithError(t *testing.T) {
	p := newPair(t)
	src, dst := mmapBuf(t, 4096), mmapBuf(t, 4096)
	smr, dmr := p.reg(t, src), p.reg(t, dst)
	_, err := p.a.PostSend([]SendWR{{ID: 7, Opcode: OpRDMAWrite, Flags: SendSignaled, Addr: addrOf(src), Length: 64,
		LKey: smr.LKey(), RemoteAddr: dmr.Addr(), RKey: dmr.RKey() ^ 0x5a5a00}})
	if err != nil {
		t.Fatal(err)
	}
	wc := waitWC(t, p.cq, 1)[0]
	err = wc.Err()
	var we *WCError
	if !errors.As(err, &we) || wc.WRID != 7 {
		t.Fatalf("bad rkey: want a completion error for wr 7, got %+v (%v)", wc, err)
	}
	if we.Status != WCRemAccessErr && we.Status != WCRemInvReqErr && we.Status != WCRemOpErr {
		t.Logf("bad rkey surfaced as %v (driver-specific)", we.Status)
	}
	t.Logf("bad rkey -> %v", err)
	if s, _ := p.a.State(); s != QPStateErr {
		t.Fatalf("QP state after remote access error = %d, want ERR", s)
	}
	// A send on an ERR QP is flushed, never hangs.
	if _, err := p.a.PostSend([]SendWR{{ID: 8, Opcode: OpRDMAWrite, Flags: SendSignaled, Addr: addrOf(src), Length: 64,
		LKey: smr.LKey(), RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}}); err == nil {
		if wc := waitWC(t, p.cq, 1)[0]; wc.Status != WCWRFlushErr {
			t.Fatalf("post on ERR QP: %+v", wc)
		}
	}
}

// TestPeerGone: a WRITE to a destroyed QP must end with a completion error,
// never hang. Hardware reports IBV_WC_RETRY_EXC_ERR after the retries; rxe on
// Linux 6.1 was seen to retry silently, so after 5 s the test moves the QP to
// ERR (what the rdma transport's stall watchdog does) and expects a flush.
func TestPeerGone(t *testing.T) {
	p := newPairTimeout(t, 14) // ~67 ms per try, 8 tries
	src, dst := mmapBuf(t, 4096), mmapBuf(t, 4096)
	smr, dmr := p.reg(t, src), p.reg(t, dst)
	if err := p.b.Close(); err != nil { // the target QP vanishes
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := p.a.PostSend([]SendWR{{ID: 9, Opcode: OpRDMAWrite, Flags: SendSignaled, Addr: addrOf(src), Length: 64,
		LKey: smr.LKey(), RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}}); err != nil {
		t.Fatal(err)
	}
	wcs := make([]WC, 4)
	for time.Since(start) < 5*time.Second {
		n, err := p.cq.Poll(wcs)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			if wcs[0].Status != WCRetryExcErr {
				t.Fatalf("write to a destroyed QP: %+v, want %v", wcs[0], WCRetryExcErr)
			}
			t.Logf("write to a destroyed QP -> %v after %v", wcs[0].Err(), time.Since(start))
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("no completion from the driver within 5 s; moving the QP to ERR")
	if err := p.a.ToError(); err != nil {
		t.Fatal(err)
	}
	wc := waitWC(t, p.cq, 1)[0]
	if wc.Status != WCWRFlushErr || wc.WRID != 9 {
		t.Fatalf("after ToError: %+v, want a flush of wr 9", wc)
	}
}

func TestCompChannel(t *testing.T) {
	name := requireDevice(t)
	ctx, err := Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	ch, err := ctx.CreateCompChannel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	cq, err := ctx.CreateCQ(16, ch)
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	if err := cq.ReqNotify(false); err != nil {
		t.Fatal(err)
	}
	if err := ch.Wait(50 * time.Millisecond); !errors.Is(err, unix.ETIMEDOUT) {
		t.Fatalf("Wait on idle channel = %v, want ETIMEDOUT", err)
	}
	if ok, err := ch.TryGet(); ok || err != nil {
		t.Fatalf("TryGet on idle channel = %v, %v; want false, nil", ok, err)
	}
	if fd := ch.FD(); fd < 0 {
		t.Fatalf("FD = %d", fd)
	}
	cq.Close()
	ch.Close()
	if ok, err := ch.TryGet(); ok || !errors.Is(err, ErrClosed) {
		t.Fatalf("TryGet after Close = %v, %v; want ErrClosed", ok, err)
	}
	if fd := ch.FD(); fd != -1 {
		t.Fatalf("FD after Close = %d, want -1", fd)
	}
}

func TestPollNoAlloc(t *testing.T) {
	p := newPair(t)
	wcs := make([]WC, 32)
	if a := testing.AllocsPerRun(100, func() { _, _ = p.cq.Poll(wcs) }); a != 0 {
		t.Fatalf("Poll allocates %v per call", a)
	}
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

func TestClosedAndErrors(t *testing.T) {
	name := requireDevice(t)
	ctx, err := Open(name)
	if err != nil {
		t.Fatal(err)
	}
	attr, err := ctx.QueryDevice()
	if err != nil || attr.PhysPortCnt < 1 || attr.MaxMRSize == 0 {
		t.Fatalf("QueryDevice = %+v, %v", attr, err)
	}
	pd, err := ctx.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	// Registering unmapped memory fails with an errno-carrying *Error.
	_, err = pd.RegMR(0x10, 4096, AccessLocalWrite)
	var ve *Error
	if !errors.As(err, &ve) || ve.Op != "ibv_reg_mr" || ve.Errno == 0 {
		t.Fatalf("RegMR(bad address) = %v, want *Error{ibv_reg_mr}", err)
	}
	if _, err := ctx.QueryGID(1, 1<<20); err == nil {
		t.Fatal("QueryGID out of range succeeded")
	}
	for i := 0; i < 2; i++ {
		if err := pd.Close(); err != nil {
			t.Fatal(err)
		}
		if err := ctx.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ctx.AllocPD(); !errors.Is(err, ErrClosed) {
		t.Fatalf("AllocPD after Close = %v", err)
	}
	if _, err := Open("no-such-device-xyz"); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("Open(unknown) = %v", err)
	}
}

func TestErrorIs(t *testing.T) {
	for _, tc := range []struct {
		errno    syscall.Errno
		sentinel error
		want     bool
	}{
		{syscall.ENOMEM, ErrOutOfMemory, true},
		{syscall.EOPNOTSUPP, ErrNotSupported, true},
		{syscall.ENOSYS, ErrNotSupported, true},
		{syscall.EINVAL, ErrNotSupported, false},
		{syscall.EINVAL, syscall.EINVAL, true},
		{syscall.ENOMEM, syscall.EINVAL, false},
	} {
		err := error(&Error{Op: "ibv_reg_mr", Errno: tc.errno})
		if got := errors.Is(err, tc.sentinel); got != tc.want {
			t.Errorf("errors.Is(%v, %v) = %v", err, tc.sentinel, got)
		}
	}
	if e := errnoErr("x", nil).(*Error); e.Errno != syscall.EIO {
		t.Errorf("errnoErr(nil) errno = %v, want EIO", e.Errno)
	}
}
