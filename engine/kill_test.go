package engine_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// TestMain lets the test binary act as a prefill rank in its own process
// (KVX_TEST_HELPER=prefill) so that tests can kill a real peer.
func TestMain(m *testing.M) {
	if h := os.Getenv("KVX_TEST_HELPER"); h != "" {
		run := map[string]func() error{"prefill": helperPrefill, "prefill-complete": helperPrefillComplete}[h]
		if run == nil {
			fmt.Fprintln(os.Stderr, "helper: unknown KVX_TEST_HELPER", h)
			os.Exit(2)
		}
		if err := run(); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperManager is a helper process's prefill rank (tcp, KVX_BOOTSTRAP's
// directory, the given decode allocation policy) and the room it serves
// (KVX_ROOM); ctx ends after 60 s.
func helperManager(ctx context.Context, pages int, policy string) (*engine.Manager, *workload.KVBuffers, uint64, error) {
	room, err := strconv.ParseUint(os.Getenv("KVX_ROOM"), 10, 64)
	if err != nil {
		return nil, nil, 0, err
	}
	l, err := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: pages})
	if err != nil {
		return nil, nil, 0, err
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "helper", Device: -1, Aux: workload.DefaultAux, AuxRows: 16})
	if err != nil {
		return nil, nil, 0, err
	}
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		return nil, nil, 0, err
	}
	m, err := engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RolePrefill, KV: pool.Args(), Transports: []transport.Transport{tr},
		BootstrapAddr: os.Getenv("KVX_BOOTSTRAP"), BootstrapTimeout: 30 * time.Second, DecodeAllocationPolicy: policy})
	return m, pool, room, err
}

// helperPrefill registers a prefill rank, sends the first half of the room's
// pages, prints SENT and then hangs until killed.
func helperPrefill() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	m, pool, room, err := helperManager(ctx, 256, "")
	if err != nil {
		return err
	}
	s, err := m.NewSender(room)
	if err != nil {
		return err
	}
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		return fmt.Errorf("sender %s: %v", st, s.Failure())
	}
	src, err := pool.Alloc(s.DstPages())
	if err != nil {
		return err
	}
	if err := workload.FillPattern(pool, room, src, 0); err != nil {
		return err
	}
	if err := s.Send(src[:len(src)/2], false); err != nil {
		return err
	}
	fmt.Println("SENT")
	<-ctx.Done() // hang until killed
	return nil
}

// helperPrefillStarted starts the helper prefill (helperPrefill) for room in
// its own process, with a decode receiver r of d already in Transferring for
// 64 pages, and returns once the helper sent half of them. The process is
// killed (after SIGCONT) when the test ends.
func helperPrefillStarted(t *testing.T, addr string, d *rank, room uint64) (*exec.Cmd, *engine.Receiver) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVX_TEST_HELPER=prefill", "KVX_ROOM="+strconv.FormatUint(room, 10), "KVX_BOOTSTRAP="+addr)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	pages, _ := d.pool.Alloc(64)
	if err := r.Init(pages); err != nil {
		t.Fatal(err)
	}
	sent := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == "SENT" {
				sent <- nil
				return
			}
		}
		sent <- errors.New("helper exited before sending")
	}()
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("helper prefill did not start sending within 60 s")
	}
	if p := r.Poll(); p != engine.KVTransferring {
		t.Fatalf("receiver state %s once the helper sent, want Transferring", p)
	}
	return cmd, r
}

func TestPeerKilledMidTransfer(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	addr := startBootstrap(t)
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, pages: 256})
	cmd, r := helperPrefillStarted(t, addr, d, 424242)
	start := time.Now()
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st := r.Wait(ctx, engine.KVSuccess)
	if st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) {
		t.Fatalf("receiver after the prefill was killed: %s %v, want Failed/ErrPeerLost", st, r.Failure())
	}
	t.Logf("decode failed %s after SIGKILL of the prefill: %v", time.Since(start).Round(time.Millisecond), r.Failure())
}
