package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"reflect"
	"slices"
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
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/cluster"
	"github.com/kvxfer/kvxfer/internal/hostmem"
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
	controlPort      int
	kvDtype          string
	bootstrapTimeout time.Duration
	waitingTimeout   time.Duration
	peerTimeout      time.Duration
	progressInterval time.Duration
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
	controlAuth      string
	maxPeers         int
	dirCheck         time.Duration
	advertiseHost    string
	metadata         string
	metadataTTL      time.Duration
	fragmentSeed     uint64
	obs              obsFlags
	noProbe          bool
	allocPolicy      string
	specLayout       string
	httpPort         int
	serve            string
	drainTimeout     time.Duration
	exitAfterLayers  int
	stallAfterLayers int
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
		fs.IntVar(&f.exitAfterLayers, "inject-exit-after-layers", 0, "fault injection (tests): in a layer-wise room, once N layer-wise calls have landed, kill this process (SIGKILL)")
		fs.IntVar(&f.stallAfterLayers, "inject-stall-after-layers", 0, "fault injection (tests): in a layer-wise room, once N layer-wise calls have landed, send nothing more (a stalled forward pass)")
		_ = fs.MarkHidden("inject-exit-after-layers")
		_ = fs.MarkHidden("inject-stall-after-layers")
		fs.BoolVar(&f.fill, "fill", true, "fill each request's source pages with the (room, layer, token, head) test pattern before sending")
		fs.IntVar(&f.httpPort, "prefill-http-port", 0, "the serving engine's HTTP API port (SGLang's --port) this rank declares as prefill_http_port; an SGLang decode's PD rebootstrap POSTs /generate there; 0 = none")
		fs.StringVar(&f.specLayout, "dsv41-spec-layout", "", "DeepSeek-V4.1 DSpark KV layout this rank declares (SGLang's get_dsv41_spec_layout): a JSON object, or @FILE holding one; empty = none")
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
	fs.StringVar(&f.allocPolicy, "decode-allocation-policy", bootstrap.PolicyEarly,
		"SGLang's --disaggregation-decode-allocation-policy: "+bootstrap.PolicyEarly+" or "+bootstrap.PolicyPrefillComplete+
			"; a prefill declares it in its registration and, under "+bootstrap.PolicyPrefillComplete+", reports each request computed before its decode reserves pages; a decode under "+
			bootstrap.PolicyPrefillComplete+" takes a request's pages only then (and refuses a prefill declaring "+bootstrap.PolicyEarly+")")
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
	fs.StringVar(&f.transport, "transport", "auto", "data transports to open: auto (every usable one) or a comma list (tcp, shm, cma, rdma)")
	if role == engine.RolePrefill {
		fs.StringVar(&f.authToken, "bootstrap-auth-token", "", tokenFlagHelp)
	} else {
		fs.StringVar(&f.authToken, "bootstrap-auth-token", "", tokenFlagHelp+
			"; a decode sends it on the same routes, which SGLang's protocol has it call none of today, so one environment can configure every rank")
	}
	fs.StringVar(&f.controlAuth, "control-auth", controlAuthDefault(os.Getenv), "tag every control frame with an HMAC keyed by the --bootstrap-auth-token and drop frames without a valid tag, so nobody without the token can inject control frames; every prefill and decode rank of the deployment needs it and the same token. auto (the default): on exactly when a bootstrap token is set; --control-auth alone is true, --control-auth=false turns it off (env KVXFER_CONTROL_AUTH=1 or 0)")
	fs.Lookup("control-auth").NoOptDefVal = "true"
	fs.IntVar(&f.maxPeers, "max-peers", envMaxPeers(), "control peers this rank keeps a socket and state for; beyond it the least recently used idle one is closed, and with none idle a new peer is refused naming the limit (env KVXFER_MAX_PEERS)")
	fs.StringVar(&f.host, "host", "127.0.0.1", "address the control (ZMQ) and data listeners bind: an IPv4 or IPv6 address, a hostname, or 0.0.0.0 / :: for every interface (then the address of the default-route interface is advertised unless --advertise-host says otherwise)")
	fs.IntVar(&f.controlPort, "control-port", 0, "TCP port the control (ZMQ) socket binds on --host: 0 (the default) picks a free one, named in the ready line's endpoint; a fixed port lets a restarted rank come back at the same control address (a port in use is refused at start)")
	fs.StringVar(&f.advertiseHost, "advertise-host", envOr("KVXFER_ADVERTISE_HOST", ""), "address peers are told to connect to (this rank's rank_ip and endpoints), when it differs from --host, e.g. behind NAT or with a wildcard --host (env KVXFER_ADVERTISE_HOST)")
	fs.StringVar(&f.kvDtype, "kv-cache-dtype", "auto", "KV cache element type, as SGLang's --kv-cache-dtype: "+strings.Join(workload.KVCacheDtypes, ", ")+
		" (auto = the model's torch_dtype; fp8 = 1 byte per element); prefill and decode must pass the same string")
	boot, _ := sglangenv.Seconds(os.Getenv, sglangenv.BootstrapTimeout, engine.DefaultBootstrapTimeout)
	wait, _ := sglangenv.Seconds(os.Getenv, sglangenv.WaitingTimeout, engine.DefaultWaitingTimeout)
	fs.DurationVar(&f.bootstrapTimeout, "bootstrap-timeout", boot, "bootstrap timeout (env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, seconds)")
	fs.DurationVar(&f.waitingTimeout, "waiting-timeout", wait, "waiting timeout (env SGLANG_DISAGGREGATION_WAITING_TIMEOUT, seconds)")
	fs.DurationVar(&f.peerTimeout, "peer-timeout", engine.DefaultPeerTimeout, "fail a request when its peer is silent this long")
	fs.DurationVar(&f.progressInterval, "progress-interval", engine.DefaultProgressInterval, "decode: log a \"room waiting\" line this often for each room that waits on its prefill ranks (which answered, which not); 0 or negative: never")
	fs.StringVar(&f.serve, "serve", envOr("KVXFER_SERVE", ""), "where request lines come from: empty = stdin (JSON lines; the rank stops at its end); "+
		"unix:PATH = connections to a unix socket (each gets the ready line, then one result line per request line it sends); "+
		"http://HOST:PORT = POST /v1/requests (request lines in, result lines out as NDJSON) and GET /v1/ready; for a long-lived rank with no stdin (systemd, containers; env KVXFER_SERVE)")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", DefaultDrainTimeout, "after SIGTERM or SIGINT the rank reads no new request (lines already sent get a refusal result) and gives the rooms in flight this long to finish before it cancels them (failed on both sides, naming this flag); a second signal cancels them at once. At stdin's end the rooms in flight get this long too")
	addMetadataFlags(fs, &f.metadata, &f.metadataTTL)
	addObsFlags(fs, &f.obs)
}

