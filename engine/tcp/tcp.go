// Package tcp is kvxfer's TCP transport: the loopback fallback and the
// transport for hosts with no RDMA device. It registers itself as "tcp"
// (priority 100) with transport.RegisterTransport; import it for its side effect
// or call New.
//
// Each node runs one data listener (Options.ListenHost:ListenPort, port 0 = a
// free port); Endpoint returns its "host:port" address. A sender's Segment
// opens Options.Streams connections (default 4) to the receiver and spreads a
// batch's frames over them (least queued bytes first); requests larger than
// 4 MiB are split into 4 MiB chunks, a request up to that size is one frame.
// The sender writes each frame straight from registered memory with one
// vectored write (header + payload slices, no staging copy); a strided
// request is one header followed by its blocks. The receiver reads payload
// straight into the destination region after checking the region is
// registered and the write lies inside it, and acknowledges every frame; a
// batch completes only when every frame is acknowledged. A refused write gets
// an error reply naming region, offset and length, its payload is drained, and
// the stream stays usable.
//
// Small writes are cheap: a batch's small requests (one block of at most
// 256 KiB, host memory to a host region) travel packed in scatter frames of
// up to 1024 writes and 1 MiB (spread over the streams): one header and a table of (region, offset,
// length) entries, then the payloads back to back. The receiver checks every
// entry before any byte lands and reads the payloads with vectored reads
// straight into the destination ranges; pages scattered over a KV pool thus
// cost a few syscalls per MiB, not a frame each. The sender puts several
// queued frames in one writev, the receiver reads a payload and the next
// header with one readv and writes acks in bursts (at the latest before it
// would wait for input, or every 64 acks or 4 MiB acknowledged).
//
// Ordered last write (transport.CapOrderedLast): a batch with
// TransferBatch.LastAfterAll holds its last write (an 8-byte commit word)
// back until every other frame of the batch was acknowledged (the receiver
// acknowledges a frame once its bytes landed, and the frames are spread
// over several connections, so only the acknowledgements order them), then
// sends it on the least loaded stream; a batch that failed or was canceled
// by then never sends it.
//
// Reads (transport.OpRead): a read batch travels as read frames on the same
// streams; the receiver checks each like a write and answers with its ack
// followed by the bytes, one vectored write straight from the registered
// region; the reading side lands them with readv straight into its
// registered memory (read.go).
//
// Timeouts: a stream with frames in flight and no acknowledgement for
// Options.TCP.AckTimeout (default 10s; it must exceed
// the time the link needs for 8 MiB) is declared lost; a peer that closes or
// dies fails the pending batches of that segment with an error wrapping
// transport.ErrPeerLost as soon as the socket reports it.
//
// Fencing (transport.Fencer): every connection's hello carries its segment's
// epoch (transport.SegmentInfo.Epoch). The receiver accepts a connection whose
// epoch is 0 (no epoch: raw transport users) or admitted (AdmitEpoch) and
// not fenced, and refuses the others with an ack naming the epoch, so their
// writes never land. FenceEpoch withdraws the admission, closes the epoch's
// inbound connections and returns once none of them is receiving any more.
//
// Device (CUDA) memory goes through the bounce-buffer seam in device.go and is
// refused with transport.ErrUnsupportedMemory until the CUDA copier is wired in.
//
// Lifetimes: a Transport and its Segments are safe for concurrent use. Close
// the Segments you open (Transport.Close closes them too) and Close the
// Transport; both are idempotent. Registered memory must stay mapped until
// DeregisterMemory returns and, on the sender, until every batch reading it
// is terminal (Segment.Close and Transport.Close return only once no stream
// reads local memory). DeregisterMemory waits for a receive in progress into
// that region (bounded by the ack timeout).
package tcp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// Name is the registry name of this transport.
const Name = "tcp"

// Priority is the automatic-selection priority (rdma 300 > shm 200 > tcp 100).
const Priority = 100

// DefaultStreams is the number of connections per segment when
// Options.Streams is 0.
const DefaultStreams = 4

// DefaultAckTimeout bounds how long a stream with frames in flight may go
// without an acknowledgement (and how long one socket write or payload read
// may stall) before the peer is declared lost.
const DefaultAckTimeout = 10 * time.Second

// chunkSize is the largest contiguous frame payload; larger requests are
// split so that several streams carry them in parallel.
const chunkSize = 4 << 20

// burstIOV and burstBytes bound one vectored write of several queued frames
// (slices, payload bytes); small frames share a syscall.
const (
	burstIOV   = 1024
	burstBytes = 4 << 20
)

// sockBuf is the SO_SNDBUF/SO_RCVBUF asked for each data connection, bytes
// (the kernel caps it at net.core.wmem_max/rmem_max).
const sockBuf = 4 << 20

func init() {
	transport.RegisterTransport(Name, Priority, nil, func(o transport.Options) (transport.Transport, error) { return New(o) })
}

// region is one registered memory range.
type region struct {
	id  transport.RegionID
	mem transport.Memory
	buf []byte // host memory; nil for device memory

	// mu is read-held while a receive lands in the region; DeregisterMemory
	// takes it to wait for receives in progress.
	mu   sync.RWMutex
	dead bool
}

