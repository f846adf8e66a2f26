package metadata_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
	"github.com/kvxfer/kvxfer/metadata"
)

// testTTL is the lease TTL of the fault tests: short, above etcd's minimum
// with the test cluster's raft timers.
const testTTL = 2 * time.Second

var (
	sharedOnce sync.Once
	shared     *etcdtest.Cluster
	prefixSeq  int
	prefixMu   sync.Mutex
)

// sharedURL returns a URL on a one-node etcd shared by the package's
// non-destructive tests, under a prefix of its own.
func sharedURL(t *testing.T) string {
	t.Helper()
	etcdtest.Require(t)
	sharedOnce.Do(func() { shared = etcdtest.StartShared(t, etcdtest.Options{}) })
	prefixMu.Lock()
	prefixSeq++
	p := fmt.Sprintf("t%d", prefixSeq)
	prefixMu.Unlock()
	return shared.URL(p)
}

func open(t *testing.T, url string, mod ...func(*metadata.Options)) *metadata.Store {
	t.Helper()
	o := metadata.Options{TTL: testTTL, Timeout: 3 * time.Second}
	for _, m := range mod {
		m(&o)
	}
	s, err := metadata.Open(context.Background(), url, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func desc(name string, epoch uint64) transport.SegmentDescriptor {
	return transport.SegmentDescriptor{Name: name, Epoch: epoch, RPC: "127.0.0.1:1", Kind: "engine",
		Transports: []transport.SegmentTransport{{Name: "tcp", Endpoint: []byte("127.0.0.1:2")}},
		Regions:    []transport.RegionDesc{{ID: 1, Addr: 4096, Length: 4096}}}
}

// events collects watch events.
type events struct {
	mu sync.Mutex
	ev []transport.SegmentEvent
}

func (e *events) add(ev transport.SegmentEvent) { e.mu.Lock(); e.ev = append(e.ev, ev); e.mu.Unlock() }

// waitFor polls until cond holds or the deadline passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}

func (e *events) count(pred func(transport.SegmentEvent) bool) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, ev := range e.ev {
		if pred(ev) {
			n++
		}
	}
	return n
}

func TestOpenUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close()
	start := time.Now()
	_, err = metadata.Open(context.Background(), "etcd://"+dead+",127.0.0.1:1/x", metadata.Options{Timeout: time.Second})
	if !errors.Is(err, transport.ErrMetadataUnavailable) || !strings.Contains(err.Error(), dead) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("err = %v; want ErrMetadataUnavailable naming both endpoints", err)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("took %v with a 1 s timeout", el)
	}
	t.Logf("%v", err)
}

func TestPublishResolveWatch(t *testing.T) {
	url := sharedURL(t)
	a, b := open(t, url), open(t, url)
	ctx := context.Background()
	if _, _, err := b.Resolve(ctx, "seg-a"); !errors.Is(err, transport.ErrSegmentNotFound) || !strings.Contains(err.Error(), "seg-a") {
		t.Fatalf("resolve before publish: %v", err)
	}
	if err := a.Publish(ctx, desc("seg-a", 7)); err != nil {
		t.Fatal(err)
	}
	d, rev, err := b.Resolve(ctx, "seg-a")
	if err != nil || d.Epoch != 7 || d.Regions[0].Addr != 4096 {
		t.Fatalf("resolve: %+v %v", d, err)
	}
	var ev events
	stop := b.Watch("seg-a", rev, ev.add)
	defer stop()
	if err := a.Publish(ctx, desc("seg-a", 8)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "PUT event with epoch 8", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return !e.Deleted && e.Desc.Epoch == 8 }) == 1
	})
	if err := a.Unpublish(ctx, "seg-a"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "DELETE event", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return e.Deleted }) == 1
	})
	// Close revokes the lease: everything a process published vanishes.
	if err := a.Publish(ctx, desc("seg-a2", 1)); err != nil {
		t.Fatal(err)
	}
	a.Close()
	if _, _, err := b.Resolve(ctx, "seg-a2"); !errors.Is(err, transport.ErrSegmentNotFound) {
		t.Fatalf("after Close (lease revoked): %v", err)
	}
	segs, _, err := b.Segments(ctx)
	if err != nil || len(segs) != 0 {
		t.Fatalf("segments after close: %v %v", segs, err)
	}
}

