// Package metadata keeps segment and instance metadata for a fleet of
// kvxfer engines in etcd (Mooncake's and NIXL's "metadata server"), so that
// peers find each other by name across hosts and notice restarts and crashes
// without waiting for a heartbeat. It is not the per-room metadata record
// (engine.MetaRing).
//
// A Store is one process's connection to an etcd cluster, opened from a URL
//
//	etcd://host:port[,host:port…][/prefix]        (prefix default "/kvxfer")
//
// It implements transport.SegmentDirectory: every engine (TransferEngine or KV
// manager rank) publishes its transport.SegmentDescriptor under
//
//	<prefix>/segments/<segment name>
//
// bound to the Store's lease (TTL default 10 s, kept alive in the
// background): a crashed or partitioned process stops renewing it and its
// keys vanish within the TTL; a restarted process publishes a new epoch. A
// live process whose lease expired (partition, SIGSTOP) grants a new lease
// and publishes everything again as soon as it reaches etcd. Peers resolve
// names with Resolve and watch them with Watch (segengine.TransferEngine and
// engine.Manager do both).
//
// Each prefill instance's bootstrap directory is published under
//
//	<prefix>/instances/<bootstrap host:port>
//
// (PublishInstance, InstancePublisher) so that routers and decodes can
// discover instances; Fleet builds the `kvxfer fleet` report from both.
//
// HTTPStore is the other transport.SegmentDirectory: Mooncake's HTTP metadata
// mode ("http://host:port/metadata"), served by package httpmeta (`kvxfer
// metadata-server`) or Mooncake's mooncake_http_metadata_server. It has no
// leases, so a crashed engine's descriptor stays until the name is published
// again (see HTTPStore).
//
// The library reads no environment variables: cmd/ and capi/ turn
// --metadata / KVXFER_METADATA / kvx_engine_config.metadata_server into a
// URL. A Store is safe for concurrent use; Close it when done (idempotent).
package metadata

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Defaults.
const (
	// DefaultPrefix is the key prefix when the URL names none.
	DefaultPrefix = "/kvxfer"
	// DefaultTTL is the lease TTL of published keys.
	DefaultTTL = 10 * time.Second
	// DefaultTimeout bounds each etcd request (and the connection check of
	// Open).
	DefaultTimeout = 5 * time.Second
)

// URL is a parsed metadata server URL.
type URL struct {
	// Endpoints are the etcd members' client addresses, "host:port".
	Endpoints []string
	// Prefix is the key prefix: starts with "/", no trailing "/".
	Prefix string
}

// String returns the URL in its canonical form.
func (u URL) String() string {
	return "etcd://" + strings.Join(u.Endpoints, ",") + u.Prefix
}

// IsP2P reports whether s selects P2P mode (no metadata server): "",
// "P2PHANDSHAKE" (Mooncake's name) or "p2p".
func IsP2P(s string) bool {
	switch strings.TrimSpace(s) {
	case "", "P2PHANDSHAKE", "p2p", "P2P":
		return true
	}
	return false
}