// Transport is one node's TCP transport instance. It implements
// transport.Transport; see the package doc for behaviour and lifetimes.
type Transport struct {
	opts       transport.Options
	streams    int
	ackTimeout time.Duration
	ln         net.Listener
	endpoint   string // "host:port" given to senders
	log        *slog.Logger

	mu       sync.RWMutex
	closed   bool
	nextID   transport.RegionID
	regions  map[transport.RegionID]*region
	sorted   []*region // host and device regions sorted by mem.Addr (sender lookup)
	inbound  map[net.Conn]struct{}
	segments map[*segment]struct{}
	// admitted holds the epochs (→ peer) whose connections are accepted;
	// byEpoch the live inbound connections of each epoch, each with a
	// channel closed when its receive goroutine has ended.
	admitted map[uint64]string
	byEpoch  map[uint64]map[net.Conn]chan struct{}

	wg sync.WaitGroup // accept loop and inbound connection goroutines

	// redials counts data connections dialled again after they were lost
	// while idle (segment.redial).
	redials atomic.Uint64
}

// Redials returns how many data connections of this transport's segments
// were dialled again after being lost while idle (a reset between rooms),
// since the transport was opened.
func (t *Transport) Redials() uint64 { return t.redials.Load() }

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Fencer    = (*Transport)(nil)
	_ transport.Segment   = (*segment)(nil)
)

// maxAdmitted bounds the epochs admitted at once (one per live registration
// of a decode with a prefill rank).
const maxAdmitted = 1 << 16

// AdmitEpoch lets connections whose hello names epoch (>= 1) in until
// FenceEpoch(epoch). peer is informational. Errors: epoch 0, a closed
// transport (transport.ErrClosed), more than 65,536 epochs admitted.
func (t *Transport) AdmitEpoch(peer string, epoch uint64) error {
	if epoch == 0 {
		return fmt.Errorf("tcp: admit epoch 0 for %q: epochs start at 1 (0 means no epoch)", peer)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("tcp: admit epoch %d: transport %w", epoch, transport.ErrClosed)
	}
	if _, ok := t.admitted[epoch]; !ok && len(t.admitted) >= maxAdmitted {
		return fmt.Errorf("tcp: admit epoch %d for %q: %d epochs already admitted (fence unused ones)", epoch, peer, maxAdmitted)
	}
	t.admitted[epoch] = peer
	return nil
}

// FenceEpoch withdraws epoch's admission (new connections naming it are
// refused), closes its inbound connections and waits until none of them is
// receiving into memory any more (a receive in progress stops at the closed
// socket). Errors: ctx ended first (call again; the connections stay
// tracked until their goroutines end).
func (t *Transport) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	t.mu.Lock()
	delete(t.admitted, epoch)
	conns := make(map[net.Conn]chan struct{}, len(t.byEpoch[epoch]))
	for c, done := range t.byEpoch[epoch] {
		conns[c] = done
	}
	t.mu.Unlock()
	for c := range conns {
		c.Close()
	}
	for _, done := range conns {
		select {
		case <-done:
		case <-ctx.Done():
			return fmt.Errorf("tcp: fence epoch %d (%s): a receive on one of its %d connections has not stopped: %w", epoch, peer, len(conns), ctx.Err())
		}
	}
	return nil
}