// openTransports opens the transports spec names (transport.OpenTransports:
// "auto" = every registered one whose probe passes) listening on host and
// advertising advertise, with the environment's options
// (envTransportOptions).
func openTransports(spec, host, advertise string) ([]transport.Transport, error) {
	opts, err := envTransportOptions()
	if err != nil {
		return nil, err
	}
	opts.ListenHost = strings.Trim(host, "[]")
	opts.AdvertiseHost = advertise
	ts, err := transport.OpenTransports(spec, opts)
	if err != nil {
		return nil, fmt.Errorf("--transport: %w", err)
	}
	return ts, nil
}

// shmStreamMinEnv sets transport.SHMOptions.StreamMinBytes of every shm
// transport kvxfer opens: a byte count, or "off" (also 0) for no
// non-temporal stores; unset, the default (1 MiB).
const shmStreamMinEnv = "KVXFER_SHM_STREAM_MIN"

// envTransportOptions is transport.DefaultOptions with what the
// environment sets for the transports (shmStreamMinEnv); the error names
// the variable, its value and what it takes.
func envTransportOptions() (transport.Options, error) {
	opts := transport.DefaultOptions()
	n, err := transport.ParseSHMStreamMin(os.Getenv(shmStreamMinEnv))
	if err != nil {
		return opts, fmt.Errorf("env %s=%w; unset it for the default (1 MiB)", shmStreamMinEnv, err)
	}
	opts.SHM.StreamMinBytes = n
	return opts, nil
}

// openEnvTransport opens transport name with envTransportOptions.
func openEnvTransport(name string) (transport.Transport, error) {
	opts, err := envTransportOptions()
	if err != nil {
		return nil, err
	}
	return transport.OpenTransport(name, opts)
}

// checkTransportNames refuses a name in list (a comma-separated flag value)
// that is no transport of this binary, naming the flag and the valid
// names; an empty list is refused too. It returns the names.
func checkTransportNames(flag, list string) ([]string, error) {
	var names []string
	for _, t := range strings.Split(list, ",") {
		t = strings.TrimSpace(t)
		if t == "" {
			continue
		}
		if !slices.Contains(transport.Transports(), t) {
			return nil, fmt.Errorf("%s %q: %q is not a transport; want a comma-separated list of %s", flag, list, t, strings.Join(transport.Transports(), ", "))
		}
		names = append(names, t)
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("%s %q: names no transport; want a comma-separated list of %s", flag, list, strings.Join(transport.Transports(), ", "))
	}
	return names, nil
}

func closeAll(ts []transport.Transport) {
	for _, t := range ts {
		_ = t.Close()
	}
}

// validateRoleFlags checks the flags runRole cannot take as given; each
// error names the flag, the bad value and what is accepted.
// envMaxPeers is --max-peers' default: KVXFER_MAX_PEERS, else
// engine.DefaultMaxPeers; a value that is not a number is -1, which
// validateRoleFlags refuses naming the variable.
func envMaxPeers() int {
	v := os.Getenv("KVXFER_MAX_PEERS")
	if v == "" {
		return engine.DefaultMaxPeers
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return -1
	}
	return n
}

