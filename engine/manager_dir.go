package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// The KV manager's use of a SegmentDirectory (ManagerConfig.Directory, e.g.
// etcd): the rank publishes a segment descriptor named by its control
// address "host:port" (epoch = Manager.Epoch, kind = its role, regions = its
// registered buffers) under the directory's lease, and watches the
// descriptors of the peers it works with. When a peer's descriptor vanishes
// (its lease expired: the process crashed, hangs or is partitioned) or
// changes epoch (it restarted), the peer is lost at once: its rooms fail
// with ErrPeerLost naming the directory, and its cached connection,
// registration and bootstrap entries are dropped so the next room
// reconnects — without waiting for PeerTimeout or a bootstrap heartbeat.
// A peer that does not publish (started without a directory) is not
// watched; the control-channel checks still apply.

// segDirState is the manager's directory state.
type segDirState struct {
	mu      sync.Mutex
	watches map[string]*peerWatch // by peer control endpoint
	done    bool
}

type peerWatch struct {
	stop   func() // nil until the watch runs
	cancel context.CancelFunc
}

// segmentName returns the rank's segment name: its control "host:port".
func (m *Manager) segmentName() string { return strings.TrimPrefix(m.endpoint, "tcp://") }

// publishSegment publishes the rank's descriptor (NewManager; nil without
// a directory). Errors name the directory (etcd unreachable at start).
func (m *Manager) publishSegment(ctx context.Context) error {
	dir := m.cfg.Directory
	if dir == nil {
		return nil
	}
	host, _ := os.Hostname()
	d := transport.SegmentDescriptor{Name: m.segmentName(), Epoch: m.epoch, Kind: m.cfg.Role.String(), Hostname: host, PID: os.Getpid()}
	for _, dev := range strings.Split(m.cfg.KV.IBDevice, ",") {
		if dev = strings.TrimSpace(dev); dev != "" {
			d.Devices = append(d.Devices, dev)
		}
	}
	for _, b := range m.cfg.KV.KVBuffers {
		if b.Kind == transport.MemoryCUDA {
			d.Devices = append(d.Devices, fmt.Sprintf("cuda:%d", b.Device))
			break
		}
	}
	for _, r := range m.regs {
		// Endpoints travel per peer in REGISTER; the descriptor lists the
		// transports for listings.
		d.Transports = append(d.Transports, transport.SegmentTransport{Name: r.t.Name(), PerPeer: true})
	}
	if len(m.regs) > 0 {
		d.Regions = transport.SortedRegions(m.regs[0].all())
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := dir.Publish(pctx, d); err != nil {
		return fmt.Errorf("engine: %s rank %s: publish its segment in %s: %w", m.cfg.Role, d.Name, dir, err)
	}
	return nil
}

// watchPeer starts watching a peer's descriptor (once per peer until it is
// lost). The directory lookup runs in the background.
func (m *Manager) watchPeer(ep string) {
	dir := m.cfg.Directory
	if dir == nil {
		return
	}
	st := &m.segdir
	st.mu.Lock()
	if st.done || st.watches[ep] != nil {
		st.mu.Unlock()
		return
	}
	if st.watches == nil {
		st.watches = map[string]*peerWatch{}
	}
	ctx, cancel := context.WithCancel(m.life)
	w := &peerWatch{cancel: cancel}
	st.watches[ep] = w
	st.mu.Unlock()
	go m.startPeerWatch(ctx, ep, w)
}

// startPeerWatch resolves the peer's descriptor (retrying while the
// directory is unreachable) and watches it from that revision on.
func (m *Manager) startPeerWatch(ctx context.Context, ep string, w *peerWatch) {
	dir := m.cfg.Directory
	name := strings.TrimPrefix(ep, "tcp://")
	var (
		d   transport.SegmentDescriptor
		rev int64
		err error
	)
	for backoff := 200 * time.Millisecond; ; backoff = min(2*backoff, 5*time.Second) {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		d, rev, err = dir.Resolve(rctx, name)
		cancel()
		if err == nil {
			break
		}
		if errors.Is(err, transport.ErrSegmentNotFound) {
			m.log.Debug("peer publishes no segment; not watched", "peer", ep, "directory", dir)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
	epoch := d.Epoch
	stop := dir.Watch(name, rev, func(ev transport.SegmentEvent) {
		var err error
		hung := false // a restarted peer is gone; a vanished one may only hang
		switch {
		case ev.Deleted:
			err = fmt.Errorf("%w: %s: its segment vanished from %s (lease expired: the process crashed, hangs or is partitioned)", transport.ErrPeerLost, m.peerName(ep), dir)
			hung = true
		case ev.Desc.Epoch != epoch:
			err = fmt.Errorf("%w: %s restarted (epoch %d → %d in %s)", transport.ErrPeerLost, m.peerName(ep), epoch, ev.Desc.Epoch, dir)
		default:
			return
		}
		m.met.peerLost(m.cfg.Role, "directory")
		go m.peerLost(ep, hung, err)
	})
	st := &m.segdir
	st.mu.Lock()
	if st.done || st.watches[ep] != w {
		st.mu.Unlock()
		stop()
		return
	}
	w.stop = stop
	st.mu.Unlock()
}

// unwatchPeerAsync forgets a lost peer's watch at once (so a new
// connection to the same endpoint watches afresh) and stops it without
// waiting (peerLost holds m.mu).
func (m *Manager) unwatchPeerAsync(ep string) {
	if m.cfg.Directory == nil {
		return
	}
	st := &m.segdir
	st.mu.Lock()
	w := st.watches[ep]
	delete(st.watches, ep)
	st.mu.Unlock()
	if w != nil {
		w.cancel()
		go func() {
			st.mu.Lock()
			stop := w.stop
			st.mu.Unlock()
			if stop != nil {
				stop()
			}
		}()
	}
}

// stopSegmentDirectory stops every watch and removes the rank's descriptor
// (teardown).
func (m *Manager) stopSegmentDirectory() {
	dir := m.cfg.Directory
	if dir == nil {
		return
	}
	st := &m.segdir
	st.mu.Lock()
	if st.done {
		st.mu.Unlock()
		return
	}
	st.done = true
	ws := st.watches
	st.watches = nil
	st.mu.Unlock()
	for _, w := range ws {
		w.cancel()
		if w.stop != nil {
			w.stop()
		}
	}
	if m.endpoint != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := dir.Unpublish(ctx, m.segmentName()); err != nil {
			m.log.Debug("could not remove the rank's segment from the directory; it expires with the lease", "err", err)
		}
		cancel()
	}
}