// join registers an inbound connection under the epoch its hello named;
// an epoch that is not admitted (fenced, or never registered) is refused.
func (t *Transport) join(c net.Conn, epoch uint64, done chan struct{}) error {
	if epoch == 0 {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.admitted[epoch]; !ok {
		return fmt.Errorf("tcp: segment epoch %d is not admitted on %s: it was fenced (the decode gave up on that data path) or never registered; the decode registers again with a new epoch", epoch, t.ln.Addr())
	}
	m := t.byEpoch[epoch]
	if m == nil {
		m = map[net.Conn]chan struct{}{}
		t.byEpoch[epoch] = m
	}
	m[c] = done
	return nil
}

// leave forgets an inbound connection of epoch once its goroutine ended.
func (t *Transport) leave(c net.Conn, epoch uint64) {
	if epoch == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if m := t.byEpoch[epoch]; m != nil {
		delete(m, c)
		if len(m) == 0 {
			delete(t.byEpoch, epoch)
		}
	}
}

// New creates a TCP transport and starts its data listener on
// opts.ListenHost:opts.ListenPort ("127.0.0.1" and a free port by default).
// opts.Streams sets connections per segment (0 = DefaultStreams, max 64).
// opts.TCP.AckTimeout overrides DefaultAckTimeout. Endpoint advertises
// opts.AdvertiseHost when set; a wildcard ListenHost (0.0.0.0, ::)
// otherwise advertises the default-route interface's address (logged to
// opts.Logger; a warning when only loopback is left). Errors: an invalid
// option or a listen failure (port in use: pick another or use 0).
func New(opts transport.Options) (*Transport, error) {
	host := opts.ListenHost
	if host == "" {
		host = "127.0.0.1"
	}
	streams := opts.Streams
	if streams == 0 {
		streams = DefaultStreams
	}
	if streams < 0 || streams > 64 {
		return nil, fmt.Errorf("tcp: Streams must be between 1 and 64, got %d", opts.Streams)
	}
	if opts.ListenPort < 0 || opts.ListenPort > 65535 {
		return nil, fmt.Errorf("tcp: ListenPort must be 0..65535, got %d", opts.ListenPort)
	}
	ackTimeout := DefaultAckTimeout
	if d := opts.TCP.AckTimeout; d != 0 {
		if d < 0 {
			return nil, fmt.Errorf("tcp: TCPOptions.AckTimeout %v: want a positive duration such as 10s (0 for the default)", d)
		}
		ackTimeout = d
	}
	log := opts.Log()
	addr := net.JoinHostPort(host, strconv.Itoa(opts.ListenPort))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcp: listen on %s: %w (use port 0 for a free port)", addr, err)
	}
	endpoint := ln.Addr().String()
	_, port, _ := net.SplitHostPort(endpoint)
	switch adv := opts.AdvertiseHost; {
	case adv != "":
		endpoint = net.JoinHostPort(strings.Trim(adv, "[]"), port)
	case hostaddr.IsWildcard(host):
		c := hostaddr.Pick(host)
		endpoint = net.JoinHostPort(c.Host, port)
		if c.Loopback {
			log.Warn("tcp: data listener bound to a wildcard advertises loopback: this host has no other address, so peers on other hosts cannot reach it (set an advertise host)",
				"listen", ln.Addr().String(), "advertised", endpoint)
		} else {
			log.Info("tcp: data listener bound to a wildcard advertises the address chosen for it", "listen", ln.Addr().String(),
				"advertised", endpoint, "interface", c.Iface, "how", c.How)
		}
	}
	t := &Transport{
		endpoint:   endpoint,
		opts:       opts,
		streams:    streams,
		ackTimeout: ackTimeout,
		ln:         ln,
		log:        log.With("transport", Name, "listen", ln.Addr().String()),
		nextID:     1,
		regions:    map[transport.RegionID]*region{},
		inbound:    map[net.Conn]struct{}{},
		segments:   map[*segment]struct{}{},
		admitted:   map[uint64]string{},
		byEpoch:    map[uint64]map[net.Conn]chan struct{}{},
	}
	t.wg.Add(1)
	go t.acceptLoop()
	return t, nil
}

// Name returns "tcp".
func (t *Transport) Name() string { return Name }

// Capabilities: host memory, cross-host, zero-copy on the host (vectored
// writes from and reads into registered memory), strided requests executed
// natively (one header per request), one-sided READ (read.go). CapDeviceMemory is set only when a CUDA
// copier is installed.
func (t *Transport) Capabilities() transport.Caps {
	c := transport.CapHostMemory | transport.CapCrossHost | transport.CapZeroCopy | transport.CapStrided | transport.CapRead | transport.CapOrderedLast
	if _, none := deviceCopier.(noDevice); !none {
		c |= transport.CapDeviceMemory
	}
	return c
}

// Addr returns the data listener's address ("127.0.0.1:40123").
func (t *Transport) Addr() string { return t.ln.Addr().String() }

// hostSlice makes a []byte over [addr, addr+n) of memory the caller vouched
// for in RegisterMemory (mmap, C or pinned memory outside the Go heap).
func hostSlice(addr uintptr, n uint64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), int(n))
}

// RegisterMemory registers m for sending and receiving and returns its
// descriptor (ID assigned here, Addr = m.Addr, Length = m.Length, no Key).
// Errors: zero address or length, a range overlapping a registered one,
// device memory without a CUDA copier (wraps transport.ErrUnsupportedMemory),
// a closed transport (wraps transport.ErrClosed).
func (t *Transport) RegisterMemory(m transport.Memory) (transport.RegionDesc, error) {
	if m.Addr == 0 || m.Length == 0 {
		return transport.RegionDesc{}, fmt.Errorf("tcp: register memory at %#x length %d: address and length must be non-zero", m.Addr, m.Length)
	}
	if uint64(m.Addr)+m.Length < uint64(m.Addr) {
		return transport.RegionDesc{}, fmt.Errorf("tcp: register memory at %#x length %d: range wraps the address space", m.Addr, m.Length)
	}
	r := &region{mem: m}
	switch m.Kind {
	case transport.MemoryHost:
		r.buf = hostSlice(m.Addr, m.Length)
	case transport.MemoryCUDA:
		if err := deviceCopier.check(m); err != nil {
			return transport.RegionDesc{}, err
		}
	default:
		return transport.RegionDesc{}, fmt.Errorf("tcp: register memory at %#x: %w: kind %v", m.Addr, transport.ErrUnsupportedMemory, m.Kind)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return transport.RegionDesc{}, fmt.Errorf("tcp: register memory: transport %w", transport.ErrClosed)
	}
	for _, o := range t.sorted {
		if o.mem.Kind == m.Kind && o.mem.Device == m.Device && uint64(m.Addr) < uint64(o.mem.Addr)+o.mem.Length && uint64(o.mem.Addr) < uint64(m.Addr)+m.Length {
			return transport.RegionDesc{}, fmt.Errorf("tcp: register memory [%#x, +%d): overlaps region %d [%#x, +%d); deregister it first or register one range",
				m.Addr, m.Length, o.id, o.mem.Addr, o.mem.Length)
		}
	}
	r.id = t.nextID
	t.nextID++
	t.regions[r.id] = r
	t.sorted = append(t.sorted, r)
	sort.Slice(t.sorted, func(i, j int) bool { return t.sorted[i].mem.Addr < t.sorted[j].mem.Addr })
	return transport.RegionDesc{ID: r.id, Addr: uint64(m.Addr), Length: m.Length, Kind: m.Kind}, nil
}