func validateRoleFlags(f *roleFlags) error {
	if f.maxPeers < 0 || f.maxPeers > 1<<20 {
		return fmt.Errorf("--max-peers %d (or env KVXFER_MAX_PEERS=%q): want 1 … 1048576 control peers (0: the default, %d)", f.maxPeers, os.Getenv("KVXFER_MAX_PEERS"), engine.DefaultMaxPeers)
	}
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
	case f.drainTimeout <= 0:
		return fmt.Errorf("--drain-timeout %s: must be > 0 (how long the rooms in flight at SIGTERM get to finish)", f.drainTimeout)
	case !validControlAuth(f.controlAuth):
		return fmt.Errorf("--control-auth %q: want auto (on when a bootstrap token is set), true or false (env KVXFER_CONTROL_AUTH: 1 or 0)", f.controlAuth)
	case f.dirCheck < 0:
		return fmt.Errorf("--directory-check-interval %s: must be >= 0 (0 disables the check)", f.dirCheck)
	case f.auxRows < 1 || f.auxRows > 1<<20:
		return fmt.Errorf("--aux-rows %d: must be 1 … 2^20", f.auxRows)
	case f.prefixBlocks < 0:
		return fmt.Errorf("--prefix-cache-blocks %d: must be >= 0 (0 = off)", f.prefixBlocks)
	case f.prefixBlocks > 0 && (f.blockTokens < 1 || f.blockTokens%f.pageSize != 0):
		return fmt.Errorf("--prefix-block-tokens %d: must be a whole number of --page-size %d pages", f.blockTokens, f.pageSize)
	}
	if _, err := parseServe(f.serve); err != nil {
		return err
	}
	if f.bootstrap != "" {
		// At start, not at the first request: a decode would otherwise run
		// and fail every room that uses its --bootstrap.
		if _, err := bootstrap.NewClient(f.bootstrap); err != nil {
			return fmt.Errorf("--bootstrap: %w", err)
		}
	}
	if f.advertiseHost != "" {
		if _, err := bootstrap.ValidateHost(f.advertiseHost); err != nil {
			return fmt.Errorf("--advertise-host (or KVXFER_ADVERTISE_HOST) %q: %v", f.advertiseHost, err)
		}
	}
	if _, err := workload.KVCacheDtypeBytes(f.kvDtype); err != nil {
		return fmt.Errorf("--kv-cache-dtype %q: want one of %s", f.kvDtype, strings.Join(workload.KVCacheDtypes, ", "))
	}
	switch f.allocPolicy {
	case "", bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete:
	default:
		return fmt.Errorf("--decode-allocation-policy %q: want %s or %s (SGLang's --disaggregation-decode-allocation-policy values)", f.allocPolicy, bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete)
	}
	if _, err := f.layout(); err != nil {
		return err
	}
	if f.controlPort < 0 || f.controlPort > 65535 {
		return fmt.Errorf("--control-port %d: want a TCP port 1–65535, or 0 to pick a free one", f.controlPort)
	}
	if f.httpPort < 0 || f.httpPort > 65535 {
		return fmt.Errorf("--prefill-http-port %d: want the serving engine's HTTP port, 1–65535, or 0 for none", f.httpPort)
	}
	return nil
}

// layout reads --dsv41-spec-layout (inline JSON or @FILE) in canonical form;
// nil when none is given.
func (f *roleFlags) layout() ([]byte, error) {
	v := strings.TrimSpace(f.specLayout)
	if v == "" {
		return nil, nil
	}
	src := "the value"
	b := []byte(v)
	if name, ok := strings.CutPrefix(v, "@"); ok {
		var err error
		if b, err = os.ReadFile(name); err != nil {
			return nil, fmt.Errorf("--dsv41-spec-layout: %w", err)
		}
		src = name
	}
	l, err := bootstrap.CanonicalSpecLayout(b)
	if err != nil {
		return nil, fmt.Errorf("--dsv41-spec-layout (%s): %v", src, err)
	}
	return l, nil
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
	// Layerwise (prefill) sends the room layer by layer as a modeled
	// forward pass computes it; LayerComputeUS (prefill) is that pass's
	// compute time per layer over the whole prompt, µs (0: none). Without
	// either the pages are sent whole after they are filled.
	Layerwise      bool  `json:"layerwise,omitempty"`
	LayerComputeUS int64 `json:"layer_compute_us,omitempty"`
	// PatternRoom (prefill) is the room whose test pattern the prefill
	// fills the request's pages with (--fill) instead of Room's: kvxfer
	// chaos gives the two attempts of a room it retries with the same
	// bootstrap_room different bytes, so a stale write of the first attempt
	// in the retry's pages shows.
	PatternRoom *uint64 `json:"pattern_room,omitempty"`
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
	Line     int    `json:"line,omitempty"`
	Endpoint string `json:"endpoint,omitempty"`
	// Metrics (ready line) is the rank's bound --metrics-addr.
	Metrics string `json:"metrics,omitempty"`
	// Instance (ready line) is the rank's instance id.
	Instance string `json:"instance,omitempty"`
	// Serve (ready line) is where the rank takes requests with --serve:
	// "unix:PATH" or "http://HOST:PORT" as bound; absent when it reads stdin.
	Serve string `json:"serve,omitempty"`
	// Ring (decode's ready line) is where the metadata ring lives: "gpu"
	// (pinned and mapped, a kernel can read it) or "host".
	Ring   string `json:"ring,omitempty"`
	Role   string `json:"role"`
	TPRank int    `json:"tp_rank"`
	PPRank int    `json:"pp_rank"`
	// Room is the request's bootstrap_room; absent on the ready line and on
	// results for lines whose room could not be read.
	Room *uint64 `json:"room,omitempty"`
	// Verified (decode results only; absent on prefill lines and the
	// ready line) is true when the room succeeded and every byte of it was
	// checked against the prefill's test pattern (--verify), false when it
	// was not checked (no --verify) or the room failed.
	Verified *bool `json:"verified,omitempty"`
	// Result is the room's outcome (ok, error, pages, bytes, timings); its
	// Transports also carries the ready line's transports.
	cluster.Result
}

