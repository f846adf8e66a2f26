package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/internal/sglangenv"
	"github.com/kvxfer/kvxfer/workload"
)

// roleFlags are the flags shared by `kvxfer prefill` and `kvxfer decode`.
type roleFlags struct {
	bootstrap        string
	model            string
	pageSize         int
	tpSize, tpRank   int
	ppSize, ppRank   int
	dpSize, dpRank   int
	poolMB           int
	transport        string
	host             string
	kvDtype          string
	bootstrapTimeout time.Duration
	waitingTimeout   time.Duration
	peerTimeout      time.Duration
	fenceTimeout     time.Duration
	digest           bool
	hold             time.Duration
	writeDelay       time.Duration
	checksum         bool
	verify           bool
	fill             bool
	ringSlots        int
	auxRows          int
	prefixBlocks     int
	blockTokens      int
	chunkPages       int
	prefault         bool
	device           string
	authToken        string
	controlAuth      bool
	maxPeers         int
	dirCheck         time.Duration
	advertiseHost    string
	metadata         string
	metadataTTL      time.Duration
	fragmentSeed     uint64
	obs              obsFlags
	noProbe          bool
}

func (f *roleFlags) add(cmd *cobra.Command, role engine.Role) {
	fs := cmd.Flags()
	if role == engine.RolePrefill {
		fs.StringVar(&f.bootstrap, "bootstrap", "127.0.0.1:8998", "bootstrap server host:port this prefill rank registers with")
		fs.IntVar(&f.dpSize, "dp-size", 1, "prefill attention-DP size")
		fs.IntVar(&f.dpRank, "dp-rank", 0, "prefill attention-DP rank")
		fs.IntVar(&f.chunkPages, "chunk-pages", 0, "send each request in chunks of this many pages (0 = one chunk)")
		fs.DurationVar(&f.dirCheck, "directory-check-interval", engine.DefaultDirectoryCheckInterval,
			"how often this rank checks that the bootstrap directory still names it (±20% jitter) and registers again when it does not (a restarted directory); 0 disables")
		fs.DurationVar(&f.writeDelay, "inject-write-delay", 0, "fault injection (kvxfer chaos): land every transfer batch this long after it was posted (engine/faulty DelayWrites)")
		_ = fs.MarkHidden("inject-write-delay")
		fs.BoolVar(&f.fill, "fill", true, "fill each request's source pages with the (room, layer, token, head) test pattern before sending")
		fs.BoolVar(&f.noProbe, "no-probe", false, "refuse kvxfer doctor probes (by default this rank answers one at a time by writing a small pattern from a buffer of its own into the doctor's scratch region, never its KV)")
	} else {
		fs.StringVar(&f.bootstrap, "bootstrap", "127.0.0.1:8998", "default bootstrap server host:port of the prefill instance (a request line may name another)")
		fs.BoolVar(&f.checksum, "checksum", false, "ask producers for a CRC32C over the transferred bytes and check it before Success")
		fs.BoolVar(&f.verify, "verify", false, "verify every received byte against the prefill's --fill test pattern (what kvxfer demo does)")
		fs.IntVar(&f.ringSlots, "ring-slots", engine.DefaultRingSlots, "metadata ring slots: one per producer of each room in flight; rooms beyond them wait for a free slot (up to --waiting-timeout) instead of failing")
		fs.IntVar(&f.prefixBlocks, "prefix-cache-blocks", 0, "keep the KV of up to this many prompt blocks (named by a request's hash_ids chain) and ask producers only for what follows the longest held prefix (SGLang decode_prefix_len); the KV buffers grow by this many blocks; 0 = off")
		fs.IntVar(&f.blockTokens, "prefix-block-tokens", workload.DefaultBlockTokens, "tokens per hash_ids block (512 in the Mooncake traces; a whole number of pages)")
		fs.BoolVar(&f.digest, "digest", false, "print the SHA-256 of each request's received KV bytes (\"digest\"), for a harness that checks the bytes itself")
		fs.DurationVar(&f.hold, "hold", 0, "keep each successful request's pages this long before the digest and before they are reused (a consumer using the KV; shows writes that land after a room was handed over)")
		fs.DurationVar(&f.fenceTimeout, "fence-timeout", engine.DefaultFenceTimeout, "how long a failed request waits for its producers to acknowledge the abort before their data path is cut; its pages are reused only after that")
	}
	fs.IntVar(&f.auxRows, "aux-rows", 1024, "rows of each aux (metadata) buffer: requests in flight at once on this rank")
	fs.StringVar(&f.model, "model", "llama-3.1-8b", "built-in model name ("+strings.Join(workload.BuiltinModels(), ", ")+") or a Hugging Face config.json path")
	fs.IntVar(&f.pageSize, "page-size", workload.DefaultPageSize, "KV page size in tokens (must match the peer)")
	fs.IntVar(&f.tpSize, "tp-size", 1, "attention-TP size of this instance")
	fs.IntVar(&f.tpRank, "tp-rank", 0, "attention-TP rank of this process")
	fs.IntVar(&f.ppSize, "pp-size", 1, "pipeline-parallel size of this instance")
	fs.IntVar(&f.ppRank, "pp-rank", 0, "pipeline-parallel rank of this process")
	fs.IntVar(&f.poolMB, "pool-mb", 2048, "KV pool size of this rank in MiB")
	fs.StringVar(&f.device, "device", "", "where the KV pool lives: host memory (empty, the default) or cuda:N (device memory on CUDA device N; needs the NVIDIA driver, and only transports that can move device memory are used)")
	fs.BoolVar(&f.prefault, "prefault", true, "make the host KV and aux buffers resident and warm when they are allocated and registered (populate, then one kernel and one user write per page), so the first room pays no first-touch faults and runs at the speed of the later ones; costs about one memory pass at start; --prefault=false skips it (faster start, slow first room)")
	fs.Uint64Var(&f.fragmentSeed, "fragment-seed", 0, "hand out KV pages in the random order of a warm server's free list, seeded by this (pages of a request are then scattered and each is its own write); 0 = lowest first, as a fresh pool")
	fs.StringVar(&f.transport, "transport", "auto", "data transports to open: auto (every usable one) or a comma list (tcp, shm, rdma)")
	if role == engine.RolePrefill {
		fs.StringVar(&f.authToken, "bootstrap-auth-token", "", tokenFlagHelp)
	} else {
		fs.StringVar(&f.authToken, "bootstrap-auth-token", "", tokenFlagHelp+
			"; a decode sends it on the same routes, which SGLang's protocol has it call none of today, so one environment can configure every rank")
	}
	fs.BoolVar(&f.controlAuth, "control-auth", envOr("KVXFER_CONTROL_AUTH", "") == "1", "tag every control frame with an HMAC keyed by the --bootstrap-auth-token and drop frames without a valid tag, so nobody without the token can inject control frames; every prefill and decode rank of the deployment needs it and the same token (env KVXFER_CONTROL_AUTH=1)")
	fs.IntVar(&f.maxPeers, "max-peers", engine.DefaultMaxPeers, "control peers this rank keeps a socket and state for; beyond it the least recently used idle one is closed, and with none idle a new peer is refused naming the limit")
	fs.StringVar(&f.host, "host", "127.0.0.1", "address the control (ZMQ) and data listeners bind: an IPv4 or IPv6 address, a hostname, or 0.0.0.0 / :: for every interface (then the address of the default-route interface is advertised unless --advertise-host says otherwise)")
	fs.StringVar(&f.advertiseHost, "advertise-host", envOr("KVXFER_ADVERTISE_HOST", ""), "address peers are told to connect to (this rank's rank_ip and endpoints), when it differs from --host, e.g. behind NAT or with a wildcard --host (env KVXFER_ADVERTISE_HOST)")
	fs.StringVar(&f.kvDtype, "kv-cache-dtype", "auto", "KV cache element type, as SGLang's --kv-cache-dtype: "+strings.Join(workload.KVCacheDtypes, ", ")+
		" (auto = the model's torch_dtype; fp8 = 1 byte per element); prefill and decode must pass the same string")
	boot, _ := sglangenv.Seconds(os.Getenv, sglangenv.BootstrapTimeout, engine.DefaultBootstrapTimeout)
	wait, _ := sglangenv.Seconds(os.Getenv, sglangenv.WaitingTimeout, engine.DefaultWaitingTimeout)
	fs.DurationVar(&f.bootstrapTimeout, "bootstrap-timeout", boot, "bootstrap timeout (env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, seconds)")
	fs.DurationVar(&f.waitingTimeout, "waiting-timeout", wait, "waiting timeout (env SGLANG_DISAGGREGATION_WAITING_TIMEOUT, seconds)")
	fs.DurationVar(&f.peerTimeout, "peer-timeout", engine.DefaultPeerTimeout, "fail a request when its peer is silent this long")
	addMetadataFlags(fs, &f.metadata, &f.metadataTTL)
	addObsFlags(fs, &f.obs)
}