// DeregisterMemory removes region id: later writes to it are refused with an
// unknown-region reply. It waits for a receive in progress into the region.
// Errors: an unknown id (wraps transport.ErrUnknownRegion).
func (t *Transport) DeregisterMemory(id transport.RegionID) error {
	t.mu.Lock()
	r, ok := t.regions[id]
	if ok {
		delete(t.regions, id)
		for i, o := range t.sorted {
			if o == r {
				t.sorted = append(t.sorted[:i:i], t.sorted[i+1:]...)
				break
			}
		}
	}
	t.mu.Unlock()
	if !ok {
		return fmt.Errorf("tcp: deregister region %d: %w", id, transport.ErrUnknownRegion)
	}
	r.mu.Lock()
	r.dead = true
	r.mu.Unlock()
	return nil
}

// lookupLocal finds the registered region holding [addr, addr+n).
func (t *Transport) lookupLocal(addr uintptr, n uint64) (*region, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	i := sort.Search(len(t.sorted), func(i int) bool { return t.sorted[i].mem.Addr > addr }) - 1
	if i < 0 {
		return nil, fmt.Errorf("local address %#x is below every registered region: %w", addr, transport.ErrOutOfBounds)
	}
	r := t.sorted[i]
	off := uint64(addr - r.mem.Addr)
	if off+n < off || off+n > r.mem.Length {
		return nil, fmt.Errorf("local range [%#x, +%d) is not inside a registered region (nearest: region %d [%#x, +%d)): %w",
			addr, n, r.id, r.mem.Addr, r.mem.Length, transport.ErrOutOfBounds)
	}
	return r, nil
}

// Endpoint returns the data listener's "host:port" (the same for every peer,
// IPv6 bracketed): the advertise host when set, else the listen address,
// else for a wildcard listen address the address chosen by New.
func (t *Transport) Endpoint(ctx context.Context, peer string) ([]byte, error) {
	t.mu.RLock()
	closed := t.closed
	t.mu.RUnlock()
	if closed {
		return nil, fmt.Errorf("tcp: endpoint: transport %w", transport.ErrClosed)
	}
	return []byte(t.endpoint), nil
}

// Close stops the listener, closes inbound connections and every segment
// opened from this transport (their pending batches fail with ErrClosed),
// and waits for its goroutines. Idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	err := t.ln.Close()
	for c := range t.inbound {
		c.Close()
	}
	segs := make([]*segment, 0, len(t.segments))
	for s := range t.segments {
		segs = append(segs, s)
	}
	t.mu.Unlock()
	for _, s := range segs {
		s.Close()
	}
	t.wg.Wait()
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("tcp: close listener: %w", err)
	}
	return nil
}

func (t *Transport) acceptLoop() {
	defer t.wg.Done()
	for {
		c, err := t.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			t.log.Warn("tcp: accept failed; retrying", "err", err)
			time.Sleep(50 * time.Millisecond)
			continue
		}
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			c.Close()
			return
		}
		t.inbound[c] = struct{}{}
		t.wg.Add(1)
		t.mu.Unlock()
		go t.serve(c)
	}
}

func tuneConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		tc.SetReadBuffer(sockBuf)
		tc.SetWriteBuffer(sockBuf)
		tc.SetKeepAlive(true)
		tc.SetKeepAlivePeriod(5 * time.Second)
	}
}

// serve is the receiving side of one data connection.
func (t *Transport) serve(c net.Conn) {
	defer t.wg.Done()
	rx := receiver{t: t, c: c, done: make(chan struct{})}
	defer func() {
		c.Close()
		t.mu.Lock()
		delete(t.inbound, c)
		t.mu.Unlock()
		t.leave(c, rx.epoch)
		close(rx.done) // after the last receive into memory
	}()
	tuneConn(c)
	sc, ok := c.(syscall.Conn)
	if !ok {
		t.log.Warn("tcp: data connection without a file descriptor; closing", "peer", c.RemoteAddr().String())
		return
	}
	var err error
	if rx.raw, err = sc.SyscallConn(); err != nil {
		t.log.Warn("tcp: data connection: SyscallConn failed; closing", "peer", c.RemoteAddr().String(), "err", err)
		return
	}
	if err := rx.run(); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		t.log.Warn("tcp: data connection closed", "peer", c.RemoteAddr().String(), "err", err)
	}
}