// runRole runs a prefill or decode rank: it starts it (a stop signal during
// start-up cancels that), then serves request lines from stdin or --serve
// until stdin's end or a stop signal, and drains: every request line read
// gets its result line (serve.go).
func runRole(role engine.Role, f *roleFlags) error {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	r, closeRank, err := startRank(ctx, role, f)
	interrupted := context.Cause(ctx)
	stop() // a signal from now on drains (sigs still holds one that came during start-up)
	if err != nil {
		if interrupted != nil {
			// What failed is only the signal's doing (a registration
			// "deadline exceeded", an allocation stopped): say so, and exit
			// as interrupted (main: status 130).
			return fmt.Errorf("%s rank stopped during start-up by a stop signal (%v), before it served any request: %w", role, interrupted, context.Canceled)
		}
		return err
	}
	defer closeRank()
	switch ln := r.serveLn.(type) {
	case *net.UnixListener:
		r.ready.Serve = "unix:" + ln.Addr().String()
		return r.serveUnix(ln, sigs)
	case net.Listener:
		r.ready.Serve = "http://" + ln.Addr().String()
		return r.serveHTTP(ln, sigs)
	}
	return r.serveStdin(sigs)
}

// listenServe binds --serve's listener (nil for stdin): a *net.UnixListener
// for unix:PATH, a TCP listener for http://HOST:PORT.
func listenServe(serve string) (net.Listener, error) {
	spec, err := parseServe(serve)
	if err != nil {
		return nil, err
	}
	switch {
	case spec.unix != "":
		return listenUnix(spec.unix)
	case spec.http != "":
		ln, err := net.Listen("tcp", spec.http)
		if err != nil {
			return nil, fmt.Errorf("--serve http://%s: %w (is the port in use? port 0 picks a free one)", spec.http, err)
		}
		return ln, nil
	}
	return nil, nil
}

// lateRooms is the debug server's room source while the manager is not
// started yet (no timelines), then the manager: the server binds
// --metrics-addr before the rank registers with the bootstrap directory.
type lateRooms struct {
	m atomic.Pointer[engine.Manager]
}

// RoomTimeline is the manager's, or none before it started.
func (l *lateRooms) RoomTimeline(room uint64) (engine.RoomTimeline, bool) {
	if m := l.m.Load(); m != nil {
		return m.RoomTimeline(room)
	}
	return engine.RoomTimeline{}, false
}

// RoomTimelines is the manager's, or none before it started.
func (l *lateRooms) RoomTimelines(failedOnly bool, limit int) []engine.RoomTimeline {
	if m := l.m.Load(); m != nil {
		return m.RoomTimelines(failedOnly, limit)
	}
	return nil
}