// ParseURL parses "etcd://host:port[,host:port…][/prefix]". Errors name
// what is wrong: another scheme (http:// is OpenHTTP's; Mooncake's redis://
// is not supported), no endpoint, an endpoint without a valid port,
// an empty prefix segment.
func ParseURL(s string) (URL, error) {
	rest, ok := strings.CutPrefix(strings.TrimSpace(s), "etcd://")
	if !ok {
		scheme, _, _ := strings.Cut(s, "://")
		if !strings.Contains(s, "://") {
			scheme = s
		}
		hint := "P2P needs no metadata server"
		if IsHTTP(s) {
			hint = "an http:// metadata server is opened with OpenHTTP, which engines created through the C ABI and Python use"
		}
		return URL{}, fmt.Errorf("metadata: %q: want etcd://host:port[,host:port…][/prefix] (scheme %q is not supported here; %s)", s, scheme, hint)
	}
	hosts, prefix, _ := strings.Cut(rest, "/")
	u := URL{Prefix: DefaultPrefix}
	if prefix != "" {
		prefix = strings.TrimSuffix(prefix, "/")
		for _, seg := range strings.Split(prefix, "/") {
			if seg == "" {
				return URL{}, fmt.Errorf("metadata: %q: prefix %q has an empty path segment", s, prefix)
			}
		}
		u.Prefix = "/" + prefix
	}
	if hosts == "" {
		return URL{}, fmt.Errorf("metadata: %q: no etcd endpoint (want etcd://host:port[,host:port…])", s)
	}
	for _, h := range strings.Split(hosts, ",") {
		host, port, err := net.SplitHostPort(h)
		if err != nil {
			return URL{}, fmt.Errorf("metadata: %q: endpoint %q is not host:port (etcd's client port is usually 2379): %v", s, h, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || host == "" {
			return URL{}, fmt.Errorf("metadata: %q: endpoint %q: want a host and a port 1..65535", s, h)
		}
		u.Endpoints = append(u.Endpoints, net.JoinHostPort(host, port))
	}
	return u, nil
}

// Options tune Open.
type Options struct {
	// TTL is the lease TTL of published keys (DefaultTTL); at least 2 s
	// (etcd's minimum lease TTL is about 1.5 election timeouts).
	TTL time.Duration
	// Timeout bounds each etcd request (DefaultTimeout).
	Timeout time.Duration
	// Logger receives lease loss and recovery (slog.Default when nil).
	Logger *slog.Logger
}

// Store is a connection to an etcd cluster under one prefix, with one lease
// for everything this process publishes. It implements
// transport.SegmentDirectory.
type Store struct {
	url  URL
	opts Options
	cli  *clientv3.Client
	log  *slog.Logger
	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	// pubMu serialises puts so that a re-publish after lease loss never
	// writes an older value over a newer one.
	pubMu     sync.Mutex
	mu        sync.Mutex
	lease     clientv3.LeaseID // 0 while none is held
	published map[string]string
	closed    bool
	leaseLost int              // leases lost and replaced (for tests and logs)
	lostID    clientv3.LeaseID // the lease whose keep-alive stopped last
	kick      chan struct{}    // wakes the lease supervisor
	diag      diagCache        // the latest diagnosis of a failed request (diagnose.go)
}

var _ transport.SegmentDirectory = (*Store)(nil)

// ErrBadRecord is wrapped by errors decoding a record read from etcd.
var ErrBadRecord = errors.New("metadata: malformed record")

// Open connects to the etcd cluster url names and checks that it answers
// (one read, bounded by Options.Timeout). An unreachable cluster fails with
// an error that wraps transport.ErrMetadataUnavailable and says what each
// endpoint did (connection refused, no answer, answering without a leader:
// quorum lost). The lease is granted on the first publish.
func Open(ctx context.Context, rawURL string, o Options) (*Store, error) {
	u, err := ParseURL(rawURL)
	if err != nil {
		return nil, err
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.TTL < 2*time.Second {
		return nil, fmt.Errorf("metadata: lease TTL %v is below etcd's minimum; use at least 2s", o.TTL)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   u.Endpoints,
		DialTimeout: o.Timeout,
		// gRPC pings notice a member that stopped answering (paused, or a
		// partition) so the client fails over; etcd refuses pings more often
		// than its --grpc-keepalive-min-time (5 s by default).
		DialKeepAliveTime:    5 * time.Second,
		DialKeepAliveTimeout: o.Timeout,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("metadata: etcd client for %s: %w", u, err)
	}
	sctx, stop := context.WithCancel(context.Background())
	s := &Store{url: u, opts: o, cli: cli, log: o.Logger.With("metadata", u.String()), ctx: sctx, stop: stop,
		published: map[string]string{}, kick: make(chan struct{}, 1)}
	s.wg.Add(1)
	go s.supervise()
	cctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	if _, err := cli.Get(cctx, u.Prefix+"/", clientv3.WithCountOnly()); err != nil {
		uerr := s.unavailable("connect", err) // before Close: it probes with the client
		s.Close()
		return nil, uerr
	}
	return s, nil
}

// unavailable wraps an etcd error as ErrMetadataUnavailable saying what
// happened: which endpoints answered, whether the cluster has a leader
// (quorum), what the others did (connection refused at an endpoint, no
// answer within the timeout, paused) and what to do (diagnose).
func (s *Store) unavailable(op string, err error) error {
	d := s.diagnose(err)
	if d == "" {
		d = "endpoints " + strings.Join(s.url.Endpoints, ", ") + " unreachable or not answering"
	}
	return fmt.Errorf("metadata: %s: etcd at %s: %s: %w: %v", op, s.url, d, transport.ErrMetadataUnavailable, err)
}

// URL returns the store's URL.
func (s *Store) URL() URL { return s.url }

// String returns the URL, for error messages (transport.SegmentDirectory).
func (s *Store) String() string { return s.url.String() }

// TTL returns the lease TTL.
func (s *Store) TTL() time.Duration { return s.opts.TTL }

// Client returns the etcd client (for tools and tests).
func (s *Store) Client() *clientv3.Client { return s.cli }

// LeaseLosses returns how many times the lease was lost and replaced.
func (s *Store) LeaseLosses() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leaseLost
}

// SegmentKey returns the key of a segment name.
func (s *Store) SegmentKey(name string) string { return s.url.Prefix + "/segments/" + name }

// InstanceKey returns the key of a prefill instance's bootstrap address.
func (s *Store) InstanceKey(addr string) string { return s.url.Prefix + "/instances/" + addr }

// Close revokes the lease (the keys this process published vanish at once
// instead of after the TTL), stops the keep-alive and watches, and closes
// the client. Idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	lease := s.lease
	s.mu.Unlock()
	if lease != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
		_, _ = s.cli.Revoke(ctx, lease)
		cancel()
	}
	s.stop()
	s.wg.Wait()
	return s.cli.Close()
}