type receiver struct {
	t            *Transport
	c            net.Conn
	epoch        uint64        // from the hello (0: none)
	done         chan struct{} // closed when serve ends (FenceEpoch waits on it)
	hdr          [headerSize]byte
	hdrHave      int // bytes of the next header already in hdr
	ackBuf       []byte
	pending      int    // acks queued in ackBuf
	pendingBytes uint64 // payload those acks cover
	bounce       []byte // device-memory staging, allocated on first use
	raw          syscall.RawConn
	iov          [][]byte
	vecs         []unix.Iovec
	readFn       func(fd uintptr) bool // rx.readv, bound once
	rd           readState
	want         int              // bytes fill still needs (SO_RCVLOWAT target)
	lowat        int              // SO_RCVLOWAT now set on the socket (0 = default 1)
	resetFn      func(fd uintptr) // rx.resetLowat, bound once
	// scatter-frame state, reused across frames
	table  []byte    // the frame's scatter table as read
	ents   []entry   // decoded table
	dests  []*region // region of each entry
	locked []*region // distinct regions of the frame, ascending ID
	// read-response state (read.go), reused across frames
	out  [][]byte    // acks + payload slices of one response (backing array kept)
	bufs net.Buffers // out as handed to WriteTo (a field: no allocation per call)
}

// maxRcvLowat caps the SO_RCVLOWAT the receiver sets while it waits for a
// payload, bytes: the kernel then wakes it once per this much data instead
// of once per segment, which saves wakeups and window-update work. It stays
// well below the receive buffer so the wait always ends.
const maxRcvLowat = 256 << 10

// The receiver holds back at most maxPendingAcks acks covering less than
// maxPendingAckBytes of payload before writing them; it always writes them
// before it would wait for more input.
const (
	maxPendingAcks     = 64
	maxPendingAckBytes = 4 << 20
)

// reply queues an ack; refusals, and acks past the limits above, are written
// at once, the rest when the socket has no more input (see fill).
func (rx *receiver) reply(a ack) error {
	rx.ackBuf = encodeAck(rx.ackBuf, a)
	rx.pending++
	rx.pendingBytes += a.Bytes
	if a.Status != ackOK || rx.pending >= maxPendingAcks || rx.pendingBytes >= maxPendingAckBytes {
		return rx.flush()
	}
	return nil
}

func (rx *receiver) flush() error {
	if len(rx.ackBuf) == 0 {
		return nil
	}
	rx.c.SetWriteDeadline(time.Now().Add(rx.t.ackTimeout))
	_, err := rx.c.Write(rx.ackBuf)
	rx.ackBuf, rx.pending, rx.pendingBytes = rx.ackBuf[:0], 0, 0
	if err != nil {
		return fmt.Errorf("send acks: %w", err)
	}
	return nil
}

func (rx *receiver) run() error {
	var hb [helloSize]byte
	rx.c.SetReadDeadline(time.Now().Add(rx.t.ackTimeout))
	if _, err := io.ReadFull(rx.c, hb[:]); err != nil {
		return fmt.Errorf("read hello: %w", err)
	}
	h, err := decodeHello(hb[:])
	if err != nil {
		rx.reply(ack{Status: ackProtocol, Msg: err.Error()})
		return err
	}
	if err := rx.t.join(rx.c, h.Epoch, rx.done); err != nil {
		rx.reply(ack{Status: ackFenced, Msg: err.Error()})
		return err
	}
	rx.epoch = h.Epoch
	for {
		// Idle between frames is fine (a segment lives across requests).
		// The previous payload read may already have brought (part of) this
		// header in.
		rx.c.SetReadDeadline(time.Time{})
		if rx.hdrHave < headerSize {
			rx.iov = append(rx.iov[:0], rx.hdr[rx.hdrHave:])
			n, err := rx.fill(rx.iov, headerSize-rx.hdrHave)
			rx.hdrHave += n
			if err != nil {
				if errors.Is(err, io.ErrUnexpectedEOF) && rx.hdrHave == 0 {
					err = io.EOF
				}
				return err
			}
		}
		rx.hdrHave = 0
		h, err := decodeHeader(rx.hdr[:])
		if err != nil {
			rx.reply(ack{Status: ackProtocol, Seq: h.Seq, Msg: err.Error()})
			return err
		}
		rx.c.SetReadDeadline(time.Now().Add(rx.t.ackTimeout))
		var a ack
		switch h.Kind {
		case kindScatter:
			a, err = rx.scatter(h)
		case kindRead, kindReadScatter:
			var answered bool
			if answered, a, err = rx.serveRead(h); err == nil && answered {
				continue
			}
		default:
			a, err = rx.frame(h)
		}
		if errors.Is(err, errProtocol) {
			rx.reply(ack{Status: ackProtocol, Seq: h.Seq, Msg: err.Error()})
			return err
		}
		if err != nil {
			return err
		}
		if err := rx.reply(a); err != nil {
			return fmt.Errorf("ack frame %d: %w", h.Seq, err)
		}
	}
}

