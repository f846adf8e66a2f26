package transport

import (
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Options configure a transport instance. Fields a transport does not use are
// ignored. The zero value is usable: every field's zero means the
// transport's default (loopback, a free port, its own stream count, every
// usable device, an automatically chosen GID).
type Options struct {
	// ListenHost is the address the receiving side binds ("127.0.0.1" by
	// default). Port 0 picks a free port.
	ListenHost string
	// ListenPort is the data port (0 = any free port).
	ListenPort int
	// AdvertiseHost is the host peers are told to connect to (IP or
	// hostname). Empty: ListenHost, except that a wildcard ListenHost
	// (0.0.0.0, ::) advertises the address of the default-route interface
	// (else the first non-loopback address; loopback only when there is
	// nothing else, with a warning).
	AdvertiseHost string
	// Streams is the number of parallel connections (or QPs) per peer; 0 means
	// the transport's default.
	Streams int
	// Devices restricts a hardware transport to these device names (for RDMA:
	// "mlx5_0,mlx5_1"); empty means all usable.
	Devices []string
	// GIDIndex, when set, forces an RDMA GID index (the ibv_query_gid index
	// of the port); nil, the zero value, lets the transport choose (RoCE v2,
	// an address of a local interface, per NIC). tcp and shm ignore it.
	GIDIndex *int
	// Logger receives the transport's logs (peer loss, redials, the address
	// a wildcard listener advertises); nil means slog.Default().
	Logger *slog.Logger
	// TCP, SHM and RDMA tune one transport each; the others ignore them.
	// Their zero values keep the transport's defaults.
	TCP  TCPOptions
	SHM  SHMOptions
	RDMA RDMAOptions
}

// Log returns o.Logger, or slog.Default() when it is nil.
func (o Options) Log() *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.Default()
}

// TCPOptions are the tcp transport's settings (package engine/tcp).
type TCPOptions struct {
	// AckTimeout: a stream with frames in flight and no acknowledgement for
	// this long is declared lost (0: tcp.DefaultAckTimeout, 10 s; it must
	// exceed the time the link needs for 8 MiB). Negative is refused.
	AckTimeout time.Duration
}

// SHMOptions are the shm transport's settings (package engine/shm).
type SHMOptions struct {
	// CopyThreads is the number of goroutines that copy one large batch,
	// 1..256 (0: Options.Streams, else min(4, GOMAXPROCS)).
	CopyThreads int
	// ParallelMinBytes is the batch size in bytes from which copies are
	// split across goroutines (0: 8 MiB for shm, 1 MiB for cma).
	ParallelMinBytes uint64
	// StreamMinBytes is the write batch size in bytes from which shm
	// copies with non-temporal stores instead of copy() (0: the default,
	// 1 MiB; SHMStreamOff: never; 1: every write batch). Reads and cma
	// ignore it. The engine never reads the environment: `kvxfer` and the
	// C ABI set it from KVXFER_SHM_STREAM_MIN (ParseSHMStreamMin).
	StreamMinBytes uint64
}

// SHMStreamOff as SHMOptions.StreamMinBytes turns shm's non-temporal
// stores off: no batch reaches 2^64-1 bytes, so every write batch is
// copied with copy().
const SHMStreamOff uint64 = 1<<64 - 1

// ParseSHMStreamMin parses a KVXFER_SHM_STREAM_MIN value into
// SHMOptions.StreamMinBytes: "" is 0 (the default, 1 MiB), "off" and "0"
// are SHMStreamOff, any other decimal is a byte count. The error names
// the value and what it takes; the caller adds where it came from.
func ParseSHMStreamMin(v string) (uint64, error) {
	switch v {
	case "":
		return 0, nil
	case "off", "0":
		return SHMStreamOff, nil
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: want a byte count (e.g. 1048576), or \"off\" (also 0) for no non-temporal stores", v)
	}
	return n, nil
}