// TestLeaseExpiryOfPartitionedPublisher: a publisher cut off from etcd (a
// proxy it talks through blocks) loses its lease: its key vanishes within
// the TTL and watchers see it; when the partition heals it grants a new
// lease and publishes again by itself.
func TestLeaseExpiryOfPartitionedPublisher(t *testing.T) {
	etcdtest.Require(t)
	c := etcdtest.Start(t, etcdtest.Options{})
	proxy := etcdtest.NewProxy(t, c.Members[0].Addr())
	pub := open(t, "etcd://"+proxy.Addr()+"/lease")
	watcher := open(t, c.URL("lease"))
	ctx := context.Background()
	if err := pub.Publish(ctx, desc("p", 42)); err != nil {
		t.Fatal(err)
	}
	_, rev, err := watcher.Resolve(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	var ev events
	defer watcher.Watch("p", rev, ev.add)()
	proxy.Block()
	blocked := time.Now()
	gone := waitFor(t, testTTL+10*time.Second, "key gone after the publisher's lease expired", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return e.Deleted }) == 1
	})
	t.Logf("partitioned publisher's key vanished %v after the block (TTL %v)", gone, testTTL)
	if time.Since(blocked) < testTTL-500*time.Millisecond {
		t.Fatalf("key vanished after %v, before the TTL %v", time.Since(blocked), testTTL)
	}
	proxy.Unblock()
	back := waitFor(t, 30*time.Second, "publisher re-published after the partition healed", func() bool {
		return ev.count(func(e transport.SegmentEvent) bool { return !e.Deleted && e.Desc.Epoch == 42 }) == 1
	})
	t.Logf("re-published %v after the partition healed", back)
	if pub.LeaseLosses() < 1 {
		t.Fatalf("LeaseLosses = %d, want >= 1", pub.LeaseLosses())
	}
	if d, _, err := watcher.Resolve(ctx, "p"); err != nil || d.Epoch != 42 {
		t.Fatalf("resolve after recovery: %+v %v", d, err)
	}
}

// newEngine starts a TransferEngine on tr with store as its directory.
func newEngine(t *testing.T, transportName, name string, store transport.SegmentDirectory) *segengine.TransferEngine {
	t.Helper()
	tr, err := transport.OpenTransport(transportName, transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	te, err := segengine.NewTransferEngine(context.Background(), segengine.TransferEngineConfig{Transport: tr, SegmentName: name, Directory: store, RPCTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.Close() })
	return te
}

func reg(t *testing.T, te *segengine.TransferEngine, n int64) *transport.HostBuffer {
	t.Helper()
	b, err := transport.AllocHost("t", n)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := te.RegisterMemory(b.Memory()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func write(seg *segengine.RemoteSegment, local uintptr, peer uint64, n uint64) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	id, err := seg.SubmitPeerWrites(ctx, []segengine.PeerWrite{{Local: local, PeerAddr: peer, Length: n}})
	if err != nil {
		return err
	}
	defer seg.Release(id)
	st, err := seg.Wait(ctx, id)
	if err != nil {
		return err
	}
	if st.State != transport.BatchCompleted {
		return st.Err
	}
	return nil
}

// TestTransferEngineOverEtcd: names resolve through etcd (any name, not
// host:port), and a restart behind a name invalidates the open segment at
// once through the watch.
func TestTransferEngineOverEtcd(t *testing.T) {
	url := sharedURL(t)
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			name := "decode-0-" + tn
			recv := newEngine(t, tn, name, open(t, url))
			send := newEngine(t, tn, "prefill-0-"+tn, open(t, url))
			dst := reg(t, recv, 1<<20)
			src := reg(t, send, 1<<20)
			for i := range src.Bytes() {
				src.Bytes()[i] = byte(i * 3)
			}
			seg, err := send.OpenSegment(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if err := write(seg, src.Addr(), uint64(dst.Addr())+100, 5000); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.Bytes()[100:5100], src.Bytes()[:5000]) {
				t.Fatal("bytes differ")
			}
			// Memory registered later is republished and found on a miss.
			late := reg(t, recv, 1<<16)
			if err := write(seg, src.Addr(), uint64(late.Addr()), 4096); err != nil {
				t.Fatalf("write to memory registered after the open: %v", err)
			}
			// Restart: the same name with a new epoch.
			oldEpoch := recv.Epoch()
			recv.Close()
			again := newEngine(t, tn, name, open(t, url))
			took := waitFor(t, 10*time.Second, "segment invalidated after the peer restarted", func() bool { return seg.Err() != nil })
			t.Logf("invalidated %v after the restart: %v", took, seg.Err())
			if !errors.Is(seg.Err(), segengine.ErrSegmentStale) {
				t.Fatalf("Err() = %v", seg.Err())
			}
			err = write(seg, src.Addr(), uint64(dst.Addr()), 64)
			if !errors.Is(err, segengine.ErrSegmentStale) || !errors.Is(err, transport.ErrPeerLost) {
				t.Fatalf("write on the stale segment: %v", err)
			}
			_ = oldEpoch
			seg2, err := send.OpenSegment(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			defer seg2.Close()
			if seg2.Epoch() != again.Epoch() {
				t.Fatalf("reopened epoch %#x, want %#x", seg2.Epoch(), again.Epoch())
			}
			nd := reg(t, again, 4096)
			if err := write(seg2, src.Addr(), uint64(nd.Addr()), 4096); err != nil {
				t.Fatal(err)
			}
			if _, err := send.OpenSegment(context.Background(), "no-such-segment"); !errors.Is(err, transport.ErrSegmentNotFound) {
				t.Fatalf("open of an unknown name: %v", err)
			}
		})
	}
}
