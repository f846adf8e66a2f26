// Package fleetsim is the scale benchmark of the etcd metadata backend
// (`kvxfer fleet --simulate N`, bench/RESULTS.md): N simulated ranks
// against a real etcd, each granting a lease and publishing a descriptor as
// a rank process does, then name lookups, then a watched rank's restart.
// A bench tool on top of package metadata (its URL form and defaults) and
// the etcd client; the library (metadata) carries none of it.
package fleetsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/metadata"
)

// Options configure Simulate.
type Options struct {
	// Ranks is the number of simulated ranks (each with its own lease and
	// descriptor key, as a real rank process has).
	Ranks int
	// Clients is the number of etcd client connections the ranks are spread
	// over (a real fleet has one per process; one machine cannot run
	// thousands of gRPC clients cheaply). Default: one per 25 ranks.
	Clients int
	// Resolves is the number of name lookups timed (default 10 per rank),
	// issued by Concurrency workers (default 16).
	Resolves, Concurrency int
	// TTL is each rank's lease TTL (metadata.DefaultTTL).
	TTL time.Duration
	// Timeout bounds each etcd request (metadata.DefaultTimeout).
	Timeout time.Duration
}

// Result are the scale figures of one Simulate run.
type Result struct {
	URL      string `json:"url"`
	Ranks    int    `json:"ranks"`
	Clients  int    `json:"clients"`
	Resolves int    `json:"resolves"`
	// RegisterAll is the time from the start until every rank had granted
	// its lease and published its descriptor (all ranks start at once).
	RegisterAll time.Duration `json:"register_all_ns"`
	// Resolve latencies (a Get of one descriptor by name, decoded).
	ResolveP50 time.Duration `json:"resolve_p50_ns"`
	ResolveP99 time.Duration `json:"resolve_p99_ns"`
	ResolveMax time.Duration `json:"resolve_max_ns"`
	// Watchers is the number of ranks watching the restarted rank's key.
	Watchers int `json:"watchers"`
	// InvalidateAll is the time from the restarted rank's publish (new
	// epoch) until every watcher had received the change.
	InvalidateAll time.Duration `json:"invalidate_all_ns"`
	// InvalidateP50 is the median watcher's delay.
	InvalidateP50 time.Duration `json:"invalidate_p50_ns"`
	// KeysBytes is the total size of the published descriptors.
	KeysBytes int `json:"keys_bytes"`
}

// String renders the figures on a few lines.
func (r Result) String() string {
	return fmt.Sprintf("%d ranks over %d etcd clients (%s)\n"+
		"  time to all registered (lease + descriptor each): %v\n"+
		"  resolve (%d lookups): p50 %v  p99 %v  max %v\n"+
		"  restart → all %d watchers invalidated: %v (median watcher %v)\n"+
		"  descriptors: %d bytes in total (%d per rank)",
		r.Ranks, r.Clients, r.URL, r.RegisterAll.Round(time.Millisecond),
		r.Resolves, r.ResolveP50.Round(time.Microsecond), r.ResolveP99.Round(time.Microsecond), r.ResolveMax.Round(time.Microsecond),
		r.Watchers, r.InvalidateAll.Round(time.Microsecond), r.InvalidateP50.Round(time.Microsecond), r.KeysBytes, r.KeysBytes/max(r.Ranks, 1))
}

// simDescriptor is a realistic rank descriptor: 64 regions (32 layers × K
// and V) with rkeys, as a prefill rank of an 8B model publishes.
func simDescriptor(name string, epoch uint64, regions int) transport.SegmentDescriptor {
	d := transport.SegmentDescriptor{Name: name, Epoch: epoch, RPC: name, Kind: "prefill", Hostname: "sim", PID: 1,
		Transports: []transport.SegmentTransport{{Name: "rdma", PerPeer: true}, {Name: "tcp", Endpoint: []byte("10.0.0.1:40000")}}}
	for i := 0; i < regions; i++ {
		d.Regions = append(d.Regions, transport.RegionDesc{ID: transport.RegionID(i + 1), Addr: uint64(0x7f0000000000 + i<<28), Length: 1 << 28, Key: []byte("rkey0123")})
	}
	return d
}