// frame lands (or refuses and drains) one frame's payload. A returned error
// means the stream is broken; a refusal is reported in the ack.
func (rx *receiver) frame(h header) (ack, error) {
	t := rx.t
	t.mu.RLock()
	r := t.regions[transport.RegionID(h.Region)]
	closing := t.closed
	t.mu.RUnlock()
	refuse := func(status uint8, msg string) (ack, error) {
		if _, err := io.CopyN(io.Discard, rx.c, int64(h.payload())); err != nil {
			return ack{}, fmt.Errorf("drain %d bytes of refused frame %d: %w", h.payload(), h.Seq, err)
		}
		return ack{Status: status, Seq: h.Seq, Msg: msg}, nil
	}
	if closing {
		return refuse(ackShutdown, "receiver is closing")
	}
	if r == nil {
		return refuse(ackUnknownRegion, fmt.Sprintf("region %d is not registered on %s (write at offset %d length %d x %d)",
			h.Region, t.ln.Addr(), h.Offset, h.Count, h.Length))
	}
	if h.Count > 1 && h.Stride < h.Length {
		return refuse(ackBadRequest, fmt.Sprintf("region %d: strided write at offset %d has stride %d < block length %d (blocks overlap)",
			h.Region, h.Offset, h.Stride, h.Length))
	}
	end, ok := h.span()
	if !ok || end > r.mem.Length {
		return refuse(ackOutOfBounds, fmt.Sprintf("region %d: write at offset %d length %d x %d (stride %d) ends at byte %d, past the region's %d bytes",
			h.Region, h.Offset, h.Count, h.Length, h.Stride, end, r.mem.Length))
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.dead {
		return refuse(ackUnknownRegion, fmt.Sprintf("region %d was deregistered (write at offset %d length %d x %d)", h.Region, h.Offset, h.Count, h.Length))
	}
	if h.payload() == 0 {
		return ack{Status: ackOK, Seq: h.Seq}, nil
	}
	if r.buf != nil {
		// Host memory: readv straight into the region (every block of a
		// strided frame in one call), with the next frame's header slot
		// appended so a small frame and the next header share a syscall.
		iov := rx.iov[:0]
		if h.Count > 1 && h.Stride == h.Length {
			// Blocks back to back (a strided request contiguous on this
			// side, e.g. head slices into whole decode tokens): one range.
			iov = append(iov, r.buf[h.Offset:h.Offset+h.payload()])
		} else {
			for i := uint64(0); i < uint64(h.Count); i++ {
				off := h.Offset + i*h.Stride
				iov = append(iov, r.buf[off:off+h.Length])
			}
		}
		iov = append(iov, rx.hdr[:])
		n, err := rx.fill(iov, int(h.payload()))
		clear(iov)
		rx.iov = iov[:0]
		if err != nil {
			return ack{}, fmt.Errorf("read frame %d (%d x %d bytes) into region %d: %w", h.Seq, h.Count, h.Length, h.Region, err)
		}
		rx.hdrHave = n - int(h.payload())
		return ack{Status: ackOK, Seq: h.Seq, Bytes: h.payload()}, nil
	}
	for i := uint64(0); i < uint64(h.Count); i++ {
		off := h.Offset + i*h.Stride
		if cerr, err := rx.toDevice(r, off, h.Length); err != nil {
			return ack{}, err
		} else if cerr != nil {
			rest := (uint64(h.Count) - i - 1) * h.Length
			if _, err := io.CopyN(io.Discard, rx.c, int64(rest)); err != nil {
				return ack{}, fmt.Errorf("drain %d bytes of failed frame %d: %w", rest, h.Seq, err)
			}
			return ack{Status: ackInternal, Seq: h.Seq, Bytes: i * h.Length, Msg: cerr.Error()}, nil
		}
	}
	return ack{Status: ackOK, Seq: h.Seq, Bytes: h.payload()}, nil
}

// scatter lands (or refuses and drains) one scatter frame: it reads the
// table, checks every entry (region registered and alive, range inside it)
// before any byte lands, then reads the whole payload with vectored reads
// straight into the destination ranges (plus the next header, as frame
// does). One bad entry refuses the frame with an ack naming it. An error
// wrapping errProtocol means the table is malformed; any returned error
// means the stream is broken.
func (rx *receiver) scatter(h header) (ack, error) {
	t := rx.t
	ents, err := rx.readTable(h)
	if err != nil {
		return ack{}, err
	}
	refuse := func(status uint8, format string, args ...any) (ack, error) {
		if _, err := io.CopyN(io.Discard, rx.c, int64(h.Length)); err != nil {
			return ack{}, fmt.Errorf("drain %d bytes of refused scatter frame %d: %w", h.Length, h.Seq, err)
		}
		return ack{Status: status, Seq: h.Seq, Msg: fmt.Sprintf(format, args...)}, nil
	}
	dests, closing := rx.lookup(ents)
	defer clear(dests)
	if closing {
		return refuse(ackShutdown, "receiver is closing")
	}
	device := false
	for i, e := range ents {
		r := dests[i]
		if r == nil {
			return refuse(ackUnknownRegion, "entry %d of %d: region %d is not registered on %s (write at offset %d length %d)",
				i, len(ents), e.Region, t.ln.Addr(), e.Offset, e.Length)
		}
		if end, ok := e.end(); !ok || end > r.mem.Length {
			return refuse(ackOutOfBounds, "entry %d of %d: region %d: write at offset %d length %d ends past the region's %d bytes",
				i, len(ents), e.Region, e.Offset, e.Length, r.mem.Length)
		}
		if r.buf == nil {
			device = true
		}
	}
	// Read-lock each distinct region for as long as bytes land in them.
	locked, dead := rx.rlock(dests)
	defer runlock(locked)
	if dead != nil {
		return refuse(ackUnknownRegion, "region %d was deregistered (scatter frame of %d writes)", dead.id, len(ents))
	}
	if !device {
		iov := rx.iov[:0]
		for i, e := range ents {
			iov = append(iov, dests[i].buf[e.Offset:e.Offset+uint64(e.Length)])
		}
		iov = append(iov, rx.hdr[:])
		n, err := rx.fill(iov, int(h.Length))
		clear(iov)
		rx.iov = iov[:0]
		if err != nil {
			return ack{}, fmt.Errorf("read scatter frame %d (%d writes, %d bytes): %w", h.Seq, len(ents), h.Length, err)
		}
		rx.hdrHave = n - int(h.Length)
		return ack{Status: ackOK, Seq: h.Seq, Bytes: h.Length}, nil
	}
	// Some entry lands in device memory: one entry at a time, device
	// entries through the bounce buffer.
	var landed uint64
	for i, e := range ents {
		r := dests[i]
		if r.buf != nil {
			rx.iov = append(rx.iov[:0], r.buf[e.Offset:e.Offset+uint64(e.Length)])
			_, err := rx.fill(rx.iov, int(e.Length))
			clear(rx.iov)
			if err != nil {
				return ack{}, fmt.Errorf("read scatter frame %d entry %d (%d bytes): %w", h.Seq, i, e.Length, err)
			}
		} else if cerr, err := rx.toDevice(r, e.Offset, uint64(e.Length)); err != nil {
			return ack{}, err
		} else if cerr != nil {
			rest := h.Length - landed - uint64(e.Length)
			if _, err := io.CopyN(io.Discard, rx.c, int64(rest)); err != nil {
				return ack{}, fmt.Errorf("drain %d bytes of failed scatter frame %d: %w", rest, h.Seq, err)
			}
			return ack{Status: ackInternal, Seq: h.Seq, Bytes: landed, Msg: fmt.Sprintf("scatter frame entry %d: %v", i, cerr)}, nil
		}
		landed += uint64(e.Length)
	}
	return ack{Status: ackOK, Seq: h.Seq, Bytes: h.Length}, nil
}

// readTable reads and decodes the scatter table of frame h (a scatter
// write or a scatter read) into rx.ents. An error means the stream is
// broken (errProtocol: a malformed table).
func (rx *receiver) readTable(h header) ([]entry, error) {
	need := h.tableBytes()
	if cap(rx.table) < need {
		rx.table = make([]byte, need, maxScatterEntries*entrySize)
	}
	tb := rx.table[:need]
	rx.iov = append(rx.iov[:0], tb)
	_, err := rx.fill(rx.iov, need)
	clear(rx.iov)
	if err != nil {
		return nil, fmt.Errorf("read scatter table of frame %d (%d entries): %w", h.Seq, h.Count, err)
	}
	ents, err := decodeTable(h, tb, rx.ents)
	rx.ents = ents
	return ents, err
}

// lookup returns the region of every entry (nil for one not registered),
// looked up under one read lock of the region table, in rx.dests (the
// caller clears it), and whether the transport is closing.
func (rx *receiver) lookup(ents []entry) (dests []*region, closing bool) {
	t := rx.t
	dests = rx.dests[:0]
	t.mu.RLock()
	closing = t.closed
	var last *region
	for i, e := range ents {
		if i == 0 || e.Region != ents[i-1].Region {
			last = t.regions[transport.RegionID(e.Region)]
		}
		dests = append(dests, last)
	}
	t.mu.RUnlock()
	rx.dests = dests
	return dests, closing
}

// rlock read-locks each distinct region of dests once, in ascending ID
// order (lockOrder), and returns them (in rx.locked) with the first one
// that was deregistered, if any. The caller unlocks with runlock.
func (rx *receiver) rlock(dests []*region) (locked []*region, dead *region) {
	locked = lockOrder(dests, rx.locked)
	rx.locked = locked
	for _, r := range locked {
		r.mu.RLock()
	}
	for _, r := range locked {
		if r.dead {
			return locked, r
		}
	}
	return locked, nil
}

// runlock releases what rlock locked.
func runlock(locked []*region) {
	for _, r := range locked {
		r.mu.RUnlock()
	}
	clear(locked)
}

// lockOrder returns the distinct regions of dests in ascending ID order,
// in dst's storage. A receiver read-locks a scatter frame's regions in this
// order: each once (a second RLock of the same region behind a waiting
// DeregisterMemory would never return), and in one global order, so two
// frames and two DeregisterMemory calls can never wait on each other in a
// cycle.
func lockOrder(dests []*region, dst []*region) []*region {
	dst = dst[:0]
	for i, r := range dests {
		if i == 0 || r != dests[i-1] {
			dst = append(dst, r)
		}
	}
	slices.SortFunc(dst, func(a, b *region) int { return cmp.Compare(a.id, b.id) })
	return slices.Compact(dst)
}

// readState carries one readv result out of the RawConn callback.
type readState struct {
	n     uintptr
	errno syscall.Errno
	idle  bool // would block with acks queued: write them first
}

// readv is the RawConn.Read callback: one readv(2) of rx.vecs.
func (rx *receiver) readv(fd uintptr) bool {
	v := rx.vecs
	for {
		n, _, errno := unix.Syscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(&v[0])), uintptr(len(v)))
		switch {
		case errno == unix.EINTR:
			continue
		case errno == unix.EAGAIN && len(rx.ackBuf) > 0:
			rx.rd = readState{idle: true}
			return true
		case errno == unix.EAGAIN:
			// About to wait: ask the kernel to wake us only when (up
			// to maxRcvLowat of) the bytes still needed are there,
			// then read again in case they arrived meanwhile.
			if want := max(1, min(rx.want, maxRcvLowat)); want != max(1, rx.lowat) {
				if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, want) == nil {
					rx.lowat = want
					continue
				}
			}
		}
		rx.rd = readState{n: n, errno: errno}
		return errno != unix.EAGAIN
	}
}