// openTransports opens the transports spec names (engine.OpenTransports:
// "auto" = every registered one whose probe passes) listening on host and
// advertising advertise.
func openTransports(spec, host, advertise string) ([]engine.Transport, error) {
	opts := engine.DefaultOptions()
	opts.ListenHost = strings.Trim(host, "[]")
	opts.AdvertiseHost = advertise
	return engine.OpenTransports(spec, opts)
}

func closeAll(ts []engine.Transport) {
	for _, t := range ts {
		_ = t.Close()
	}
}

// validateRoleFlags checks the flags runRole cannot take as given; each
// error names the flag, the bad value and what is accepted.
func validateRoleFlags(f *roleFlags) error {
	switch {
	case f.pageSize < 1:
		return fmt.Errorf("--page-size %d: must be >= 1 token (default %d; prefill and decode must match)", f.pageSize, workload.DefaultPageSize)
	case f.chunkPages < 0:
		return fmt.Errorf("--chunk-pages %d: must be >= 0 (0 = send each request in one chunk)", f.chunkPages)
	case f.bootstrapTimeout <= 0 || f.waitingTimeout <= 0:
		return fmt.Errorf("--bootstrap-timeout %s and --waiting-timeout %s must both be > 0", f.bootstrapTimeout, f.waitingTimeout)
	case f.peerTimeout <= 0:
		return fmt.Errorf("--peer-timeout %s: must be > 0", f.peerTimeout)
	case f.fenceTimeout < 0:
		return fmt.Errorf("--fence-timeout %s: must be > 0", f.fenceTimeout)
	case f.hold < 0:
		return fmt.Errorf("--hold %s: must be >= 0", f.hold)
	case f.dirCheck < 0:
		return fmt.Errorf("--directory-check-interval %s: must be >= 0 (0 disables the check)", f.dirCheck)
	case f.auxRows < 1 || f.auxRows > 1<<20:
		return fmt.Errorf("--aux-rows %d: must be 1 … 2^20", f.auxRows)
	case f.prefixBlocks < 0:
		return fmt.Errorf("--prefix-cache-blocks %d: must be >= 0 (0 = off)", f.prefixBlocks)
	case f.prefixBlocks > 0 && (f.blockTokens < 1 || f.blockTokens%f.pageSize != 0):
		return fmt.Errorf("--prefix-block-tokens %d: must be a whole number of --page-size %d pages", f.blockTokens, f.pageSize)
	}
	if f.advertiseHost != "" {
		if _, err := bootstrap.ValidateHost(f.advertiseHost); err != nil {
			return fmt.Errorf("--advertise-host (or KVXFER_ADVERTISE_HOST) %q: %v", f.advertiseHost, err)
		}
	}
	if _, err := workload.KVCacheDtypeBytes(f.kvDtype); err != nil {
		return fmt.Errorf("--kv-cache-dtype %q: want one of %s", f.kvDtype, strings.Join(workload.KVCacheDtypes, ", "))
	}
	return nil
}

