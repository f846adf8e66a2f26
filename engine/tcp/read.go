package tcp

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// One-sided READ on tcp (transport.OpRead, CapRead).
//
// The reading node (the sender of the frames) submits a read batch like a
// write batch: its frames (kind 3, a request or chunk; kind 4, many small
// host reads packed with a scatter table; see frame.go) go over the same
// streams, least-loaded first, and carry no payload. The node that
// registered the memory (the receiver of the frames) checks every read as
// it checks a write (region registered and not deregistered, every byte
// inside it; the connection's epoch admitted, else the hello was refused),
// then answers in frame order on the same connection: its queued acks, the
// read's ack and the bytes, with one vectored write straight from the
// registered region (no staging copy for host memory; device memory is
// staged through the bounce buffer before the ack, so a failed device copy
// is a refusal, never a short payload). The reading side reads the ack and
// then the payload straight into the local destinations with readv(2). A
// refused read gets a refusal ack and no payload: nothing of the local
// memory changes.
//
// Fencing: FenceEpoch closes the epoch's inbound connections and waits for
// their goroutines, so no response is being written when it returns and no
// read is served afterwards. DeregisterMemory waits for a response in
// progress from the region (the region's read lock is held while it is
// written). Peer loss mid-read fails the batch with ErrPeerLost like a lost
// write; the local bytes of the frames not completed are unspecified.

// maxReadFrame bounds the bytes one read frame may ask for. The reading
// side of this build asks at most chunkSize per frame; a larger request
// from another build is refused (ackBadRequest) rather than served with the
// region locked for the whole transfer.
const maxReadFrame = 64 << 20

// serveRead answers one read frame (kind 3 or 4). answered reports that
// the answer (ack and payload) was written; otherwise refusal is the ack to
// send (a refused read: no payload follows). err means the stream is broken
// (errProtocol: a malformed scatter table).
func (rx *receiver) serveRead(h header) (answered bool, refusal ack, err error) {
	t := rx.t
	refuse := func(status uint8, format string, args ...any) (bool, ack, error) {
		return false, ack{Status: status, Seq: h.Seq, Msg: fmt.Sprintf(format, args...)}, nil
	}
	var ents []entry
	scatter := h.Kind == kindReadScatter
	if scatter {
		var err error
		if ents, err = rx.readTable(h); err != nil {
			return false, ack{}, err
		}
	}
	if h.size() > maxReadFrame {
		return refuse(ackBadRequest, "read frame %d asks for %d bytes; at most %d per frame (split the read)", h.Seq, h.size(), maxReadFrame)
	}
	var dests []*region
	var closing bool
	if scatter {
		dests, closing = rx.lookup(ents)
	} else {
		t.mu.RLock()
		dests, closing = append(rx.dests[:0], t.regions[transport.RegionID(h.Region)]), t.closed
		t.mu.RUnlock()
		rx.dests = dests
	}
	defer clear(dests)
	if closing {
		return refuse(ackShutdown, "receiver is closing")
	}
	if !scatter {
		r := dests[0]
		if r == nil {
			return refuse(ackUnknownRegion, "region %d is not registered on %s (read at offset %d length %d x %d)", h.Region, t.ln.Addr(), h.Offset, h.Count, h.Length)
		}
		if end, ok := h.span(); !ok || end > r.mem.Length {
			return refuse(ackOutOfBounds, "region %d: read at offset %d length %d x %d (stride %d) ends at byte %d, past the region's %d bytes",
				h.Region, h.Offset, h.Count, h.Length, h.Stride, end, r.mem.Length)
		}
	} else {
		for i, e := range ents {
			r := dests[i]
			if r == nil {
				return refuse(ackUnknownRegion, "entry %d of %d: region %d is not registered on %s (read at offset %d length %d)", i, len(ents), e.Region, t.ln.Addr(), e.Offset, e.Length)
			}
			if end, ok := e.end(); !ok || end > r.mem.Length {
				return refuse(ackOutOfBounds, "entry %d of %d: region %d: read at offset %d length %d ends past the region's %d bytes", i, len(ents), e.Region, e.Offset, e.Length, r.mem.Length)
			}
			if r.buf == nil {
				return refuse(ackBadRequest, "entry %d of %d: region %d is device memory; packed (scatter) reads are of host memory only", i, len(ents), e.Region)
			}
		}
	}
	// Read-lock each distinct region for as long as the response is
	// written from it.
	locked, dead := rx.rlock(dests)
	defer runlock(locked)
	if dead != nil {
		return refuse(ackUnknownRegion, "region %d was deregistered (read frame %d)", dead.id, h.Seq)
	}
	out := append(rx.out[:0], nil) // out[0]: the acks (respond)
	switch {
	case scatter:
		for i, e := range ents {
			out = append(out, dests[i].buf[e.Offset:e.Offset+uint64(e.Length)])
		}
	case dests[0].buf != nil:
		r := dests[0]
		for i := uint64(0); i < uint64(h.Count); i++ {
			off := h.Offset + i*h.Stride
			out = append(out, r.buf[off:off+h.Length])
		}
	default:
		// Device memory: stage the whole frame before the ack, so a failed
		// copy is a refusal and never a short payload.
		r := dests[0]
		if h.size() > bounceSize {
			return refuse(ackBadRequest, "read frame %d of device region %d asks for %d bytes; at most %d per frame", h.Seq, h.Region, h.size(), bounceSize)
		}
		if rx.bounce == nil {
			rx.bounce = make([]byte, bounceSize)
		}
		for i := uint64(0); i < uint64(h.Count); i++ {
			off := h.Offset + i*h.Stride
			if err := deviceCopier.copyFromDevice(rx.bounce[i*h.Length:(i+1)*h.Length], r.mem.Addr+uintptr(off), r.mem.Device); err != nil {
				return refuse(ackInternal, "read of cuda:%d region %d at offset %d (%d bytes): %v", r.mem.Device, r.id, off, h.Length, err)
			}
		}
		out = append(out, rx.bounce[:h.size()])
	}
	err = rx.respond(h, out)
	clear(out)
	rx.out = out[:0]
	if err != nil {
		return false, ack{}, fmt.Errorf("answer read frame %d (%d bytes): %w", h.Seq, h.size(), err)
	}
	return true, ack{}, nil
}