// startRank validates the flags, binds the rank's listeners (--serve,
// --metrics-addr), allocates the rank's KV pool, opens its transports and
// starts its manager (and tracing, metadata), which registers the rank with
// the bootstrap directory: whatever can fail at start fails before that, so a
// rank that cannot start never replaces a live rank's directory entry. The
// returned close undoes it all, in reverse order.
func startRank(ctx context.Context, role engine.Role, f *roleFlags) (_ *rank, _ func(), err error) {
	var closers []func()
	closeAllOf := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeAllOf()
		}
	}()
	if err := validateParallelFlags(role, f); err != nil {
		return nil, nil, err
	}
	layout, dev, onDevice, err := roleInputs(f)
	if err != nil {
		return nil, nil, err
	}
	serveLn, err := listenServe(f.serve)
	if err != nil {
		return nil, nil, err
	}
	if serveLn != nil {
		closers = append(closers, func() { _ = serveLn.Close() })
	}
	obs, err := setupObservability(ctx, role, &f.obs)
	if err != nil {
		return nil, nil, err
	}
	closers = append(closers, obs.close)
	rooms := &lateRooms{}
	if err := obs.serve(f.obs.metricsAddr, rooms); err != nil {
		return nil, nil, err
	}
	// The rank's KV memory, laid out as a serving engine lays it out: one
	// buffer per layer for K and for V (or per layer for MLA), plus SGLang's
	// aux (metadata) buffers; the KV manager only registers them.
	// ctx ends at a stop signal: the allocation (a prefaulted pool of GiBs
	// takes seconds) stops at the next buffer instead of running to its end.
	pool, err := workload.NewKVBuffers(layout, workload.BufferOptions{Name: role.String() + "-kv", Device: dev, Aux: workload.DefaultAux, AuxRows: f.auxRows, Prefault: f.prefault, Stop: ctx.Done()})
	if err != nil {
		if errors.Is(err, workload.ErrAllocStopped) {
			return nil, nil, err
		}
		// Past the host-memory pre-check (an address-space limit, a
		// memory cgroup): name what sizes the pool.
		return nil, nil, fmt.Errorf("%w; %s: use a smaller --pool-mb", err, poolWhat(f))
	}
	closers = append(closers, func() { _ = pool.Close() })
	if f.fragmentSeed != 0 {
		pool.Fragment(f.fragmentSeed)
	}
	r := &rank{role: role, serveLn: serveLn, pool: pool, layout: layout, rows: workload.NewPageAllocator(f.auxRows), drainTimeout: f.drainTimeout}
	r.inflightZero = sync.NewCond(&r.inflightMu)
	r.roomCtx, r.cancelRooms = context.WithCancelCause(context.Background())
	closers = append(closers, func() { r.cancelRooms(errors.New("rank closed")) })
	if role == engine.RoleDecode && f.prefixBlocks > 0 {
		if r.cache, err = workload.NewPrefixCache(pool.PageAllocator, f.pageSize, f.blockTokens, f.prefixBlocks); err != nil {
			return nil, nil, err
		}
	}
	ts, err := rankTransports(f, onDevice)
	if err != nil {
		return nil, nil, err
	}
	closers = append(closers, func() { closeAll(ts) })
	cfg := r.managerConfig(f, ts, dev, onDevice)
	cfg.Metrics, cfg.TracerProvider, cfg.TimelineRooms, cfg.NoProbe = obs.reg, obs.tracer, timelineRooms(f.obs.timelineRooms), f.noProbe
	if cfg.DirectoryCheckInterval == 0 {
		cfg.DirectoryCheckInterval = -1 // the flag's 0 disables; the engine's 0 means its default
	}
	cfg.DecodeAllocationPolicy = f.allocPolicy
	if role == engine.RolePrefill {
		cfg.PrefillHTTPPort = f.httpPort
		if cfg.DSV41SpecLayout, err = f.layout(); err != nil {
			return nil, nil, err
		}
	}
	store, err := openMetadata(ctx, f.metadata, f.metadataTTL)
	if err != nil {
		return nil, nil, err
	}
	if store != nil {
		closers = append(closers, func() { _ = store.Close() })
		cfg.Directory = store
	}
	// SGLang's heartbeat variables (the timeouts are flag defaults above).
	if err := sglangenv.Apply(os.Getenv, &cfg); err != nil {
		return nil, nil, err
	}
	m, err := engine.NewManager(ctx, cfg)
	if err != nil {
		if f.controlPort != 0 && errors.Is(err, engine.ErrControlBind) {
			return nil, nil, fmt.Errorf("--control-port %d: %w; give another port, or 0 (the default) to pick a free one", f.controlPort, err)
		}
		return nil, nil, err
	}
	closers = append(closers, func() { _ = m.Close() })
	r.m = m
	rooms.m.Store(m)
	r.ready = readyLine{Event: readyEvent, Role: role.String(), TPRank: layout.TPRank, PPRank: layout.PPRank, Endpoint: m.Endpoint(), Transports: m.TransportNames(), Instance: m.InstanceID(),
		Metrics: obs.addr()}
	if ring := m.Ring(); ring != nil {
		r.ready.Ring = "host"
		if ring.RingMem().DevicePtr() != 0 {
			r.ready.Ring = "gpu"
		}
		slog.Info("metadata ring", "slots", ring.Slots(), "where", r.ready.Ring, "device_ptr", fmt.Sprintf("%#x", ring.RingMem().DevicePtr()))
	}
	return r, closeAllOf, nil
}

// validateParallelFlags checks the rank's place in its instance: --tp-size
// and --pp-size (and a prefill's --dp-size) at least 1, each rank in [0,
// size). A size of 0 would otherwise be taken as 1 without a word (and a
// rank out of range fail later, at the layout or at the directory, without
// naming the flag).
func validateParallelFlags(role engine.Role, f *roleFlags) error {
	type dim struct {
		name       string
		size, rank int
	}
	dims := []dim{{"tp", f.tpSize, f.tpRank}, {"pp", f.ppSize, f.ppRank}}
	if role == engine.RolePrefill {
		dims = append(dims, dim{"dp", f.dpSize, f.dpRank})
	}
	for _, d := range dims {
		switch {
		case d.size < 1:
			return fmt.Errorf("--%s-size %d: must be >= 1 (1 = no %s parallelism)", d.name, d.size, strings.ToUpper(d.name))
		case d.rank < 0 || d.rank >= d.size:
			return fmt.Errorf("--%s-rank %d: must be in [0, --%s-size %d)", d.name, d.rank, d.name, d.size)
		}
	}
	return nil
}