// roleLayout builds the rank's layout from the flags; a --kv-cache-dtype
// other than auto sets the bytes per KV element.
func roleLayout(f *roleFlags) (*workload.Layout, error) {
	m, err := workload.LookupModel(f.model)
	if err != nil {
		return nil, err
	}
	eb, err := workload.KVCacheDtypeBytes(f.kvDtype)
	if err != nil {
		return nil, err
	}
	if eb > 0 {
		m.DtypeBytes = eb
	}
	o := workload.LayoutOptions{PageSize: f.pageSize, TPSize: f.tpSize, TPRank: f.tpRank, PPSize: f.ppSize, PPRank: f.ppRank}
	if f.poolMB <= 0 {
		return nil, fmt.Errorf("--pool-mb %d: must be > 0", f.poolMB)
	}
	n, err := workload.PagesForBytes(m, o, uint64(f.poolMB)<<20)
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("--pool-mb %d holds no page of %s (raise --pool-mb)", f.poolMB, m.Name)
	}
	if f.prefixBlocks > 0 {
		n += f.prefixBlocks * f.blockTokens / f.pageSize // the prefix cache's blocks, on top of --pool-mb
	}
	o.NumPages = n
	return workload.NewLayout(m, o)
}

// requestLine is one request on a role's stdin (JSON lines):
// {"room": <bootstrap_room>, "tokens": <prompt length>} and, for a decode,
// optionally "bootstrap": "host:port".
type requestLine struct {
	// Room is the request's bootstrap_room.
	Room uint64 `json:"room"`
	// Tokens is the prompt length whose KV moves.
	Tokens int `json:"tokens"`
	// Bootstrap optionally overrides the decode's --bootstrap address.
	Bootstrap string `json:"bootstrap,omitempty"`
	// HashIDs optionally name the prompt's blocks (Mooncake hash_ids, one
	// per --prefix-block-tokens tokens); a decode with a prefix cache uses
	// them, a prefill ignores them.
	HashIDs []int64 `json:"hash_ids,omitempty"`
}

// readyEvent is the Event of the one line a rank prints when it serves
// requests; result lines have no event field.
const readyEvent = "ready"

// replyLine is one line on a role's stdout (JSON lines): first the ready line
// ({"event":"ready", ...}, no room key), then exactly one result line per
// non-blank input line, in completion order, carrying the input's line
// number and (when the line named one) its room.
type replyLine struct {
	// Event is "ready" on the startup line and empty (omitted) on results.
	Event string `json:"event,omitempty"`
	// Line is the 1-based stdin line number a result answers.
	Line       int      `json:"line,omitempty"`
	Endpoint   string   `json:"endpoint,omitempty"`
	Transports []string `json:"transports,omitempty"`
	// Metrics (ready line) is the rank's bound --metrics-addr.
	Metrics string `json:"metrics,omitempty"`
	// Instance (ready line) is the rank's instance id.
	Instance string `json:"instance,omitempty"`
	// Ring (decode's ready line) is where the metadata ring lives: "gpu"
	// (pinned and mapped, a kernel can read it) or "host".
	Ring   string `json:"ring,omitempty"`
	Role   string `json:"role"`
	TPRank int    `json:"tp_rank"`
	PPRank int    `json:"pp_rank"`
	// Room is the request's bootstrap_room; absent on the ready line and on
	// results for lines whose room could not be read.
	Room *uint64 `json:"room,omitempty"`
	OK   bool    `json:"ok"`
	// Error says what failed (never empty when OK is false).
	Error string `json:"error,omitempty"`
	Pages int    `json:"pages"`
	// Bytes is the KV bytes moved: what the prefill rank wrote (all
	// destinations) or what the decode rank received.
	Bytes uint64 `json:"bytes"`
	// AuxBytes is the aux-row bytes moved with the KV.
	AuxBytes uint64 `json:"aux_bytes,omitempty"`
	// PrefixTokens is the prompt tokens the decode already held (not sent);
	// SkippedBytes the KV bytes that saved.
	PrefixTokens int    `json:"prefix_tokens,omitempty"`
	SkippedBytes uint64 `json:"skipped_bytes,omitempty"`
	Dummy        bool   `json:"dummy,omitempty"`
	// Writes (prefill) is the KV write requests the transfer took: one per
	// run of pages contiguous on both sides per buffer (engine
	// TransferMetric.Writes).
	Writes int `json:"writes,omitempty"`
	// StartUnixNS and EndUnixNS (prefill) bound the transfer (first Send,
	// Success) in Unix nanoseconds, so a driver on the same host can take
	// the union of concurrent transfers' intervals.
	StartUnixNS int64 `json:"start_unix_ns,omitempty"`
	EndUnixNS   int64 `json:"end_unix_ns,omitempty"`
	// Digest (decode --digest) is the SHA-256 of the room's received KV
	// bytes (workload.KVBuffers.Digest), taken after --hold.
	Digest     string `json:"digest,omitempty"`
	TransferUS int64  `json:"transfer_us"`
	FillUS     int64  `json:"fill_us,omitempty"`
	VerifyUS   int64  `json:"verify_us,omitempty"`
}