// respond writes the acks queued so far, the ackOK of read frame h and its
// payload (out[1:]) with one vectored write, so acks stay in frame order.
// out[0] is set to the acks.
func (rx *receiver) respond(h header, out [][]byte) error {
	rx.ackBuf = encodeAck(rx.ackBuf, ack{Status: ackOK, Seq: h.Seq, Bytes: h.size()})
	out[0] = rx.ackBuf
	rx.bufs = out // WriteTo consumes rx.bufs, not out
	rx.c.SetWriteDeadline(time.Now().Add(rx.t.ackTimeout))
	_, err := rx.bufs.WriteTo(rx.c)
	rx.bufs = nil
	rx.ackBuf, rx.pending, rx.pendingBytes = rx.ackBuf[:0], 0, 0
	return err
}

// payloadReader reads a read frame's answer on the reading side: the bytes
// the ack reader has buffered first, then readv(2) straight into the
// destination slices.
type payloadReader struct {
	c       interface{ SetReadDeadline(time.Time) error }
	raw     syscall.RawConn
	br      *bufio.Reader
	timeout time.Duration
	vecs    []unix.Iovec
	n       uintptr
	errno   syscall.Errno
	readFn  func(fd uintptr) bool
}

// readv is the RawConn.Read callback: one readv(2) of p.vecs.
func (p *payloadReader) readv(fd uintptr) bool {
	for {
		n, _, errno := unix.Syscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(&p.vecs[0])), uintptr(len(p.vecs)))
		if errno == unix.EINTR {
			continue
		}
		p.n, p.errno = n, errno
		return errno != unix.EAGAIN
	}
}

