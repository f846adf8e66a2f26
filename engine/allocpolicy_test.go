package engine_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// waitEvent waits until room's timeline on m has an event whose detail
// contains what.
func waitEvent(t *testing.T, m *engine.Manager, room uint64, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if tl, ok := m.RoomTimeline(room); ok {
			for _, e := range tl.Events {
				if strings.Contains(e.Detail, what) {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			tl, _ := m.RoomTimeline(room)
			t.Fatalf("room %d on %s: no %q event within 20 s; timeline %+v", room, m.Endpoint(), what, tl.Events)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func prefillComplete(o *rankOpts) { o.policy = bootstrap.PolicyPrefillComplete }

// TestPrefillCompleteReservesNothingUntilComputed: under the
// prefill_complete decode allocation policy a decode subscribes to each
// producer once it resolved the room and stays Bootstrapping, holding no
// metadata slot and sending no TRANSFER (even with its pages given early),
// until every producer's sender was marked complete; then the room runs as
// under "early" and every byte lands (checksum on). With two producers
// (prefill TP 2 -> decode TP 1) the decode waits for both.
func TestPrefillCompleteReservesNothingUntilComputed(t *testing.T) {
	for _, ptp := range []int{1, 2} {
		t.Run(fmt.Sprintf("prefill tp %d", ptp), func(t *testing.T) {
			addr, pre, dec := topologyWith(t, smallGQA, ptp, 1, 1, func(o *rankOpts) {
				prefillComplete(o)
				o.checksum = o.role == engine.RoleDecode
			})
			d := dec[0]
			const room, pages = 77, 5
			r, err := d.m.NewReceiver(addr, room)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			var senders []*engine.Sender
			var srcs [][]int32
			for _, p := range pre {
				s, err := p.m.NewSender(room)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				src, err := p.pool.Alloc(pages)
				if err != nil {
					t.Fatal(err)
				}
				if err := workload.FillPattern(p.pool, room, src, 0); err != nil {
					t.Fatal(err)
				}
				senders, srcs = append(senders, s), append(srcs, src)
				waitEvent(t, p.m, room, "SUBSCRIBE received")
			}
			if st := r.Poll(); st != engine.KVBootstrapping || d.m.Ring().InUse() != 0 {
				t.Fatalf("decode before the prefill computed: %s, %d ring slots in use; want Bootstrapping and none", st, d.m.Ring().InUse())
			}
			dst, err := d.pool.Alloc(pages)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.SendMetadata(dst, 0, nil, 0); err != nil {
				t.Fatal(err)
			}
			if err := senders[0].MarkPrefillComplete(); err != nil {
				t.Fatal(err)
			}
			waitEvent(t, d.m, room, "SUBSCRIBE sent")
			if ptp == 2 {
				// One producer computed, the other not: still nothing reserved.
				time.Sleep(50 * time.Millisecond)
				if st := r.Poll(); st != engine.KVBootstrapping || d.m.Ring().InUse() != 0 || senders[1].Poll() != engine.KVBootstrapping {
					t.Fatalf("one of two producers computed: decode %s with %d slots, second sender %s; want Bootstrapping, none, Bootstrapping", st, d.m.Ring().InUse(), senders[1].Poll())
				}
				if err := senders[1].MarkPrefillComplete(); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			for i, s := range senders {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
						t.Errorf("sender %d: %s %v", i, st, s.Failure())
						return
					}
					if _, err := s.InitTokens(pages*d.m.PageSize(), 0); err != nil {
						t.Error(err)
						return
					}
					if err := s.Send(srcs[i], true); err != nil {
						t.Error(err)
						return
					}
					if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
						t.Errorf("sender %d: %s %v", i, st, s.Failure())
					}
				}()
			}
			if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
				t.Fatalf("receiver %s %v", st, r.Failure())
			}
			if err := workload.VerifyPattern(d.pool, room, dst, 0); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
		})
	}
}

// TestPrefillCompleteBootstrapClock: under prefill_complete a sender's
// bootstrap timeout counts from MarkPrefillComplete, not from its creation:
// a sender still being computed past the timeout is not failed, and one
// marked complete that no decode asks for fails with ErrTimeout naming the
// completion.
func TestPrefillCompleteBootstrapClock(t *testing.T) {
	addr := startBootstrap(t)
	p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, addr: addr, policy: bootstrap.PolicyPrefillComplete, bootTmo: time.Second})
	s, err := p.m.NewSender(5)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	time.Sleep(2 * time.Second) // computing, past the bootstrap timeout
	if st := s.Poll(); st != engine.KVBootstrapping {
		t.Fatalf("sender not marked complete after twice its bootstrap timeout: %s %v, want Bootstrapping", st, s.Failure())
	}
	if err := s.MarkPrefillComplete(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrTimeout) || !strings.Contains(s.Failure().Error(), "after MarkPrefillComplete") {
		t.Fatalf("sender %s %v, want Failed/ErrTimeout after MarkPrefillComplete", st, s.Failure())
	}
	if err := s.MarkPrefillComplete(); err == nil || !strings.Contains(err.Error(), "already failed") {
		t.Fatalf("MarkPrefillComplete on a failed sender: %v", err)
	}
}

