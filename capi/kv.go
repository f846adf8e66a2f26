//go:build cgo

package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/sglangenv"
	"github.com/kvxfer/kvxfer/workload"
)

// Handle tables of the KV-room API.
var (
	kvs   = newTable[*kvObj]()
	rooms = newTable[*roomObj]()
)

// kvObj is one kvx_kv_t: a rank's engine.Manager and, when the library
// allocated them (kvx_kv_config without buffers), its KV buffers.
type kvObj struct {
	eng  *engineObj
	mgr  *engine.Manager
	pool *workload.KVBuffers // nil: the caller owns the buffers

	mu     sync.Mutex
	closed bool
	rooms  map[uint64]struct{}
}

// kvConfig is kvx_kv_config in Go types.
type kvConfig struct {
	modelName                        string
	model                            workload.ModelConfig
	layout                           workload.LayoutOptions
	dpSize, dpRank                   int
	checksum                         bool
	kvCacheDtype, controlHost        string
	controlPort                      int
	bootstrapTimeout, waitingTimeout time.Duration
	// authToken and advertiseHost are kvx_kv_config's (0.3); empty falls
	// back to the environment (envAuthToken, KVXFER_ADVERTISE_HOST).
	authToken, advertiseHost string
	// controlAuth and maxPeers are kvx_kv_config's control_auth
	// (KVX_CONTROL_AUTH_*) and max_peers; controlAuthEnv and 0 fall back
	// to the environment (controlSettings).
	controlAuth uint32
	maxPeers    uint32
	// allocPolicy and specLayout are kvx_kv_config's (0.4)
	// decode_allocation_policy and dsv41_spec_layout; "" declares the
	// defaults ("early", none).
	allocPolicy, specLayout string
	// httpPort is kvx_kv_config's prefill_http_port (0: none).
	httpPort uint32
	// args, when it has KV buffers, are the caller's buffers (0.2): the
	// library allocates nothing.
	args kvargs.KVArgs
}

// Values of kvx_kv_config.control_auth (KVX_CONTROL_AUTH_*).
const (
	controlAuthEnv = 0
	controlAuthOn  = 1
	controlAuthOff = 2
)