// fill reads from the socket into iov with readv(2) (at most 1024 slices,
// IOV_MAX, per call) until at least need bytes have arrived, and returns how
// many arrived (up to the total length of iov). Before it would wait for
// input it writes the queued acks. It honours the connection's read
// deadline; iov's elements are consumed. A closed socket before need bytes
// is io.ErrUnexpectedEOF.
func (rx *receiver) fill(iov [][]byte, need int) (int, error) {
	got := 0
	defer rx.clearLowat() // other readers of rx.c must not wait on it
	for got < need {
		for len(iov) > 0 && len(iov[0]) == 0 {
			iov = iov[1:]
		}
		v := rx.vecs[:0]
		for _, b := range iov[:min(len(iov), 1024)] {
			vec := unix.Iovec{Base: &b[0]}
			vec.SetLen(len(b))
			v = append(v, vec)
		}
		rx.vecs = v
		rx.rd = readState{}
		if rx.readFn == nil {
			rx.readFn = rx.readv // allocated once, not per call
		}
		rx.want = need - got
		rerr := rx.raw.Read(rx.readFn)
		n, errno, idle := rx.rd.n, rx.rd.errno, rx.rd.idle
		clear(v)
		if rerr != nil {
			return got, rerr
		}
		if idle {
			if err := rx.flush(); err != nil {
				return got, err
			}
			continue
		}
		if errno != 0 {
			return got, os.NewSyscallError("readv", errno)
		}
		if n == 0 {
			return got, io.ErrUnexpectedEOF
		}
		got += int(n)
		for m := int(n); m > 0; {
			if m >= len(iov[0]) {
				m -= len(iov[0])
				iov = iov[1:]
			} else {
				iov[0] = iov[0][m:]
				m = 0
			}
		}
	}
	return got, nil
}