// RDMAOptions are the rdma transport's settings (package rdma). Zero (nil
// for the pointers) keeps the default given with each field; a value out of
// range makes rdma.New fail naming the field and the range.
type RDMAOptions struct {
	// SliceSize is the most bytes one RDMA WRITE carries when a transfer is
	// striped, 4 KiB..1 GiB (default 1 MiB).
	SliceSize uint64
	// SQDepth is the send queue depth per QP, 4..16384 (default 256).
	SQDepth int
	// QPTimeout is the QP ACK timeout code, 0..31: 4.096 us * 2^code
	// (default 14, about 67 ms). A pointer because 0 (wait forever) is a
	// valid code.
	QPTimeout *uint8
	// RetryCount is the QP's transport retry count, 0..7 (default 7).
	RetryCount *uint8
	// MaxMRSize splits registered regions into MRs of at most this many
	// bytes, >= 4096 (default: the device's max_mr_size).
	MaxMRSize uint64
	// StallTimeout: with WRs in flight and no completion for this long a
	// segment declares its peer lost, >= 10 ms (default 10 s).
	StallTimeout time.Duration
	// CQPoll makes a segment poll its CQs with a 20 us..1 ms backoff instead
	// of sleeping on a completion channel (the default).
	CQPoll bool
}

// DefaultOptions returns options with auto-selected values: the zero
// value with ListenHost spelled out ("127.0.0.1").
func DefaultOptions() Options {
	return Options{ListenHost: "127.0.0.1"}
}

// Factory creates a transport instance.
type Factory func(Options) (Transport, error)

// Probe reports whether a transport can run here: nil when it can; an error
// wrapping ErrUnavailable that says why when it cannot.
type Probe func() error

type driver struct {
	name     string
	priority int
	factory  Factory
	probe    Probe
}

var (
	driversMu sync.RWMutex
	drivers   = map[string]driver{}
)

// RegisterTransport makes a transport available by name (the database/sql
// driver pattern: transports call it from init). Higher priority wins in
// automatic selection (rdma 300 > shm 200 > cma 150 > tcp 100). It panics on a
// duplicate name, as database/sql does.
func RegisterTransport(name string, priority int, probe Probe, f Factory) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if _, dup := drivers[name]; dup {
		panic("engine: transport registered twice: " + name)
	}
	if probe == nil {
		probe = func() error { return nil }
	}
	drivers[name] = driver{name: name, priority: priority, factory: f, probe: probe}
}

// Transports lists registered transport names, highest priority first.
func Transports() []string {
	driversMu.RLock()
	defer driversMu.RUnlock()
	ds := make([]driver, 0, len(drivers))
	for _, d := range drivers {
		ds = append(ds, d)
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i].priority > ds[j].priority })
	names := make([]string, len(ds))
	for i, d := range ds {
		names[i] = d.name
	}
	return names
}

// ProbeTransport runs the named transport's availability probe.
func ProbeTransport(name string) error {
	driversMu.RLock()
	d, ok := drivers[name]
	driversMu.RUnlock()
	if !ok {
		return fmt.Errorf("engine: %w %q (registered: %s; import its package, e.g. _ \"github.com/kvxfer/kvxfer/engine/tcp\")", ErrUnknownTransport, name, strings.Join(Transports(), ", "))
	}
	return d.probe()
}

// OpenTransport creates the named transport. name "auto" (or "") picks the
// highest-priority transport in allowed (all registered when allowed is
// empty) whose probe passes. An unregistered name fails with
// ErrUnknownTransport, one whose probe fails wraps ErrUnavailable. To open
// every transport a --transport value names, use OpenTransports.
func OpenTransport(name string, opts Options, allowed ...string) (Transport, error) {
	if name == "" || name == "auto" {
		var reasons []string
		cands := allowed
		if len(cands) == 0 {
			cands = Transports()
		}
		for _, n := range orderByPriority(cands) {
			if err := ProbeTransport(n); err != nil {
				reasons = append(reasons, fmt.Sprintf("%s: %v", n, err))
				continue
			}
			return OpenTransport(n, opts)
		}
		return nil, fmt.Errorf("engine: no usable transport among [%s]: %s", strings.Join(cands, ","), strings.Join(reasons, "; "))
	}
	driversMu.RLock()
	d, ok := drivers[name]
	driversMu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("engine: %w %q (registered: %s)", ErrUnknownTransport, name, strings.Join(Transports(), ", "))
	}
	if err := d.probe(); err != nil {
		return nil, fmt.Errorf("engine: transport %s unavailable: %w", name, err)
	}
	t, err := d.factory(opts)
	if err != nil {
		return nil, fmt.Errorf("engine: open transport %s: %w", name, err)
	}
	return t, nil
}

func orderByPriority(names []string) []string {
	driversMu.RLock()
	defer driversMu.RUnlock()
	out := append([]string(nil), names...)
	sort.SliceStable(out, func(i, j int) bool {
		return drivers[out[i]].priority > drivers[out[j]].priority
	})
	return out
}