// controlSettings resolves a KV manager's control-frame authentication and
// peer bound from kvx_kv_config (control_auth, max_peers), falling back to
// the environment for what the caller left 0: KVXFER_CONTROL_AUTH ("1" on,
// "0" off; unset or "": on exactly when the rank has a bootstrap token,
// kvx_kv_config.bootstrap_auth_token or its environment, issue 22 case 4)
// and KVXFER_MAX_PEERS (a positive decimal; unset: the engine's
// default, engine.DefaultMaxPeers). Errors name the field or variable and
// the values it takes.
func controlSettings(c kvConfig, getenv func(string) string) (auth bool, maxPeers int, err error) {
	switch c.controlAuth {
	case controlAuthOn:
		auth = true
	case controlAuthOff:
	case controlAuthEnv:
		switch v := getenv("KVXFER_CONTROL_AUTH"); v {
		case "1":
			auth = true
		case "":
			auth = cmp.Or(c.authToken, getenv("KVXFER_BOOTSTRAP_AUTH_TOKEN"), getenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")) != ""
		case "0":
		default:
			return false, 0, fmt.Errorf("env KVXFER_CONTROL_AUTH=%q: want 1 (authenticate control frames) or 0", v)
		}
	default:
		return false, 0, fmt.Errorf("cfg->control_auth is %d: want KVX_CONTROL_AUTH_ENV (0), KVX_CONTROL_AUTH_ON (1) or KVX_CONTROL_AUTH_OFF (2)", c.controlAuth)
	}
	maxPeers = int(c.maxPeers)
	if maxPeers == 0 {
		if v := getenv("KVXFER_MAX_PEERS"); v != "" {
			n, perr := strconv.Atoi(v)
			if perr != nil || n <= 0 || n > 1<<20 {
				return false, 0, fmt.Errorf("env KVXFER_MAX_PEERS=%q: want a positive number of control peers (at most 1048576; default %d)", v, engine.DefaultMaxPeers)
			}
			maxPeers = n
		}
	} else if maxPeers > 1<<20 {
		return false, 0, fmt.Errorf("cfg->max_peers is %d: over the limit of 1048576 control peers", c.maxPeers)
	}
	return auth, maxPeers, nil
}

// declarations checks kvx_kv_config's decode_allocation_policy,
// dsv41_spec_layout and prefill_http_port (what a prefill rank declares in
// its registration) and returns the first two for engine.ManagerConfig;
// errors name the C field.
func declarations(c kvConfig) (policy string, layout []byte, err error) {
	switch c.allocPolicy {
	case "", bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete:
	default:
		return "", nil, fmt.Errorf("cfg->decode_allocation_policy %q: want %q (the default, also NULL) or %q, as SGLang's --disaggregation-decode-allocation-policy",
			c.allocPolicy, bootstrap.PolicyEarly, bootstrap.PolicyPrefillComplete)
	}
	if layout, err = bootstrap.CanonicalSpecLayout([]byte(c.specLayout)); err != nil {
		return "", nil, fmt.Errorf("cfg->dsv41_spec_layout: %v", err)
	}
	if c.httpPort > 65535 {
		return "", nil, fmt.Errorf("cfg->prefill_http_port %d: want the serving engine's HTTP port, 1–65535, or 0 for none", c.httpPort)
	}
	return c.allocPolicy, layout, nil
}

// callerBuffers turns three parallel C arrays into buffers of one memory
// kind; host buffers inside a kvx_alloc_host block get its memfd, so the
// shm transport can share them.
func callerBuffers(list string, n int, ptrs, lens, items []uint64, kind transport.MemoryKind, dev int) ([]kvargs.Buffer, error) {
	out := make([]kvargs.Buffer, n)
	for i := range out {
		if ptrs[i] == 0 || ptrs[i] > uint64(^uintptr(0)) {
			return nil, fmt.Errorf("%s_data_ptrs[%d] = %#x is not an address", list, i, ptrs[i])
		}
		m := transport.Memory{Addr: uintptr(ptrs[i]), Length: lens[i], Kind: kind, Device: dev, FD: -1}
		if kind == transport.MemoryHost {
			if fd, off, ok := hostBufferFor(m.Addr, m.Length); ok {
				m.FD, m.FDOffset = fd, off
			}
		}
		out[i] = kvargs.Buffer{Memory: m, ItemLen: items[i]}
	}
	return out, nil
}

func newKV(e *engineObj, c kvConfig) (*kvObj, error) {
	const op = "kvx_kv_create"
	var pool *workload.KVBuffers
	args := c.args
	if len(args.KVBuffers) == 0 {
		m := c.model
		if c.modelName != "" {
			mc, err := workload.LookupModel(c.modelName)
			if err != nil {
				return nil, failWrap(stInvalidArgument, err, "%s: model", op)
			}
			m = mc
		}
		l, err := workload.NewLayout(m, c.layout)
		if err != nil {
			return nil, failWrap(stInvalidArgument, err, "%s", op)
		}
		// One contiguous block, so kvx_kv_pool can present it as one pool.
		if pool, err = workload.NewKVBuffers(l, workload.BufferOptions{Name: "capi-kv", Device: -1, Contiguous: true}); err != nil {
			return nil, failWrap(stInvalidArgument, err, "%s: KV pool of %d bytes", op, l.PoolBytes())
		}
		args = pool.Args()
	}
	closePool := func() {
		if pool != nil {
			pool.Close()
		}
	}
	role := engine.RolePrefill
	if e.role == 1 {
		role = engine.RoleDecode
	}
	if role == engine.RolePrefill && e.bootstrapAddr == "" {
		closePool()
		return nil, fail(stInvalidArgument, "%s: the prefill engine has no bootstrap_addr; set kvx_engine_config.bootstrap_addr (e.g. from kvx_bootstrap_addr)", op)
	}
	ctx := context.Background()
	if c.bootstrapTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.bootstrapTimeout+opTimeout)
		defer cancel()
	}
	ringDev, err := ringDevice()
	if err != nil {
		closePool()
		return nil, fail(stInvalidArgument, "%s: %v", op, err)
	}
	auth, maxPeers, err := controlSettings(c, getenv)
	if err != nil {
		closePool()
		return nil, fail(stInvalidArgument, "%s: %v", op, err)
	}
	policy, layout, err := declarations(c)
	if err != nil {
		closePool()
		return nil, fail(stInvalidArgument, "%s: %v", op, err)
	}
	mcfg := engine.ManagerConfig{
		// What a prefill rank declares in its registration
		// (decode_allocation_policy, dsv41_spec_layout).
		DecodeAllocationPolicy: policy,
		DSV41SpecLayout:        layout,
		PrefillHTTPPort:        int(c.httpPort),
		Role:                   role,
		KV:                     args,
		Transports:             e.trs,
		Directory:              e.meta,
		BootstrapAddr:          e.bootstrapAddr,
		DPRank:                 c.dpRank,
		DPSize:                 c.dpSize,
		KVCacheDtype:           c.kvCacheDtype,
		ControlHost:            c.controlHost,
		ControlPort:            c.controlPort,
		BootstrapTimeout:       c.bootstrapTimeout,
		WaitingTimeout:         c.waitingTimeout,
		Checksum:               c.checksum,
		// The C ABI reads the environment for what the caller left unset,
		// with the CLI's names.
		BootstrapAuthToken: cmp.Or(c.authToken, getenv("KVXFER_BOOTSTRAP_AUTH_TOKEN"), getenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")),
		AdvertiseHost:      cmp.Or(c.advertiseHost, getenv("KVXFER_ADVERTISE_HOST")),
		// control_auth / KVXFER_CONTROL_AUTH=1: HMAC-tagged control frames
		// (as the CLI's --control-auth), keyed by the bootstrap auth token;
		// max_peers / KVXFER_MAX_PEERS (as --max-peers).
		AuthenticateControl: auth,
		MaxPeers:            maxPeers,
		// GPU-visible mapped pinned memory when CUDA is present
		// (KVXFER_RING_DEVICE picks the GPU), memfd memory otherwise.
		RingAlloc: engine.CUDARingMemory(ringDev),
		// Every manager of the library shares one registry
		// (kvx_metrics_text, kvx_metrics_serve).
		Metrics: libRegistry(),
		NoProbe: envNoProbe(),
	}
	// SGLang's timeout and heartbeat variables, for what the caller left
	// unset, read now (libc getenv).
	if err := sglangenv.Apply(getenv, &mcfg); err != nil {
		closePool()
		return nil, fail(stInvalidArgument, "%s: %v", op, err)
	}
	mgr, err := engine.NewManager(ctx, mcfg)
	if err != nil {
		closePool()
		return nil, failWrap(stOK, err, "%s: %s KV manager", op, role)
	}
	return &kvObj{eng: e, mgr: mgr, pool: pool, rooms: map[uint64]struct{}{}}, nil
}