// clearLowat puts SO_RCVLOWAT back to the default (1 byte) if fill raised it.
func (rx *receiver) clearLowat() {
	if rx.lowat <= 1 {
		return
	}
	if rx.resetFn == nil {
		rx.resetFn = rx.resetLowat
	}
	rx.raw.Control(rx.resetFn)
}

func (rx *receiver) resetLowat(fd uintptr) {
	if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1) == nil {
		rx.lowat = 0
	}
}

// toDevice receives n bytes into device region r at off through the bounce
// buffer. copyErr is a device-copy failure (the rest of the block has been
// drained; the stream stays usable); err means the stream is broken.
func (rx *receiver) toDevice(r *region, off, n uint64) (copyErr, err error) {
	if rx.bounce == nil {
		rx.bounce = make([]byte, bounceSize)
	}
	for n > 0 {
		k := min(n, uint64(len(rx.bounce)))
		if _, err := io.ReadFull(rx.c, rx.bounce[:k]); err != nil {
			return nil, fmt.Errorf("read %d bytes for device region %d: %w", k, r.id, err)
		}
		n -= k
		if cerr := deviceCopier.copyToDevice(r.mem.Addr+uintptr(off), r.mem.Device, rx.bounce[:k]); cerr != nil {
			if _, err := io.CopyN(io.Discard, rx.c, int64(n)); err != nil {
				return nil, fmt.Errorf("drain %d bytes after failed device copy: %w", n, err)
			}
			return fmt.Errorf("copy %d bytes to cuda:%d region %d at offset %d: %w", k, r.mem.Device, r.id, off, cerr), nil
		}
		off += k
	}
	return nil, nil
}