// leaseID returns the current lease, granting one (and starting its
// keep-alive) when none is held.
func (s *Store) leaseID(ctx context.Context) (clientv3.LeaseID, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("metadata: store for %s: %w", s.url, transport.ErrClosed)
	}
	if s.lease != 0 {
		return s.lease, nil
	}
	resp, err := s.cli.Grant(ctx, int64((s.opts.TTL+time.Second-1)/time.Second))
	if err != nil {
		return 0, s.unavailable("grant lease", err)
	}
	s.lease = resp.ID
	ch, err := s.cli.KeepAlive(s.ctx, resp.ID)
	if err != nil {
		s.lease = 0
		return 0, s.unavailable("keep lease alive", err)
	}
	s.wg.Add(1)
	go s.keepAlive(resp.ID, ch)
	return resp.ID, nil
}

// keepAlive drains the keep-alive responses. The channel closes when the
// server says the lease expired, or when no response came for a TTL (etcd
// down, partition, this process paused); then the supervisor recovers.
func (s *Store) keepAlive(id clientv3.LeaseID, ch <-chan *clientv3.LeaseKeepAliveResponse) {
	defer s.wg.Done()
	for range ch {
	}
	s.mu.Lock()
	if s.closed || s.ctx.Err() != nil {
		s.mu.Unlock()
		return
	}
	s.lostID = id
	s.mu.Unlock()
	s.log.Warn("etcd lease keep-alive stopped (lease expired on the server, or no answer for a TTL: partition, pause or etcd outage); recovering when etcd answers", "lease", fmt.Sprintf("%x", id))
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// supervise runs a lease recovery each time a keep-alive stops: once etcd
// answers again, the same lease is kept alive if the server still has it
// (an etcd restart extends every lease by its TTL), else a new one is
// granted and every key published again.
func (s *Store) supervise() {
	defer s.wg.Done()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-s.kick:
		}
		s.mu.Lock()
		id := s.lostID
		s.mu.Unlock()
		s.recover(id)
	}
}