// close closes the rooms, the manager and frees the pool.
func (k *kvObj) close() error {
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return nil
	}
	k.closed = true
	hs := make([]uint64, 0, len(k.rooms))
	for h := range k.rooms {
		hs = append(hs, h)
	}
	k.mu.Unlock()
	// In parallel: a failed room's close waits for its producers to be
	// fenced (Receiver.Close), bounded by the fence timeout each.
	var wg sync.WaitGroup
	for _, h := range hs {
		if r, ok := rooms.take(h); ok {
			wg.Add(1)
			go func() { defer wg.Done(); r.close() }()
		}
	}
	wg.Wait()
	err := k.mgr.Close()
	if k.pool != nil {
		if cerr := k.pool.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// room is what Sender and Receiver have in common.
type room interface {
	Room() uint64
	Poll() engine.KVPoll
	Failure() error
	Wait(ctx context.Context, want engine.KVPoll) engine.KVPoll
	Abort()
	Close()
}

// roomObj is one kvx_room_t.
type roomObj struct {
	kv     *kvObj
	r      room
	sender *engine.Sender   // prefill
	recv   *engine.Receiver // decode
	cancel context.CancelFunc
	done   chan struct{}
}

// addRoom registers a new sender/receiver and starts the goroutine that
// reports its KVPoll changes to the engine's notification callback.
func (k *kvObj) addRoom(r *roomObj) (uint64, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed {
		r.r.Close()
		return 0, fail(stClosed, "KV manager is destroyed")
	}
	h := rooms.add(r)
	k.rooms[h] = struct{}{}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.done = cancel, make(chan struct{})
	go r.watch(ctx, h, k.eng.notify)
	return h, nil
}

// watch posts a KVX_EVENT_ROOM for every state the room reaches.
func (r *roomObj) watch(ctx context.Context, h uint64, n *notifier) {
	defer close(r.done)
	cur := r.r.Poll()
	n.post(roomEvent(h, r.r, cur))
	for cur != engine.KVSuccess && cur != engine.KVFailed {
		next := r.r.Wait(ctx, cur+1)
		if ctx.Err() != nil {
			return
		}
		if next == cur {
			continue
		}
		cur = next
		n.post(roomEvent(h, r.r, cur))
	}
}

func roomEvent(h uint64, r room, st engine.KVPoll) event {
	code := stOK
	if st == engine.KVFailed {
		code = codeOf(r.Failure())
	}
	return event{kind: eventKindRoom, status: code, handle: h, room: r.Room(), state: int32(st)}
}

// close stops the watcher and closes the sender/receiver.
func (r *roomObj) close() {
	r.cancel()
	<-r.done
	r.r.Close()
}

func (r *roomObj) failure() error {
	if r.r.Poll() != engine.KVFailed {
		return nil
	}
	err := r.r.Failure()
	if err == nil {
		err = errors.New("failed (no reason recorded)")
	}
	return failWrap(stOK, err, "room %d failed", r.r.Room())
}

// kvCode maps the KV manager's and bootstrap's errors to statuses; codeOf
// consults it before the transport sentinels.
func kvCode(err error) (status, bool) {
	switch {
	case errors.Is(err, engine.ErrRoomMismatch), errors.Is(err, engine.ErrChecksum):
		return stRoomMismatch, true
	case errors.Is(err, engine.ErrAborted):
		return stCanceled, true
	case errors.Is(err, engine.ErrTimeout):
		return stTimeout, true
	case errors.Is(err, engine.ErrRoomActive):
		return stBusy, true
	case errors.Is(err, engine.ErrManagerClosed):
		return stClosed, true
	case errors.Is(err, kvargs.ErrBadKVArgs):
		return stInvalidArgument, true
	case errors.Is(err, bootstrap.ErrNotReady), errors.Is(err, bootstrap.ErrNotFound),
		errors.Is(err, bootstrap.ErrUnauthorized), errors.Is(err, bootstrap.ErrConflict),
		errors.Is(err, bootstrap.ErrBadRequest), errors.Is(err, bootstrap.ErrRegisterDeadline),
		errors.Is(err, bootstrap.ErrWrongLeader), errors.Is(err, bootstrap.ErrMismatch):
		return stBootstrap, true
	}
	return 0, false
}

func checkPageList(op string, pages []int32, numPages int) error {
	for i, p := range pages {
		if p < 0 || int(p) >= numPages {
			return fail(stInvalidArgument, "%s: pages[%d] = %d is beyond the KV buffers of %d pages", op, i, p, numPages)
		}
	}
	return nil
}

// ringDevice is KVXFER_RING_DEVICE, the CUDA device whose kernels read the
// metadata ring (default 0; engine.CUDARingMemory falls back to host memory
// without CUDA).
func ringDevice() (int, error) {
	v := getenv("KVXFER_RING_DEVICE")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("KVXFER_RING_DEVICE=%q: want a CUDA device ordinal (0, 1, ...)", v)
	}
	return n, nil
}