// runRole runs a prefill or decode rank: it serves request lines from stdin
// until EOF (or a signal), writing one reply line per request to stdout.
func runRole(role engine.Role, f *roleFlags) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	for _, env := range []string{sglangenv.BootstrapTimeout, sglangenv.WaitingTimeout} {
		if _, err := sglangenv.Seconds(os.Getenv, env, 0); err != nil {
			return err
		}
	}
	if err := validateRoleFlags(f); err != nil {
		return err
	}
	layout, err := roleLayout(f)
	if err != nil {
		return err
	}
	dev, onDevice, err := parseDevice(f.device)
	if err != nil {
		return err
	}
	if onDevice {
		if err := cuda.Available(); err != nil {
			return fmt.Errorf("--device %s: CUDA is not usable on this host: %w (drop --device to keep the KV pool in host memory)", f.device, err)
		}
	}
	// The rank's KV memory, laid out as a serving engine lays it out: one
	// buffer per layer for K and for V (or per layer for MLA), plus SGLang's
	// aux (metadata) buffers; the KV manager only registers them.
	pool, err := workload.NewKVBuffers(layout, workload.BufferOptions{Name: role.String() + "-kv", Device: dev, Aux: workload.DefaultAux, AuxRows: f.auxRows, Prefault: f.prefault})
	if err != nil {
		return err
	}
	defer pool.Close()
	if f.fragmentSeed != 0 {
		pool.Fragment(f.fragmentSeed)
	}
	rows := workload.NewPageAllocator(f.auxRows)
	var cache *workload.PrefixCache
	if role == engine.RoleDecode && f.prefixBlocks > 0 {
		if cache, err = workload.NewPrefixCache(pool.PageAllocator, f.pageSize, f.blockTokens, f.prefixBlocks); err != nil {
			return err
		}
	}
	ts, err := openTransports(f.transport, f.host, f.advertiseHost)
	if err != nil {
		return err
	}
	if onDevice {
		if ts, err = deviceTransports(ts, f.transport, f.device); err != nil {
			return err
		}
	}
	if f.writeDelay > 0 {
		for i, t := range ts {
			ts[i] = faulty.Wrap(t, faulty.DelayWrites(f.writeDelay))
		}
	}
	defer closeAll(ts)
	ring := engine.RingAllocator(engine.AutoRingMemory)
	if onDevice && os.Getenv("KVXFER_RING_DEVICE") == "" {
		ring = engine.CUDARingMemory(dev) // the ring on the KV pool's GPU
	}
	cfg := engine.ManagerConfig{Role: role, KV: pool.Args(), Transports: ts, BootstrapAddr: f.bootstrap, DPRank: f.dpRank, DPSize: f.dpSize,
		BootstrapAuthToken: bootstrapToken(f.authToken, os.Getenv), DirectoryCheckInterval: f.dirCheck,
		AuthenticateControl: f.controlAuth, MaxPeers: f.maxPeers,
		KVCacheDtype: f.kvDtype, ControlHost: f.host, AdvertiseHost: f.advertiseHost, BootstrapTimeout: f.bootstrapTimeout, WaitingTimeout: f.waitingTimeout,
		PeerTimeout: f.peerTimeout, FenceTimeout: f.fenceTimeout, RingSlots: f.ringSlots, Checksum: f.checksum, NoPrefault: !f.prefault,
		// The decode's metadata ring: memfd memory, also pinned and mapped for
		// a GPU when CUDA is present (KVXFER_RING_DEVICE picks the GPU), so
		// the shm transport can share it by fd either way.
		RingAlloc: ring}
	if role == engine.RoleDecode {
		cfg.BootstrapAddr = ""
		cfg.FreePages = pool.FreePages
		if f.verify {
			cfg.VerifyKV = verifyKV(pool, f.pageSize)
		}
	}
	obs, err := setupObservability(ctx, role, &f.obs)
	if err != nil {
		return err
	}
	defer obs.close()
	cfg.Metrics, cfg.TracerProvider, cfg.TimelineRooms, cfg.NoProbe = obs.reg, obs.tracer, timelineRooms(f.obs.timelineRooms), f.noProbe
	if cfg.DirectoryCheckInterval == 0 {
		cfg.DirectoryCheckInterval = -1 // the flag's 0 disables; the engine's 0 means its default
	}
	store, err := openMetadata(ctx, f.metadata, f.metadataTTL)
	if err != nil {
		return err
	}
	if store != nil {
		defer store.Close()
		cfg.Directory = store
	}
	// SGLang's heartbeat variables (the timeouts are flag defaults above).
	if err := sglangenv.Apply(os.Getenv, &cfg); err != nil {
		return err
	}
	m, err := engine.NewManager(ctx, cfg)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := obs.serve(f.obs.metricsAddr, m); err != nil {
		return err
	}
	out := &lineWriter{w: os.Stdout}
	ready := readyLine{Event: readyEvent, Role: role.String(), TPRank: layout.TPRank, PPRank: layout.PPRank, Endpoint: m.Endpoint(), Transports: m.TransportNames(), Instance: m.InstanceID(),
		Metrics: obs.addr()}
	if r := m.Ring(); r != nil {
		ready.Ring = "host"
		if r.RingMem().DevicePtr() != 0 {
			ready.Ring = "gpu"
		}
		slog.Info("metadata ring", "slots", r.Slots(), "where", ready.Ring, "device_ptr", fmt.Sprintf("%#x", r.RingMem().DevicePtr()))
	}
	out.write(ready)
	slog.Info("rank serving requests from stdin", "role", role, "control", m.Endpoint(), "model", layout.Model.Name,
		"pages", layout.NumPages, "item_len", layout.ItemLen(), "crc32c", engine.CRC32CPath())

	lines := make(chan inputLine)
	readErr := make(chan error, 1)
	go func() {
		readErr <- readRequests(os.Stdin, role, lines)
	}()
	var wg sync.WaitGroup
	var total, failed atomic.Int64
	var rerr error
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case rerr = <-readErr:
			break loop
		case in := <-lines:
			total.Add(1)
			wg.Add(1)
			// Prefix decisions are made here, in arrival order, so decode
			// ranks fed the same lines decide alike (workload.PrefixCache).
			var lease *workload.Lease
			if cache != nil && in.err == nil {
				lease = cache.Plan(in.q.Room, in.q.HashIDs, in.q.Tokens)
			}
			go func() {
				defer wg.Done()
				var r replyLine
				release := func() {}
				switch {
				case in.err != nil:
					r = replyLine{Error: fmt.Sprintf("line %d: %v", in.n, in.err)}
				case role == engine.RolePrefill:
					r = prefillOne(ctx, m, pool, rows, f, in.q)
				default:
					r, release = decodeOne(ctx, m, pool, rows, lease, f, in.q)
				}
				// The result goes out first; a failed room's pages come
				// back only once its producers are fenced.
				defer release()
				r.Role, r.TPRank, r.PPRank, r.Line = role.String(), layout.TPRank, layout.PPRank, in.n
				if in.hasRoom {
					r.Room = new(in.q.Room)
				}
				if !r.OK {
					if r.Error == "" {
						r.Error = "failed without a reason (report this as a bug)"
					}
					failed.Add(1)
				}
				out.write(r)
			}()
		}
	}
	wg.Wait()
	if rerr != nil {
		return fmt.Errorf("reading requests from stdin: %w", rerr)
	}
	if n := failed.Load(); n > 0 {
		return fmt.Errorf("%d of %d requests failed (see the error field of their result lines)", n, total.Load())
	}
	return nil
}