// recover keeps the old lease alive again when etcd still has it, else
// grants a new one and re-publishes every key; it retries (at most every
// second, so it wins the race against the server expiring a lease that an
// etcd restart extended) until it succeeds or the store closes.
func (s *Store) recover(old clientv3.LeaseID) {
	backoff := 100 * time.Millisecond
	for {
		resumed, err := s.resume(old)
		if err == nil && !resumed {
			s.mu.Lock()
			if s.lease == old {
				s.lease = 0
			}
			s.leaseLost++
			s.mu.Unlock()
			err = s.republish()
		}
		if err == nil {
			s.mu.Lock()
			n := len(s.published)
			s.mu.Unlock()
			if resumed {
				s.log.Info("etcd answers again; the lease was still alive and is kept alive", "keys", n)
			} else {
				s.log.Info("published again under a new etcd lease", "keys", n)
			}
			return
		}
		s.log.Debug("lease recovery failed; retrying", "err", err)
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// resume restarts the keep-alive of lease id if the server still holds it
// (true), reports false when it expired, or fails when etcd is unreachable.
func (s *Store) resume(id clientv3.LeaseID) (bool, error) {
	s.mu.Lock()
	cur := s.lease
	s.mu.Unlock()
	if cur != id {
		return false, nil // already replaced by a publish
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.Timeout)
	defer cancel()
	ttl, err := s.cli.TimeToLive(ctx, id)
	if err != nil {
		return false, s.unavailable("lease time to live", err)
	}
	if ttl.TTL <= 0 {
		return false, nil
	}
	ch, err := s.cli.KeepAlive(s.ctx, id)
	if err != nil {
		return false, s.unavailable("keep lease alive", err)
	}
	s.mu.Lock()
	if s.closed || s.lease != id {
		s.mu.Unlock()
		return false, nil
	}
	s.wg.Add(1)
	s.mu.Unlock()
	go s.keepAlive(id, ch)
	return true, nil
}

func (s *Store) republish() error {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.Timeout)
	defer cancel()
	id, err := s.leaseID(ctx)
	if err != nil {
		return err
	}
	s.mu.Lock()
	kvs := make(map[string]string, len(s.published))
	for k, v := range s.published {
		kvs[k] = v
	}
	s.mu.Unlock()
	for k, v := range kvs {
		if _, err := s.cli.Put(ctx, k, v, clientv3.WithLease(id)); err != nil {
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				s.dropLease(id)
			}
			return s.unavailable("re-publish "+k, err)
		}
	}
	return nil
}

// dropLease forgets a lease the server no longer knows.
func (s *Store) dropLease(id clientv3.LeaseID) {
	s.mu.Lock()
	if s.lease == id {
		s.lease = 0
	}
	s.mu.Unlock()
}

// put stores key=val under the lease and remembers it for re-publishing
// (the value is kept even when etcd is unreachable, so recovery publishes
// the latest). A lease the server lost is replaced once.
func (s *Store) put(ctx context.Context, key, val string) error {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("metadata: store for %s: %w", s.url, transport.ErrClosed)
	}
	s.published[key] = val
	s.mu.Unlock()
	for attempt := 0; ; attempt++ {
		id, err := s.leaseID(ctx)
		if err != nil {
			return err
		}
		_, err = s.cli.Put(ctx, key, val, clientv3.WithLease(id))
		if err == nil {
			return nil
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && attempt == 0 {
			s.dropLease(id)
			continue
		}
		return s.unavailable("put "+key, err)
	}
}

// del removes key and stops re-publishing it.
func (s *Store) del(ctx context.Context, key string) error {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	s.mu.Lock()
	delete(s.published, key)
	s.mu.Unlock()
	if _, err := s.cli.Delete(ctx, key); err != nil {
		return s.unavailable("delete "+key, err)
	}
	return nil
}