// Simulate registers o.Ranks simulated ranks against the etcd cluster at
// url (under a fresh prefix below the URL's, removed afterwards), times
// name lookups, then has every rank watch one rank, restarts that rank (new
// lease, new epoch) and times the fan-out of the change. It measures etcd
// and the client as kvxfer uses them; no data moves.
func Simulate(ctx context.Context, url string, o Options) (Result, error) {
	u, err := metadata.ParseURL(url)
	if err != nil {
		return Result{}, err
	}
	if o.Ranks < 2 {
		return Result{}, fmt.Errorf("fleetsim: want at least 2 ranks, got %d", o.Ranks)
	}
	if o.Clients <= 0 {
		o.Clients = max(1, (o.Ranks+24)/25)
	}
	o.Clients = min(o.Clients, o.Ranks)
	if o.Resolves <= 0 {
		o.Resolves = 10 * o.Ranks
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 16
	}
	if o.TTL <= 0 {
		o.TTL = metadata.DefaultTTL
	}
	if o.Timeout <= 0 {
		o.Timeout = metadata.DefaultTimeout
	}
	prefix := fmt.Sprintf("%s/sim-%x", u.Prefix, rand.Uint32())
	res := Result{URL: url, Ranks: o.Ranks, Clients: o.Clients, Resolves: o.Resolves}
	clis := make([]*clientv3.Client, o.Clients)
	defer func() {
		if clis[0] != nil {
			dctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
			_, _ = clis[0].Delete(dctx, prefix+"/", clientv3.WithPrefix())
			cancel()
		}
		for _, c := range clis {
			if c != nil {
				c.Close()
			}
		}
	}()
	for i := range clis {
		c, err := clientv3.New(clientv3.Config{Endpoints: u.Endpoints, DialTimeout: o.Timeout, Logger: zap.NewNop()})
		if err != nil {
			return res, fmt.Errorf("fleetsim: client %d: %w", i, err)
		}
		clis[i] = c
	}
	cctx, cancel := context.WithTimeout(ctx, o.Timeout)
	_, err = clis[0].Get(cctx, prefix+"/", clientv3.WithCountOnly())
	cancel()
	if err != nil {
		return res, fmt.Errorf("fleetsim: etcd at %s unreachable: %w: %v", u, transport.ErrMetadataUnavailable, err)
	}
	key := func(i int) string { return fmt.Sprintf("%s/segments/10.0.%d.%d:17000", prefix, i/250, i%250) }
	cli := func(i int) *clientv3.Client { return clis[i%len(clis)] }
	kctx, stopKeep := context.WithCancel(ctx)
	defer stopKeep()
	var keepWG sync.WaitGroup
	defer keepWG.Wait()
	defer stopKeep()

	// 1. Every rank at once: grant a lease, keep it alive, publish.
	leases := make([]clientv3.LeaseID, o.Ranks)
	var bytes atomic.Int64
	errs := make(chan error, o.Ranks)
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < o.Ranks; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 4*o.Timeout)
			defer cancel()
			c := cli(i)
			l, err := c.Grant(rctx, int64(o.TTL/time.Second))
			if err != nil {
				errs <- fmt.Errorf("rank %d: grant: %w", i, err)
				return
			}
			leases[i] = l.ID
			ch, err := c.KeepAlive(kctx, l.ID)
			if err != nil {
				errs <- fmt.Errorf("rank %d: keep alive: %w", i, err)
				return
			}
			keepWG.Add(1)
			go func() {
				defer keepWG.Done()
				for range ch {
				}
			}()
			v := simDescriptor(key(i), uint64(i+1), 64).Encode()
			bytes.Add(int64(len(v)))
			if _, err := c.Put(rctx, key(i), string(v), clientv3.WithLease(l.ID)); err != nil {
				errs <- fmt.Errorf("rank %d: put: %w", i, err)
			}
		}()
	}
	wg.Wait()
	res.RegisterAll = time.Since(start)
	res.KeysBytes = int(bytes.Load())
	select {
	case err := <-errs:
		return res, fmt.Errorf("fleetsim: registration: %w", err)
	default:
	}

	// 2. Lookups by name from concurrent workers.
	lat := make([]time.Duration, o.Resolves)
	var next atomic.Int64
	for w := 0; w < o.Concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for {
				n := int(next.Add(1) - 1)
				if n >= o.Resolves {
					return
				}
				i := r.IntN(o.Ranks)
				t0 := time.Now()
				rctx, cancel := context.WithTimeout(ctx, o.Timeout)
				resp, err := cli(n).Get(rctx, key(i))
				cancel()
				if err != nil {
					errs <- fmt.Errorf("resolve rank %d: %w", i, err)
					return
				}
				if len(resp.Kvs) != 1 {
					errs <- fmt.Errorf("resolve rank %d: its key is gone: its lease expired (this machine could not keep %d leases alive over %d clients; use fewer --clients or a shorter run)", i, o.Ranks, o.Clients)
					return
				}
				if _, err := transport.DecodeSegmentDescriptor(resp.Kvs[0].Value); err != nil {
					errs <- err
					return
				}
				lat[n] = time.Since(t0)
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return res, fmt.Errorf("fleetsim: %w", err)
	default:
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	res.ResolveP50, res.ResolveP99, res.ResolveMax = lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]

	// 3. Every other rank watches rank 0; rank 0 restarts.
	target := key(0)
	got := make([]time.Time, o.Ranks)
	var seen atomic.Int64
	allSeen := make(chan struct{})
	gctx, gcancel := context.WithTimeout(ctx, o.Timeout)
	g, err := clis[0].Get(gctx, target)
	gcancel()
	if err != nil {
		return res, fmt.Errorf("fleetsim: %w", err)
	}
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	ready := make(chan struct{}, o.Ranks)
	for i := 1; i < o.Ranks; i++ {
		wch := cli(i).Watch(clientv3.WithRequireLeader(wctx), target, clientv3.WithRev(g.Header.Revision+1), clientv3.WithCreatedNotify())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for wr := range wch {
				if wr.Created {
					ready <- struct{}{}
					continue
				}
				for _, ev := range wr.Events {
					if ev.Type == clientv3.EventTypePut {
						if d, err := transport.DecodeSegmentDescriptor(ev.Kv.Value); err == nil && d.Epoch != 1 {
							got[i] = time.Now()
							if seen.Add(1) == int64(o.Ranks-1) {
								close(allSeen)
							}
							return
						}
					}
				}
			}
		}()
	}
	for i := 1; i < o.Ranks; i++ {
		select {
		case <-ready:
		case <-time.After(4 * o.Timeout):
			stopWatch()
			wg.Wait()
			return res, fmt.Errorf("fleetsim: only %d of %d watches created", i-1, o.Ranks-1)
		}
	}
	res.Watchers = o.Ranks - 1
	rctx, rcancel := context.WithTimeout(ctx, o.Timeout)
	var restart time.Time
	l, err := clis[0].Grant(rctx, int64(o.TTL/time.Second))
	if err == nil {
		restart = time.Now()
		_, err = clis[0].Put(rctx, target, string(simDescriptor(target, 99, 64).Encode()), clientv3.WithLease(l.ID))
		if err == nil {
			select {
			case <-allSeen:
				res.InvalidateAll = time.Since(restart)
			case <-time.After(4 * o.Timeout):
				err = fmt.Errorf("%d of %d watchers saw the restart", seen.Load(), o.Ranks-1)
			}
		}
	}
	rcancel()
	stopWatch()
	wg.Wait()
	if err != nil {
		return res, fmt.Errorf("fleetsim: restart fan-out: %w", err)
	}
	var ds []time.Duration
	for i := 1; i < o.Ranks; i++ {
		if !got[i].IsZero() {
			ds = append(ds, got[i].Sub(restart))
		}
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	if len(ds) > 0 {
		res.InvalidateP50 = ds[len(ds)/2]
	}
	// Revoke the ranks' leases (their keys go with them).
	for i, id := range leases {
		if id == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
			_, _ = cli(i).Revoke(rctx, id)
			cancel()
		}()
	}
	wg.Wait()
	return res, nil
}