// roleInputs checks the role's flags and environment and returns the
// rank's layout and where its KV pool lives (dev -1: host memory).
func roleInputs(f *roleFlags) (layout *workload.Layout, dev int, onDevice bool, err error) {
	for _, env := range []string{sglangenv.BootstrapTimeout, sglangenv.WaitingTimeout} {
		if _, err := sglangenv.Seconds(os.Getenv, env, 0); err != nil {
			return nil, 0, false, err
		}
	}
	if err := validateRoleFlags(f); err != nil {
		return nil, 0, false, err
	}
	// The transport names and their environment, before the pool: a
	// prefaulted pool of GiBs takes seconds (tens under load) to allocate,
	// and a misspelt --transport must not wait for it.
	if spec := strings.TrimSpace(f.transport); spec != "" && spec != "auto" {
		if _, err := transport.ParseTransportList(spec); err != nil {
			return nil, 0, false, fmt.Errorf("--transport: %w", err)
		}
	}
	if _, err := envTransportOptions(); err != nil {
		return nil, 0, false, err
	}
	if err := checkControlPort(f.host, f.controlPort); err != nil {
		return nil, 0, false, err
	}
	if layout, err = roleLayout(f); err != nil {
		return nil, 0, false, err
	}
	if dev, onDevice, err = parseDevice(f.device); err != nil {
		return nil, 0, false, err
	}
	if onDevice {
		if err := cuda.Available(); err != nil {
			return nil, 0, false, fmt.Errorf("--device %s: CUDA is not usable on this host: %w (drop --device to keep the KV pool in host memory)", f.device, err)
		}
	} else if err := hostmem.Check(poolWhat(f), layout.PoolBytes(), "use a smaller --pool-mb"); err != nil {
		// Before anything is allocated: a pool larger than the host would
		// otherwise run it short of memory, silently, while it is touched.
		return nil, 0, false, err
	}
	return layout, dev, onDevice, nil
}

// checkControlPort refuses a fixed --control-port (port != 0) that cannot
// be bound on host, before the KV pool is allocated: a listener is opened
// and closed again at once (the control socket binds it later; a port
// taken between the two is still refused there, naming the flag too).
func checkControlPort(host string, port int) error {
	if port == 0 {
		return nil
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(strings.Trim(host, "[]"), strconv.Itoa(port)))
	if err != nil {
		return fmt.Errorf("--control-port %d: cannot bind the control socket: %w; give another port, or 0 (the default) to pick a free one", port, err)
	}
	return ln.Close()
}

// poolWhat names the rank's host KV pool and the flags that size it, for
// hostmem.Check.
func poolWhat(f *roleFlags) string {
	w := fmt.Sprintf("--pool-mb %d", f.poolMB)
	if f.prefixBlocks > 0 {
		w += fmt.Sprintf(" with --prefix-cache-blocks %d", f.prefixBlocks)
	}
	return w + ": the rank's KV pool in host memory"
}

// rankTransports opens the rank's data transports (--transport; with
// --device only those that can move device memory), wrapped in the fault
// injector when --inject-write-delay is set.
func rankTransports(f *roleFlags, onDevice bool) ([]transport.Transport, error) {
	ts, err := openTransports(f.transport, f.host, f.advertiseHost)
	if err != nil {
		return nil, err
	}
	if onDevice {
		if ts, err = deviceTransports(ts, f.transport, f.device); err != nil {
			return nil, err
		}
	}
	if f.writeDelay > 0 {
		for i, t := range ts {
			ts[i] = faulty.Wrap(t, faulty.DelayWrites(f.writeDelay))
		}
	}
	return ts, nil
}

// managerConfig is the rank's engine.ManagerConfig from its flags (and
// sets how each request line's room is driven, r.rc, and the HTTP token).
func (r *rank) managerConfig(f *roleFlags, ts []transport.Transport, dev int, onDevice bool) engine.ManagerConfig {
	ring := engine.RingAllocator(engine.AutoRingMemory)
	if onDevice && os.Getenv("KVXFER_RING_DEVICE") == "" {
		ring = engine.CUDARingMemory(dev) // the ring on the KV pool's GPU
	}
	// rc is how each request line's room is driven (cluster.PrefillRoom,
	// DecodeRoom).
	r.rc = cluster.RoomConfig{Bootstrap: f.bootstrap, BootstrapTimeout: f.bootstrapTimeout, WaitingTimeout: f.waitingTimeout,
		ChunkPages: f.chunkPages, Fill: f.fill, Hold: f.hold, Digest: f.digest, AfterLayers: f.afterLayers()}
	r.token = bootstrapToken(f.authToken, os.Getenv)
	cfg := engine.ManagerConfig{Role: r.role, KV: r.pool.Args(), Transports: ts, BootstrapAddr: f.bootstrap, DPRank: f.dpRank, DPSize: f.dpSize,
		BootstrapAuthToken: r.token, DirectoryCheckInterval: f.dirCheck,
		AuthenticateControl: controlAuthOn(f.controlAuth, r.token), MaxPeers: f.maxPeers,
		KVCacheDtype: f.kvDtype, ControlHost: f.host, ControlPort: f.controlPort, AdvertiseHost: f.advertiseHost, BootstrapTimeout: f.bootstrapTimeout, WaitingTimeout: f.waitingTimeout,
		PeerTimeout: f.peerTimeout, ProgressInterval: progressInterval(f.progressInterval), FenceTimeout: f.fenceTimeout, RingSlots: f.ringSlots, Checksum: f.checksum, NoPrefault: !f.prefault,
		// The decode's metadata ring: memfd memory, also pinned and mapped for
		// a GPU when CUDA is present (KVXFER_RING_DEVICE picks the GPU), so
		// the shm transport can share it by fd either way.
		RingAlloc: ring, PagesWaiting: r.pool.Waiting}
	if r.role == engine.RoleDecode {
		cfg.BootstrapAddr = ""
		cfg.FreePages = r.pool.FreePages
		if f.verify {
			r.rc.Verifier = cluster.NewVerifier(r.pool, f.pageSize)
			r.rc.Verifier.Hint = verifyMismatchHint
			cfg.VerifyKV = r.rc.Verifier.VerifyKV
		}
	}
	return cfg
}

