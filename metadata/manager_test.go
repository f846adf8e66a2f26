package metadata_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/metadata"
	"github.com/kvxfer/kvxfer/workload"
)

var tinyModel = workload.ModelConfig{Name: "tiny-gqa", NumLayers: 2, NumKVHeads: 2, HeadDim: 16, DtypeBytes: 2}

func init() { helpers["prefill"] = helperPrefill }

// newManager starts a KV manager rank publishing in store.
func newManager(role engine.Role, store *metadata.Store, bootstrapAddr string) (*engine.Manager, *workload.KVBuffers, error) {
	l, err := workload.NewLayout(tinyModel, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 64})
	if err != nil {
		return nil, nil, err
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "meta-test", Device: -1, Aux: workload.DefaultAux, AuxRows: 8})
	if err != nil {
		return nil, nil, err
	}
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := engine.NewManager(ctx, engine.ManagerConfig{Role: role, KV: pool.Args(), Transports: []transport.Transport{tr},
		BootstrapAddr: bootstrapAddr, Directory: store,
		// Long enough that only the directory can explain a fast failure.
		PeerTimeout: 60 * time.Second, BootstrapTimeout: 30 * time.Second, WaitingTimeout: 120 * time.Second,
		BootstrapHeartbeatInterval: -1})
	if err != nil {
		return nil, nil, err
	}
	return m, pool, nil
}

// helperPrefill runs a prefill rank published in etcd, waits for the
// decode's request of room $KVX_ROOM (READY once the sender exists) and
// never sends.
func helperPrefill() error {
	store, err := metadata.Open(context.Background(), os.Getenv("KVX_URL"), metadata.Options{TTL: testTTL})
	if err != nil {
		return err
	}
	m, _, err := newManager(engine.RolePrefill, store, os.Getenv("KVX_BOOTSTRAP"))
	if err != nil {
		return err
	}
	room, _ := strconv.ParseUint(os.Getenv("KVX_ROOM"), 10, 64)
	s, err := m.NewSender(room)
	if err != nil {
		return err
	}
	fmt.Println("READY 0")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		return fmt.Errorf("sender %s: %v", st, s.Failure())
	}
	select {}
}

// TestManagerPeerPausedFailsFast: a prefill rank that hangs (SIGSTOP: its
// sockets stay open, so the control channel sees nothing) loses its lease;
// the decode's room fails within about the TTL, naming etcd, instead of
// after the 60 s peer timeout; `kvxfer fleet`'s report shows the instance
// and then the rank's segment as absent (stale).
func TestManagerPeerPausedFailsFast(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	url := sharedURL(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := server.New(server.Options{Host: "127.0.0.1", Port: 0})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	}
	addr := srv.Addr()
	pubStore := open(t, url)
	go pubStore.PublishInstanceLoop(ctx, addr, srv.Snapshot, 50*time.Millisecond, time.Second)

	dstore := open(t, url)
	d, pool, err := newManager(engine.RoleDecode, dstore, "")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	const room = 777
	p := startChild(t, "prefill", "KVX_URL="+url, "KVX_BOOTSTRAP="+addr, "KVX_ROOM="+strconv.Itoa(room))
	r, err := d.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pages, _ := pool.Alloc(4)
	if err := r.Init(pages); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "receiver past bootstrapping", func() bool { return r.Poll() >= engine.KVWaitingForInput })
	// The fleet report lists the instance, ready, with its rank live.
	var rep metadata.FleetReport
	waitFor(t, 20*time.Second, "fleet report with the ready instance", func() bool {
		rep, err = dstore.Fleet(context.Background(), time.Now())
		return err == nil && len(rep.Instances) == 1 && rep.Instances[0].Ready && len(rep.Instances[0].Ranks) == 1 && rep.Instances[0].Ranks[0].Segment == "live"
	})
	t.Logf("before the pause:\n%s", metadata.FormatFleet(rep))
	if rep.Segments["prefill"] != 1 || rep.Segments["decode"] != 1 {
		t.Fatalf("segments by kind %v, want one prefill and one decode", rep.Segments)
	}

	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	st := r.Wait(wctx, engine.KVSuccess)
	took := time.Since(paused)
	if st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) || !strings.Contains(r.Failure().Error(), "vanished") {
		t.Fatalf("receiver after the prefill paused: %s %v; want Failed by the directory", st, r.Failure())
	}
	t.Logf("decode room failed %v after SIGSTOP of the prefill (TTL %v, peer timeout 60 s): %v", took.Round(time.Millisecond), testTTL, r.Failure())
	if took > 20*time.Second {
		t.Fatalf("took %v", took)
	}
	waitFor(t, 10*time.Second, "fleet report shows the rank's segment absent", func() bool {
		rep, err = dstore.Fleet(context.Background(), time.Now())
		return err == nil && len(rep.Instances) == 1 && len(rep.Instances[0].Ranks) == 1 && rep.Instances[0].Ranks[0].Segment == "absent" && rep.Stale > 0
	})
	t.Logf("after the pause:\n%s", metadata.FormatFleet(rep))
}