// TestPrefillCompleteRefusals: a decode under prefill_complete refuses a
// prefill instance declaring "early" naming both policies, and the prefill
// learns it at once; a prefill that never reports the request computed fails
// the room at the decode's waiting timeout on both sides.
func TestPrefillCompleteRefusals(t *testing.T) {
	t.Run("policy mismatch", func(t *testing.T) {
		addr := startBootstrap(t)
		p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, addr: addr})
		d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, policy: bootstrap.PolicyPrefillComplete})
		s, err := p.m.NewSender(8)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		failsNaming(t, addr, d, 8, "decode allocation policy mismatch", `declares "early"`, `this decode runs "prefill_complete"`)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(s.Failure().Error(), "policy mismatch") {
			t.Fatalf("sender %s %v: want Failed naming the mismatch", st, s.Failure())
		}
	})
	t.Run("never computed", func(t *testing.T) {
		addr, pre, dec := topologyWith(t, smallGQA, 1, 1, 1, func(o *rankOpts) {
			prefillComplete(o)
			if o.role == engine.RoleDecode {
				o.waiting = 1500 * time.Millisecond
			}
		})
		s, err := pre[0].m.NewSender(9)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		failsNaming(t, addr, dec[0], 9, "did not report the request computed within the waiting timeout", pre[0].m.Endpoint())
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrAborted) {
			t.Fatalf("sender %s %v: want Failed, aborted by the decode", st, s.Failure())
		}
		if err := s.MarkPrefillComplete(); err == nil {
			t.Fatal("MarkPrefillComplete on a failed sender succeeded")
		}
	})
	t.Run("subscription before the sender, sender fails", func(t *testing.T) {
		// The decode subscribes before the prefill has the request; the
		// prefill then aborts it: the waiting decode fails at once with the
		// prefill's reason.
		addr, pre, dec := topologyWith(t, smallGQA, 1, 1, 1, prefillComplete)
		r, err := dec[0].m.NewReceiver(addr, 10)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		waitEvent(t, dec[0].m, 10, "SUBSCRIBE sent")
		s, err := pre[0].m.NewSender(10)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		waitEvent(t, pre[0].m, 10, "SUBSCRIBE received")
		s.AbortWith(errors.New("no KV pages for this prompt"))
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), "no KV pages for this prompt") {
			t.Fatalf("receiver %s %v: want Failed with the prefill's reason", st, r.Failure())
		}
	})
	t.Run("decode closes while waiting", func(t *testing.T) {
		addr, pre, dec := topologyWith(t, smallGQA, 1, 1, 1, prefillComplete)
		s, err := pre[0].m.NewSender(11)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		r, err := dec[0].m.NewReceiver(addr, 11)
		if err != nil {
			t.Fatal(err)
		}
		waitEvent(t, pre[0].m, 11, "SUBSCRIBE received")
		dec[0].m.Close()
		r.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
			t.Fatalf("sender after its decode closed: %s, want Failed", st)
		}
	})
}

// helperPrefillComplete is a prefill rank under prefill_complete in its own
// process: it creates the sender of KVX_ROOM, prints READY, marks the room
// complete when a line "mark" arrives on stdin and prints MARKED, then hangs
// until killed.
func helperPrefillComplete() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	m, _, room, err := helperManager(ctx, 64, bootstrap.PolicyPrefillComplete)
	if err != nil {
		return err
	}
	s, err := m.NewSender(room)
	if err != nil {
		return err
	}
	fmt.Println("READY")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "mark" {
			if err := s.MarkPrefillComplete(); err != nil {
				return err
			}
			fmt.Println("MARKED")
		}
	}
	<-ctx.Done() // hang until killed
	return nil
}

// TestPrefillCompletePrefillKilled: a prefill process under prefill_complete
// SIGKILLed before it marked the room complete (the decode waiting to
// reserve) or after (the decode WaitingForInput, no TRANSFER yet): the
// decode fails the room with ErrPeerLost instead of waiting out its waiting
// timeout.
func TestPrefillCompletePrefillKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	for _, afterMark := range []bool{false, true} {
		t.Run(fmt.Sprintf("after mark %v", afterMark), func(t *testing.T) {
			addr := startBootstrap(t)
			d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, policy: bootstrap.PolicyPrefillComplete, waiting: 60 * time.Second})
			room := uint64(900 + map[bool]uint64{false: 0, true: 1}[afterMark])
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "KVX_TEST_HELPER=prefill-complete", "KVX_ROOM="+strconv.FormatUint(room, 10), "KVX_BOOTSTRAP="+addr)
			cmd.Stderr = os.Stderr
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
			lines := make(chan string, 4)
			go func() {
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					lines <- sc.Text()
				}
				close(lines)
			}()
			expect := func(want string) {
				select {
				case l, ok := <-lines:
					if !ok || l != want {
						t.Fatalf("helper printed %q (open %v), want %s", l, ok, want)
					}
				case <-time.After(60 * time.Second):
					t.Fatalf("helper did not print %s within 60 s", want)
				}
			}
			expect("READY")
			r, err := d.m.NewReceiver(addr, room)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			waitEvent(t, d.m, room, "SUBSCRIBE sent")
			if afterMark {
				if _, err := io.WriteString(stdin, "mark\n"); err != nil {
					t.Fatal(err)
				}
				expect("MARKED")
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				st := r.Wait(ctx, engine.KVWaitingForInput)
				cancel()
				if st != engine.KVWaitingForInput {
					t.Fatalf("decode after the mark: %s %v, want WaitingForInput", st, r.Failure())
				}
			} else if r.Poll() != engine.KVBootstrapping {
				t.Fatalf("decode before the mark: %s, want Bootstrapping", r.Poll())
			}
			start := time.Now()
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(r.Failure(), transport.ErrPeerLost) {
				t.Fatalf("decode after the prefill was killed: %s %v, want Failed/ErrPeerLost", st, r.Failure())
			}
			t.Logf("decode failed %s after SIGKILL: %v", time.Since(start).Round(time.Millisecond), r.Failure())
		})
	}
}