// verifyMismatchHint ends a decode's --verify error when bytes differ
// from the pattern: the pattern is the prefill's --fill, so a prefill run
// with --fill=false is the usual cause.
const verifyMismatchHint = "decode --verify checks the test pattern the prefill's --fill writes: was the prefill run with --fill=false? " +
	"Then run the decode without --verify; with --fill on, the bytes that landed really differ from what the prefill sent"

// inputLine is one non-blank stdin line: its 1-based number and either the
// parsed request or why it is not one (hasRoom: the room was read anyway).
type inputLine struct {
	n       int
	q       requestLine
	hasRoom bool
	err     error
	// readAt is when the line was read whole (on a source without a
	// byte boundary, the HTTP endpoint, a line read after a stop signal is
	// refused, one read before it served).
	readAt time.Time
	// end is the stream offset just past the line (bytes, its "\n"
	// included); afterStop is set by a gatedReader for a line that ends
	// past the bytes the source held when the stop signal came; gated
	// says a gatedReader judged the line (readAt is then not used).
	end              int64
	gated, afterStop bool
}

// maxLineBytes bounds one request line; a longer line gets an error result
// and the rank reads on (issue 18).
const maxLineBytes = 1 << 20

// readRequests hands every non-blank line of r, parsed or not, to handle
// (in order, from this goroutine); it returns at EOF (nil) or on a read
// error. A line longer than maxLineBytes
// is read to its end without being kept and sent as an error naming its
// length, so one bad line costs one failed result, not the rank.
func readRequests(r io.Reader, role engine.Role, handle func(inputLine)) error {
	br := bufio.NewReaderSize(r, 64<<10)
	n := 0
	var off int64
	for {
		line, size, err := readLine(br, maxLineBytes)
		if size == 0 && err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		n++
		off += int64(size)
		if err == nil {
			off++ // the "\n"
		}
		if size > maxLineBytes {
			handle(inputLine{n: n, readAt: time.Now(), end: off, err: fmt.Errorf("line of %d bytes is longer than the limit of %d bytes (1 MiB): skipped (want one JSON request object per line)", size, maxLineBytes)})
		} else if text := strings.TrimSpace(string(line)); text != "" {
			q, hasRoom, perr := parseRequest(text, role)
			handle(inputLine{n: n, q: q, hasRoom: hasRoom, err: perr, readAt: time.Now(), end: off})
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

// requestFields is a request line as parseRequest decodes it; the role tag
// of each field names the roles that accept its key (requestKeys).
type requestFields struct {
	Room      json.RawMessage `json:"room" role:"prefill,decode"`
	Tokens    json.RawMessage `json:"tokens" role:"prefill,decode"`
	Bootstrap *string         `json:"bootstrap" role:"decode"`
	HashIDs   []int64         `json:"hash_ids" role:"prefill,decode"`
	Layerwise *bool           `json:"layerwise" role:"prefill"`
	LayerUS   *int64          `json:"layer_compute_us" role:"prefill"`
	Pattern   json.RawMessage `json:"pattern_room" role:"prefill"`
}

// requestKeys lists, quoted and in field order, the request line keys that
// role accepts, read from the tags of requestFields.
func requestKeys(role engine.Role) []string {
	var keys []string
	rt := reflect.TypeFor[requestFields]()
	for i := range rt.NumField() {
		f := rt.Field(i)
		if slices.Contains(strings.Split(f.Tag.Get("role"), ","), roleName(role)) {
			keys = append(keys, strconv.Quote(f.Tag.Get("json")))
		}
	}
	return keys
}

// roleName is "decode" for engine.RoleDecode and "prefill" otherwise, as
// the role tags of requestFields spell them.
func roleName(role engine.Role) string {
	if role == engine.RoleDecode {
		return "decode"
	}
	return "prefill"
}

// parseRequest decodes one request line. room (0 included) and tokens (>= 1)
// are required; "bootstrap" is a decode-only field; any other key is an
// error. hasRoom reports whether q.Room was read, even when err is set.
func parseRequest(text string, role engine.Role) (q requestLine, hasRoom bool, err error) {
	var raw requestFields
	dec := json.NewDecoder(strings.NewReader(text))
	dec.DisallowUnknownFields()
	want := `{"room": N, "tokens": N}`
	if role == engine.RoleDecode {
		want = `{"room": N, "tokens": N, "bootstrap": "host:port" (optional)}`
	}
	if err := dec.Decode(&raw); err != nil {
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syn):
			return q, false, fmt.Errorf("not JSON (invalid at byte %d of the line; want %s)", syn.Offset, want)
		case errors.As(err, &typ) && typ.Field == "":
			return q, false, fmt.Errorf("a JSON %s, not an object (want %s)", typ.Value, want)
		case errors.As(err, &typ):
			return q, false, fmt.Errorf("%q is a JSON %s, want %s", typ.Field, typ.Value, want)
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			return q, false, fmt.Errorf("%s: a %s request line accepts only the keys %s (want %s)",
				strings.TrimPrefix(err.Error(), "json: "), roleName(role), strings.Join(requestKeys(role), ", "), want)
		}
		return q, false, fmt.Errorf("not a request object: %v (want %s)", err, want)
	}
	if dec.More() {
		return q, false, fmt.Errorf("text after the request object (one JSON object per line, want %s)", want)
	}
	if strings.TrimSpace(text) == "null" { // decodes into the struct as a no-op
		return q, false, fmt.Errorf("a JSON null, not an object: a request line must be one JSON object (want %s)", want)
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
	if raw.Layerwise != nil || raw.LayerUS != nil {
		if role != engine.RolePrefill {
			return q, true, fmt.Errorf(`"layerwise" and "layer_compute_us" are prefill request fields (how the prefill computes and sends the room)`)
		}
		if raw.LayerUS != nil && (*raw.LayerUS < 0 || *raw.LayerUS > 600e6) {
			return q, true, fmt.Errorf(`"layer_compute_us" %d: want 0 … 600000000 (µs of modeled compute per layer)`, *raw.LayerUS)
		}
		q.Layerwise = raw.Layerwise != nil && *raw.Layerwise
		if raw.LayerUS != nil {
			q.LayerComputeUS = *raw.LayerUS
		}
	}
	if raw.Pattern != nil {
		if role != engine.RolePrefill {
			return q, true, fmt.Errorf(`"pattern_room" is a prefill request field (whose test pattern the prefill sends)`)
		}
		pr, err := strconv.ParseUint(string(raw.Pattern), 10, 64)
		if err != nil || pr > maxRoom {
			return q, true, fmt.Errorf(`"pattern_room" %s: want an integer 0 … 2^63-1`, raw.Pattern)
		}
		q.PatternRoom = &pr
	}
	return q, true, nil
}

// lineWriter writes JSON lines whole (concurrent writers do not
// interleave); flush, when set, runs after each line (an HTTP response).
type lineWriter struct {
	mu    sync.Mutex
	w     io.Writer
	flush func()
}

func (l *lineWriter) write(v any) {
	var b strings.Builder
	enc := json.NewEncoder(&b) // one line, "\n"-terminated
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	l.mu.Lock()
	defer l.mu.Unlock()
	_, _ = io.WriteString(l.w, b.String())
	if l.flush != nil {
		l.flush()
	}
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
	// Serve is where the rank takes requests with --serve ("unix:PATH" or
	// "http://HOST:PORT" as bound); absent when it reads stdin.
	Serve string `json:"serve,omitempty"`
}

// parseDevice parses --device (transport.ParseLocation): host memory gives
// dev -1, "cuda:N" gives N and onDevice.
func parseDevice(s string) (dev int, onDevice bool, err error) {
	kind, d, err := transport.ParseLocation(s)
	if err != nil {
		return 0, false, fmt.Errorf("--device: %w", err)
	}
	if kind != transport.MemoryCUDA {
		return -1, false, nil
	}
	return d, true, nil
}

// deviceTransports keeps the transports that can register device memory
// (transport.CapDeviceMemory) and closes the rest. With an explicit --transport
// list every named transport must qualify; with auto at least one must.
func deviceTransports(ts []transport.Transport, spec, device string) ([]transport.Transport, error) {
	var keep, drop []transport.Transport
	var names []string
	for _, t := range ts {
		if t.Capabilities().Has(transport.CapDeviceMemory) {
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

// afterLayers is the prefill's layer-wise fault injection
// (--inject-exit-after-layers, --inject-stall-after-layers; nil without).
func (f *roleFlags) afterLayers() func(room uint64, calls int) bool {
	if f.exitAfterLayers <= 0 && f.stallAfterLayers <= 0 {
		return nil
	}
	return func(room uint64, calls int) bool {
		if f.exitAfterLayers > 0 && calls >= f.exitAfterLayers {
			slog.Warn("fault injection: killing this prefill rank after layer-wise calls landed", "room", room, "calls", calls)
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal ends the process
		}
		if f.stallAfterLayers > 0 && calls >= f.stallAfterLayers {
			slog.Warn("fault injection: this prefill rank stops sending the room", "room", room, "calls", calls)
			return false
		}
		return true
	}
}

// progressInterval maps --progress-interval to ManagerConfig.ProgressInterval
// (0 there means the default; the flag's 0 means never).
func progressInterval(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// controlAuthDefault is --control-auth's default: env KVXFER_CONTROL_AUTH
// "1" (true) or "0" (false), else auto.
func controlAuthDefault(getenv func(string) string) string {
	switch getenv("KVXFER_CONTROL_AUTH") {
	case "1":
		return "true"
	case "0":
		return "false"
	}
	return "auto"
}

// validControlAuth reports whether v is a --control-auth value ("" is
// auto).
func validControlAuth(v string) bool {
	switch v {
	case "", "auto", "true", "false", "1", "0":
		return true
	}
	return false
}

// controlAuthOn resolves --control-auth: auto authenticates control frames
// exactly when the rank has a bootstrap token (issue 22 case 4: a token
// set, control frames are authenticated unless turned off).
func controlAuthOn(v, token string) bool {
	switch v {
	case "true", "1":
		return true
	case "false", "0":
		return false
	}
	return token != ""
}