// fill reads exactly the bytes of dst (consumed), each readv bounded by
// the timeout (progress renews it). A closed socket first is
// io.ErrUnexpectedEOF.
func (p *payloadReader) fill(dst [][]byte) error {
	for len(dst) > 0 && p.br.Buffered() > 0 {
		n, _ := p.br.Read(dst[0]) // only buffered bytes: no syscall
		if dst[0] = dst[0][n:]; len(dst[0]) == 0 {
			dst = dst[1:]
		}
	}
	if p.readFn == nil {
		p.readFn = p.readv
	}
	for {
		for len(dst) > 0 && len(dst[0]) == 0 {
			dst = dst[1:]
		}
		if len(dst) == 0 {
			return nil
		}
		v := p.vecs[:0]
		for _, b := range dst[:min(len(dst), 1024)] {
			vec := unix.Iovec{Base: &b[0]}
			vec.SetLen(len(b))
			v = append(v, vec)
		}
		p.vecs = v
		p.c.SetReadDeadline(time.Now().Add(p.timeout))
		rerr := p.raw.Read(p.readFn)
		n, errno := p.n, p.errno
		clear(v)
		switch {
		case rerr != nil:
			return rerr
		case errno != 0:
			return os.NewSyscallError("readv", errno)
		case n == 0:
			return io.ErrUnexpectedEOF
		}
		for m := int(n); m > 0; {
			if m >= len(dst[0]) {
				m -= len(dst[0])
				dst = dst[1:]
			} else {
				dst[0] = dst[0][m:]
				m = 0
			}
		}
	}
}

// readAnswer lands the payload of read frame f's ackOK a in the frame's
// local destinations: readv straight into host memory, device memory
// through the bounce buffer (a failed device copy fails the frame, the
// stream stays usable: the payload is consumed whole). An error means the
// stream is broken (it wraps transport.ErrPeerLost).
func (st *stream) readAnswer(pr *payloadReader, f *frame, a ack) error {
	if a.Bytes != f.bytes {
		return st.lost("answer to read frame %d announces %d bytes, the frame asked for %d (protocol out of sync)", f.hdr.Seq, a.Bytes, f.bytes)
	}
	dst := st.answerIOV[:0]
	switch {
	case f.hdr.Kind == kindReadScatter:
		for _, r := range f.srcs {
			dst = r.appendTo(dst)
		}
	case f.local.buf != nil:
		for i := uint64(0); i < uint64(f.hdr.Count); i++ {
			o := f.off + i*f.stride
			dst = append(dst, f.local.buf[o:o+f.hdr.Length])
		}
	default:
		if st.answerBounce == nil {
			st.answerBounce = make([]byte, bounceSize)
		}
		if f.bytes > uint64(len(st.answerBounce)) {
			return st.lost("answer to read frame %d of %d bytes exceeds the %d-byte device staging buffer", f.hdr.Seq, f.bytes, len(st.answerBounce))
		}
		if err := pr.fill([][]byte{st.answerBounce[:f.bytes]}); err != nil {
			return st.lost("read the answer to read frame %d (%d bytes): %v", f.hdr.Seq, f.bytes, err)
		}
		for i := uint64(0); i < uint64(f.hdr.Count); i++ {
			dstAddr := f.local.mem.Addr + uintptr(f.off+i*f.stride)
			if err := deviceCopier.copyToDevice(dstAddr, f.local.mem.Device, st.answerBounce[i*f.hdr.Length:(i+1)*f.hdr.Length]); err != nil {
				lerr := fmt.Errorf("tcp: copy %d bytes read from %s to cuda:%d at %#x: %w", f.hdr.Length, st.seg.addr, f.local.mem.Device, dstAddr, err)
				f.localErr.Store(&lerr)
				break
			}
		}
		return nil
	}
	err := pr.fill(dst)
	clear(dst)
	st.answerIOV = dst[:0]
	if err != nil {
		return st.lost("read the answer to read frame %d (%d bytes): %v", f.hdr.Seq, f.bytes, err)
	}
	return nil
}