// inputLine is one non-blank stdin line: its 1-based number and either the
// parsed request or why it is not one (hasRoom: the room was read anyway).
type inputLine struct {
	n       int
	q       requestLine
	hasRoom bool
	err     error
}

// maxLineBytes bounds one request line; a longer line gets an error result
// and the rank reads on (issue 18).
const maxLineBytes = 1 << 20

// readRequests sends every non-blank line of r, parsed or not, to out; it
// returns at EOF (nil) or on a read error. A line longer than maxLineBytes
// is read to its end without being kept and sent as an error naming its
// length, so one bad line costs one failed result, not the rank.
func readRequests(r io.Reader, role engine.Role, out chan<- inputLine) error {
	br := bufio.NewReaderSize(r, 64<<10)
	n := 0
	for {
		line, size, err := readLine(br, maxLineBytes)
		if size == 0 && err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		n++
		if size > maxLineBytes {
			out <- inputLine{n: n, err: fmt.Errorf("line of %d bytes is longer than the limit of %d bytes (1 MiB): skipped (want one JSON request object per line)", size, maxLineBytes)}
		} else if text := strings.TrimSpace(string(line)); text != "" {
			q, hasRoom, perr := parseRequest(text, role)
			out <- inputLine{n: n, q: q, hasRoom: hasRoom, err: perr}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// readLine reads one line and returns it without its "\n" and its length in
// bytes; of a line longer than max it keeps only a prefix (the caller
// refuses it by size). err is the read error that ended the line (io.EOF
// for a last line without "\n").
func readLine(br *bufio.Reader, max int) (line []byte, size int, err error) {
	for {
		frag, e := br.ReadSlice('\n')
		size += len(frag)
		if len(line) <= max {
			line = append(line, frag...)
		}
		if errors.Is(e, bufio.ErrBufferFull) {
			continue
		}
		if e == nil { // the fragment ends with "\n"
			size--
			if size <= max {
				line = line[:size]
			}
		}
		return line, size, e
	}
}

// maxRoom is the largest bootstrap_room (rooms are 63-bit, engine.NewSender).
const maxRoom = 1<<63 - 1

// parseRequest decodes one request line. room (0 included) and tokens (>= 1)
// are required; "bootstrap" is a decode-only field; any other key is an
// error. hasRoom reports whether q.Room was read, even when err is set.
func parseRequest(text string, role engine.Role) (q requestLine, hasRoom bool, err error) {
	var raw struct {
		Room      json.RawMessage `json:"room"`
		Tokens    json.RawMessage `json:"tokens"`
		Bootstrap *string         `json:"bootstrap"`
		HashIDs   []int64         `json:"hash_ids"`
	}
	dec := json.NewDecoder(strings.NewReader(text))
	dec.DisallowUnknownFields()
	want := `{"room": N, "tokens": N}`
	if role == engine.RoleDecode {
		want = `{"room": N, "tokens": N, "bootstrap": "host:port" (optional)}`
	}
	if err := dec.Decode(&raw); err != nil {
		return q, false, fmt.Errorf("not a request object: %v (want %s)", err, want)
	}
	if dec.More() {
		return q, false, fmt.Errorf("text after the request object (one JSON object per line, want %s)", want)
	}
	if raw.Room == nil {
		return q, false, fmt.Errorf(`missing "room" (the request's bootstrap_room, 0 … 2^63-1; want %s)`, want)
	}
	room, err := strconv.ParseUint(string(raw.Room), 10, 64)
	if err != nil || room > maxRoom {
		return q, false, fmt.Errorf(`"room" %s: want an integer 0 … 2^63-1`, raw.Room)
	}
	q.Room, hasRoom = room, true
	if raw.Tokens == nil {
		return q, true, fmt.Errorf(`missing "tokens" (the prompt length, >= 1; want %s)`, want)
	}
	tokens, err := strconv.ParseInt(string(raw.Tokens), 10, 32)
	if err != nil || tokens < 1 {
		return q, true, fmt.Errorf(`"tokens" %s: want an integer 1 … 2147483647 (the prompt length)`, raw.Tokens)
	}
	q.Tokens = int(tokens)
	if raw.Bootstrap != nil {
		if role != engine.RoleDecode {
			return q, true, fmt.Errorf(`"bootstrap" is a decode request field; a prefill rank registers with its --bootstrap server`)
		}
		if *raw.Bootstrap == "" {
			return q, true, fmt.Errorf(`"bootstrap" is empty: want host:port, or leave the key out to use --bootstrap`)
		}
		q.Bootstrap = *raw.Bootstrap
	}
	if len(raw.HashIDs) > 1<<20 {
		return q, true, fmt.Errorf(`"hash_ids" has %d entries, more than %d`, len(raw.HashIDs), 1<<20)
	}
	q.HashIDs = raw.HashIDs
	return q, true, nil
}

type lineWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lineWriter) write(v any) {
	var b strings.Builder
	enc := json.NewEncoder(&b) // one line, "\n"-terminated
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	l.mu.Lock()
	defer l.mu.Unlock()
	_, _ = io.WriteString(l.w, b.String())
}

// readyLine is the first stdout line of a rank: {"event":"ready", ...}
// with no room key, so it cannot be taken for a request's result.
type readyLine struct {
	Event      string   `json:"event"`
	Role       string   `json:"role"`
	TPRank     int      `json:"tp_rank"`
	PPRank     int      `json:"pp_rank"`
	Endpoint   string   `json:"endpoint"`
	Transports []string `json:"transports"`
	Ring       string   `json:"ring,omitempty"`
	// Instance is the rank's instance id (published in a prefill's
	// directory entry).
	Instance string `json:"instance"`
	// Metrics is the bound --metrics-addr ("" when off).
	Metrics string `json:"metrics,omitempty"`
}

// allocWait allocates n items from a (KV pages or aux rows; what names them
// in errors), waiting up to limit for finished requests to free some
// (PageAllocator.AllocWait).
func allocWait(ctx context.Context, a *workload.PageAllocator, what string, n int, limit time.Duration) ([]int32, error) {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	p, err := a.AllocWait(wctx, n)
	switch {
	case err == nil:
		return p, nil
	case errors.Is(err, workload.ErrPoolTooSmall) && what == "pages":
		return nil, fmt.Errorf("request needs %d pages, the KV buffers hold %d (raise --pool-mb)", n, a.Capacity())
	case errors.Is(err, workload.ErrPoolTooSmall):
		return nil, fmt.Errorf("request needs %d %s, there are %d", n, what, a.Capacity())
	case ctx.Err() != nil:
		return nil, ctx.Err()
	}
	return nil, fmt.Errorf("%s: %w", what, err)
}

func prefillOne(ctx context.Context, m *engine.Manager, pool *workload.KVBuffers, rows *workload.PageAllocator, f *roleFlags, q requestLine) replyLine {
	n := m.PagesForTokens(q.Tokens)
	fail := func(err error) replyLine { return replyLine{Error: err.Error(), Pages: n} }
	s, err := m.NewSender(q.Room)
	if err != nil {
		return fail(err)
	}
	defer s.Close()
	// A failure here (no pages, a bad token count) reaches the decode with
	// its reason, now or when its TRANSFER arrives.
	fail = func(err error) replyLine {
		s.AbortWith(err)
		return replyLine{Error: err.Error(), Pages: n}
	}
	if err := s.SetTokens(q.Tokens); err != nil {
		return fail(err)
	}
	// The prefill computes the whole prompt's KV (here: the test pattern)
	// and its aux row while the decode resolves; only the pages after the
	// decode's prefix are sent.
	src, err := allocWait(ctx, pool.PageAllocator, "pages", n, f.waitingTimeout)
	if err != nil {
		return fail(err)
	}
	defer pool.Free(src)
	aux, err := allocWait(ctx, rows, "aux rows", 1, f.waitingTimeout)
	if err != nil {
		return fail(err)
	}
	defer rows.Free(aux)
	var r replyLine
	if f.fill {
		t := time.Now()
		if err := workload.FillPattern(pool, q.Room, src, 0); err != nil {
			return fail(err)
		}
		if err := workload.FillAux(pool, q.Room, int(aux[0])); err != nil {
			return fail(err)
		}
		r.FillUS = time.Since(t).Microseconds()
	}
	wctx, cancel := context.WithTimeout(ctx, f.bootstrapTimeout+time.Second)
	st := s.Wait(wctx, engine.KVWaitingForInput)
	cancel()
	if st != engine.KVWaitingForInput {
		if err := s.Failure(); err != nil {
			return fail(err)
		}
		return fail(unfinished(ctx, q.Room, "sender", st, " after the bootstrap timeout"))
	}
	if !s.HasRealDst() {
		// A dummy rank (MLA with prefill TP > decode TP): nothing to send.
		r.Dummy = true
		src = src[:0]
	} else {
		send, err := s.InitTokens(q.Tokens, int(aux[0]))
		if err != nil {
			return fail(err)
		}
		src = src[len(src)-send:]
	}
	t0 := time.Now()
	chunk := f.chunkPages
	if chunk <= 0 {
		chunk = len(src) + 1
	}
	for i := 0; ; i += chunk {
		end := min(i+chunk, len(src))
		if err := s.Send(src[i:end], end == len(src)); err != nil {
			return fail(err)
		}
		if end == len(src) {
			break
		}
	}
	// Success needs the decode's verdict; the engine bounds that wait by
	// the waiting timeout, this bound is only a backstop.
	wctx, cancel = context.WithTimeout(ctx, 2*f.waitingTimeout+5*time.Second)
	st = s.Wait(wctx, engine.KVSuccess)
	cancel()
	t1 := time.Now()
	r.TransferUS = t1.Sub(t0).Microseconds()
	r.StartUnixNS, r.EndUnixNS = t0.UnixNano(), t1.UnixNano()
	if st != engine.KVSuccess {
		if err := s.Failure(); err != nil {
			return fail(err)
		}
		return fail(unfinished(ctx, q.Room, "sender", st, " after twice the waiting timeout"))
	}
	mt := s.TransferMetric()
	r.OK, r.Pages, r.Transports, r.Bytes = true, len(src), s.TransportNames(), mt.Bytes
	r.PrefixTokens, r.SkippedBytes, r.AuxBytes, r.Writes = mt.PrefixTokens, mt.SkippedBytes, mt.AuxBytes, mt.Writes
	return r
}

// decodeOne receives one request. With a prefix cache lease it asks only
// for the pages after the held prefix and, once Success, waits for the
// prefix blocks' own requests so the whole prompt is verified. It returns the
// result line and release, which closes the receiver and frees the
// destination pages and aux row: for a failed room that waits until every
// producer is fenced (engine.Receiver.Close), so the caller prints the result
// first.
func decodeOne(ctx context.Context, m *engine.Manager, pool *workload.KVBuffers, rows *workload.PageAllocator, lease *workload.Lease, f *roleFlags, q requestLine) (out replyLine, release func()) {
	n := m.PagesForTokens(q.Tokens)
	var frees []func() // run in reverse order by release
	release = func() {
		for i := len(frees) - 1; i >= 0; i-- {
			frees[i]()
		}
	}
	fail := func(err error) (replyLine, func()) { return replyLine{Error: err.Error(), Pages: n}, release }
	addr := q.Bootstrap
	if addr == "" {
		addr = f.bootstrap
	}
	alloc := func(k int) ([]int32, error) { return allocWait(ctx, pool.PageAllocator, "pages", k, f.waitingTimeout) }
	var pages []int32
	var err error
	prefix := 0
	if lease != nil {
		frees = append(frees, func() { lease.Finish(out.OK) })
		prefix = lease.PrefixTokens
		pages, err = lease.Pages(ctx, alloc)
	} else {
		pages, err = alloc(n)
		if err == nil {
			frees = append(frees, func() { pool.Free(pages) })
		}
	}
	if err != nil {
		return fail(err)
	}
	held := prefix / m.PageSize()
	aux, err := allocWait(ctx, rows, "aux rows", 1, f.waitingTimeout)
	if err != nil {
		return fail(err)
	}
	frees = append(frees, func() { rows.Free(aux) })
	r, err := m.NewReceiver(addr, q.Room)
	if err != nil {
		return fail(err)
	}
	frees = append(frees, r.Close)
	if f.verify {
		defer verifyTimes.Delete(q.Room)
	}
	t0 := time.Now()
	if err := r.SetTokens(q.Tokens); err != nil {
		return fail(err)
	}
	if err := r.SendMetadata(pages[held:], int(aux[0]), nil, prefix); err != nil {
		return fail(err)
	}
	wctx, cancel := context.WithTimeout(ctx, f.bootstrapTimeout+f.waitingTimeout)
	st := r.Wait(wctx, engine.KVSuccess)
	cancel()
	out = replyLine{Pages: n, TransferUS: time.Since(t0).Microseconds()}
	if st != engine.KVSuccess {
		if err := r.Failure(); err != nil {
			return fail(err)
		}
		return fail(unfinished(ctx, q.Room, "receiver", st, ""))
	}
	mt := r.TransferMetric()
	out.Bytes, out.AuxBytes, out.PrefixTokens, out.SkippedBytes = mt.Bytes, mt.AuxBytes, mt.PrefixTokens, mt.SkippedBytes
	// The held prefix is usable once the requests that receive it are done
	// (it may have been counted while in flight).
	var segs []workload.PrefixSegment
	if lease != nil {
		wctx, cancel := context.WithTimeout(ctx, f.waitingTimeout)
		segs, err = lease.WaitPrefix(wctx)
		cancel()
		if err != nil {
			return fail(err)
		}
	}
	if f.verify {
		// This room's pages and aux row were checked inside the engine,
		// before the verdict (so a failure fails the prefill too); the
		// held prefix blocks carry their own requests' pattern at the same
		// token positions and are checked here.
		t := time.Now()
		for _, sg := range segs {
			if err := workload.VerifyPattern(pool, sg.Room, sg.Pages, sg.FirstPage); err != nil {
				return fail(fmt.Errorf("held prefix block: %w", err))
			}
		}
		out.VerifyUS = verifyUS(q.Room) + time.Since(t).Microseconds()
	}
	if f.hold > 0 {
		select {
		case <-ctx.Done():
		case <-time.After(f.hold):
		}
	}
	if f.digest {
		if out.Digest, err = pool.Digest(pages[held:]); err != nil {
			return fail(err)
		}
	}
	out.OK = true
	return out, release
}

// verifyTimes holds how long --verify took per room (the check runs inside
// the engine, before the decode's verdict, so that a room that fails it
// fails on the prefill too).
var verifyTimes sync.Map

// verifyKV is the engine's VerifyKV hook for --verify: the test pattern of
// the room's pages (after its prefix) and of its aux row.
func verifyKV(pool *workload.KVBuffers, pageSize int) func(engine.ReceivedKV) error {
	return func(kv engine.ReceivedKV) error {
		t := time.Now()
		defer func() { verifyTimes.Store(kv.Room, time.Since(t).Microseconds()) }()
		if err := workload.VerifyPattern(pool, kv.Room, kv.Pages, kv.PrefixTokens/pageSize); err != nil {
			return err
		}
		if kv.AuxIndex >= 0 {
			return workload.VerifyAux(pool, kv.Room, kv.AuxIndex)
		}
		return nil
	}
}

// verifyUS returns (and forgets) how long --verify took for room, µs.
func verifyUS(room uint64) int64 {
	if v, ok := verifyTimes.LoadAndDelete(room); ok {
		return v.(int64)
	}
	return 0
}

// parseDevice parses --device (engine.ParseLocation): host memory gives
// dev -1, "cuda:N" gives N and onDevice.
func parseDevice(s string) (dev int, onDevice bool, err error) {
	kind, d, err := engine.ParseLocation(s)
	if err != nil {
		return 0, false, fmt.Errorf("--device: %w", err)
	}
	if kind != engine.MemoryCUDA {
		return -1, false, nil
	}
	return d, true, nil
}

// deviceTransports keeps the transports that can register device memory
// (engine.CapDeviceMemory) and closes the rest. With an explicit --transport
// list every named transport must qualify; with auto at least one must.
func deviceTransports(ts []engine.Transport, spec, device string) ([]engine.Transport, error) {
	var keep, drop []engine.Transport
	var names []string
	for _, t := range ts {
		if t.Capabilities().Has(engine.CapDeviceMemory) {
			keep = append(keep, t)
			continue
		}
		drop = append(drop, t)
		names = append(names, t.Name())
	}
	if len(keep) == 0 || (len(drop) > 0 && spec != "" && spec != "auto") {
		closeAll(ts)
		return nil, fmt.Errorf("--device %s: transport(s) %s cannot move device memory; use --transport tcp (bounce through pinned memory) or rdma (GPUDirect), or drop --device",
			device, strings.Join(names, ","))
	}
	closeAll(drop)
	if len(drop) > 0 {
		slog.Info("transports without device-memory support are not used with --device", "device", device, "dropped", names)
	}
	return keep, nil
}

// unfinished is the result of a room whose wait ended with no engine
// failure: the rank shutting down (ctx cancelled by SIGINT/SIGTERM) says so,
// anything else names the state the room was left in and the bound hit.
func unfinished(ctx context.Context, room uint64, who string, st engine.KVPoll, bound string) error {
	if ctx.Err() != nil {
		return fmt.Errorf("room %d: aborted: the rank is shutting down (%v) while the %s was %s", room, context.Cause(ctx), who, st)
	}
	return fmt.Errorf("room %d: %s still %s%s", room, who, st, bound)
}