// Publish stores desc under its segment name (transport.SegmentDirectory).
func (s *Store) Publish(ctx context.Context, desc transport.SegmentDescriptor) error {
	if desc.Name == "" || strings.ContainsAny(desc.Name, "\x00") {
		return fmt.Errorf("metadata: publish: segment name %q is empty or has a NUL byte", desc.Name)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	return s.put(ctx, s.SegmentKey(desc.Name), string(desc.Encode()))
}

// Unpublish removes a segment name (transport.SegmentDirectory).
func (s *Store) Unpublish(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	return s.del(ctx, s.SegmentKey(name))
}

// Resolve returns the descriptor published under name and the store
// revision of the read (transport.SegmentDirectory). Errors wrap
// transport.ErrSegmentNotFound, transport.ErrMetadataUnavailable or ErrBadRecord.
func (s *Store) Resolve(ctx context.Context, name string) (transport.SegmentDescriptor, int64, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.SegmentKey(name))
	if err != nil {
		return transport.SegmentDescriptor{}, 0, s.unavailable("resolve segment "+strconv.Quote(name), err)
	}
	if len(resp.Kvs) == 0 {
		return transport.SegmentDescriptor{}, 0, fmt.Errorf("metadata: segment %q is not published in %s (not started, crashed more than a lease TTL ago, or started without this metadata server): %w",
			name, s.url, transport.ErrSegmentNotFound)
	}
	d, err := transport.DecodeSegmentDescriptor(resp.Kvs[0].Value)
	if err != nil {
		return transport.SegmentDescriptor{}, 0, fmt.Errorf("metadata: segment %q in %s: %w: %w", name, s.url, ErrBadRecord, err)
	}
	return d, resp.Header.Revision, nil
}

// Segments lists every published segment descriptor (records that do not
// decode are skipped and counted in bad).
func (s *Store) Segments(ctx context.Context) (out []transport.SegmentDescriptor, bad int, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.url.Prefix+"/segments/", clientv3.WithPrefix())
	if err != nil {
		return nil, 0, s.unavailable("list segments", err)
	}
	for _, kv := range resp.Kvs {
		d, err := transport.DecodeSegmentDescriptor(kv.Value)
		if err != nil {
			bad++
			continue
		}
		out = append(out, d)
	}
	return out, bad, nil
}

// Watch calls fn for every change of name's descriptor after revision rev
// (transport.SegmentDirectory). It survives etcd outages and member failover
// (the client reconnects to another endpoint and the watch resumes from the
// last revision seen); when etcd compacted that history, the key is read
// again and its current state delivered.
func (s *Store) Watch(name string, rev int64, fn func(transport.SegmentEvent)) (stop func()) {
	ctx, cancel := context.WithCancel(s.ctx)
	done := make(chan struct{})
	key := s.SegmentKey(name)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(done)
		next := rev + 1
		backoff := 100 * time.Millisecond
		for ctx.Err() == nil {
			wch := s.cli.Watch(clientv3.WithRequireLeader(ctx), key, clientv3.WithRev(next))
			for wr := range wch {
				if wr.CompactRevision != 0 {
					n, ok := s.resync(ctx, name, key, fn)
					if ok {
						next = n
					}
					break
				}
				if wr.Err() != nil {
					break
				}
				backoff = 100 * time.Millisecond
				for _, ev := range wr.Events {
					next = ev.Kv.ModRevision + 1
					se := transport.SegmentEvent{Name: name, Rev: ev.Kv.ModRevision}
					if ev.Type == clientv3.EventTypeDelete {
						se.Deleted = true
					} else {
						d, err := transport.DecodeSegmentDescriptor(ev.Kv.Value)
						if err != nil {
							s.log.Warn("ignoring a malformed segment descriptor in etcd", "key", key, "err", err)
							continue
						}
						se.Desc = d
					}
					fn(se)
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 2*time.Second)
		}
	}()
	return func() { cancel(); <-done }
}

// resync reads key after a compaction and delivers its current state.
func (s *Store) resync(ctx context.Context, name, key string, fn func(transport.SegmentEvent)) (int64, bool) {
	gctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	resp, err := s.cli.Get(gctx, key)
	if err != nil {
		return 0, false
	}
	ev := transport.SegmentEvent{Name: name, Rev: resp.Header.Revision}
	if len(resp.Kvs) == 0 {
		ev.Deleted = true
	} else if d, err := transport.DecodeSegmentDescriptor(resp.Kvs[0].Value); err == nil {
		ev.Desc = d
	} else {
		return resp.Header.Revision + 1, true
	}
	fn(ev)
	return resp.Header.Revision + 1, true
}

// randomEpoch returns a random non-zero value identifying a process start.
func randomEpoch() uint64 {
	for {
		if v := rand.Uint64(); v != 0 {
			return v
		}
	}
}
