package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/agent"
	"github.com/kvxfer/kvxfer/engine/faulty"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// KV layout of the tests: regions (one per K or V buffer of a layer) of
// numBlocks blocks of blockLen bytes each, as vLLM's NixlConnector
// registers them; descriptor index = region*numBlocks + block.
const (
	numRegions = 4
	numBlocks  = 16
	blockLen   = 4096
)

func openTransport(t testing.TB, name string) transport.Transport {
	t.Helper()
	tr, err := transport.OpenTransport(name, transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func newAgent(t testing.TB, name string, tr transport.Transport) *agent.Agent {
	t.Helper()
	a, err := agent.New(context.Background(), agent.Config{Name: name, Transport: tr, DrainTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// kv is one side's registered KV regions.
type kv struct {
	bufs []*transport.HostBuffer
	reg  agent.RegHandle
}

func newKV(t testing.TB, a *agent.Agent, fill func(region, block int) byte) *kv {
	t.Helper()
	k := &kv{}
	var mems []transport.Memory
	for r := 0; r < numRegions; r++ {
		b, err := transport.AllocHost(fmt.Sprintf("%s-kv%d", a.Name(), r), numBlocks*blockLen)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		if fill != nil {
			for blk := 0; blk < numBlocks; blk++ {
				v := fill(r, blk)
				s := b.Bytes()[blk*blockLen : (blk+1)*blockLen]
				for i := range s {
					s[i] = v + byte(i%7)
				}
			}
		}
		k.bufs = append(k.bufs, b)
		mems = append(mems, b.Memory())
	}
	reg, err := a.RegisterMemory(mems)
	if err != nil {
		t.Fatal(err)
	}
	k.reg = reg
	return k
}

// descs lists every block of every region (vLLM's blocks_data order).
func (k *kv) descs() []agent.Desc {
	var out []agent.Desc
	for _, b := range k.bufs {
		for blk := 0; blk < numBlocks; blk++ {
			out = append(out, agent.Desc{Addr: uint64(b.Addr()) + uint64(blk*blockLen), Len: blockLen})
		}
	}
	return out
}

func (k *kv) block(region, blk int) []byte {
	return k.bufs[region].Bytes()[blk*blockLen : (blk+1)*blockLen]
}

func pattern(r, b int) byte { return byte(1 + r*numBlocks + b) }

// descIDs maps block ids to descriptor ids over every region (vLLM's
// _get_block_descs_ids).
func descIDs(blocks []int) []int {
	var out []int
	for r := 0; r < numRegions; r++ {
		for _, b := range blocks {
			out = append(out, r*numBlocks+b)
		}
	}
	return out
}

func waitState(t testing.TB, a *agent.Agent, h agent.XferHandle) (agent.XferState, error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := a.State(h)
		if st != agent.XferProc {
			return st, err
		}
		if time.Now().After(deadline) {
			t.Fatalf("transfer %d still PROC after 30 s", h)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func waitNotif(t testing.TB, a *agent.Agent, from string) [][]byte {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		sig := a.NotifSignal()
		if n := a.GetNotifs(); len(n[from]) > 0 {
			return n[from]
		}
		select {
		case <-sig:
		case <-timeout:
			t.Fatalf("agent %s: no notification from %s after 30 s", a.Name(), from)
		}
	}
}

// TestNixlConnectorOrder drives two agents in vLLM's NixlConnector worker
// order: both register their KV, the decode loads the prefill's metadata,
// prepares the local and the remote block lists, READs scattered blocks
// with a notification, sees DONE, and the prefill gets the notification
// (its blocks may be freed only then: the decode's data is already there).
func TestNixlConnectorOrder(t *testing.T) {
	for _, tn := range []string{"tcp", "shm", "cma"} {
		t.Run(tn, func(t *testing.T) {
			ctx := context.Background()
			p := newAgent(t, "prefill", openTransport(t, tn))
			d := newAgent(t, "decode", openTransport(t, tn))
			pkv := newKV(t, p, pattern)
			dkv := newKV(t, d, nil)

			name, err := d.AddRemoteAgent(ctx, p.Metadata())
			if err != nil || name != "prefill" {
				t.Fatalf("add remote agent: %q, %v", name, err)
			}
			if again, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil || again != "prefill" {
				t.Fatalf("adding the same agent again: %q, %v (want its name, no error)", again, err)
			}
			local, err := d.PrepDlist(ctx, agent.LocalAgent, transport.MemoryHost, dkv.descs())
			if err != nil {
				t.Fatal(err)
			}
			remote, err := d.PrepDlist(ctx, "prefill", transport.MemoryHost, pkv.descs())
			if err != nil {
				t.Fatal(err)
			}
			// Scattered: decode blocks 3, 4, 9 receive prefill blocks 0, 1, 12
			// (3, 4 and 0, 1 are adjacent on both sides: they merge).
			lb, rb := []int{3, 4, 9}, []int{0, 1, 12}
			x, err := d.MakeXfer(agent.OpRead, local, descIDs(lb), remote, descIDs(rb), []byte("req-1:1"))
			if err != nil {
				t.Fatal(err)
			}
			if st, err := d.State(x); st != agent.XferNotPosted || err == nil {
				t.Fatalf("state before the post: %v, %v", st, err)
			}
			if st, err := d.Post(x, nil); err != nil || st != agent.XferProc {
				t.Fatalf("post: %v, %v", st, err)
			}
			st, err := waitState(t, d, x)
			if st != agent.XferDone || err != nil {
				t.Fatalf("decode: transfer ended %v: %v", st, err)
			}
			got := waitNotif(t, p, "decode")
			if len(got) != 1 || string(got[0]) != "req-1:1" {
				t.Fatalf("prefill notifications from decode: %q", got)
			}
			// The notification came after the data: the decode's blocks hold
			// the prefill's, the others are untouched.
			for r := 0; r < numRegions; r++ {
				for i, b := range lb {
					if !bytes.Equal(dkv.block(r, b), pkv.block(r, rb[i])) {
						t.Fatalf("region %d decode block %d differs from prefill block %d", r, b, rb[i])
					}
				}
				if dkv.block(r, 5)[0] != 0 {
					t.Fatalf("region %d block 5 was written", r)
				}
			}
			tel, err := d.Telemetry(x)
			if err != nil {
				t.Fatal(err)
			}
			if tel.Bytes != uint64(numRegions*len(lb)*blockLen) || tel.Descs != numRegions*len(lb) || tel.Xfer <= 0 || tel.Start.IsZero() {
				t.Fatalf("telemetry %+v", tel)
			}
			// Repost (NIXL allows it once DONE), with a new notification.
			if _, err := d.Post(x, []byte("req-1:again")); err != nil {
				t.Fatal(err)
			}
			if st, err := waitState(t, d, x); st != agent.XferDone {
				t.Fatalf("repost: %v %v", st, err)
			}
			if got := waitNotif(t, p, "decode"); string(got[0]) != "req-1:again" {
				t.Fatalf("repost notification %q", got)
			}
			// A notification on its own (a full prefix cache hit).
			if err := d.SendNotif(ctx, "prefill", []byte("req-2:1")); err != nil {
				t.Fatal(err)
			}
			if got := waitNotif(t, p, "decode"); string(got[0]) != "req-2:1" {
				t.Fatalf("standalone notification %q", got)
			}
			// vLLM's shutdown order.
			if err := d.Release(x); err != nil {
				t.Fatal(err)
			}
			if err := d.Release(x); !errors.Is(err, agent.ErrBadHandle) {
				t.Fatalf("second release: %v", err)
			}
			for _, h := range []agent.DlistHandle{local, remote} {
				if err := d.ReleaseDlist(h); err != nil {
					t.Fatal(err)
				}
			}
			if err := d.RemoveRemoteAgent(ctx, "prefill"); err != nil {
				t.Fatal(err)
			}
			if err := d.DeregisterMemory(dkv.reg); err != nil {
				t.Fatal(err)
			}
			if err := p.DeregisterMemory(pkv.reg); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestWrite: a WRITE with a notification; the notification arrives after
// the bytes are in the remote memory.
func TestWrite(t *testing.T) {
	ctx := context.Background()
	src := newAgent(t, "src", openTransport(t, "tcp"))
	dst := newAgent(t, "dst", openTransport(t, "tcp"))
	skv, dkv := newKV(t, src, pattern), newKV(t, dst, nil)
	if _, err := src.AddRemoteAgent(ctx, dst.Metadata()); err != nil {
		t.Fatal(err)
	}
	l, _ := src.PrepDlist(ctx, "", transport.MemoryHost, skv.descs())
	r, err := src.PrepDlist(ctx, "dst", transport.MemoryHost, dkv.descs())
	if err != nil {
		t.Fatal(err)
	}
	x, err := src.MakeXfer(agent.OpWrite, l, descIDs([]int{2, 7}), r, descIDs([]int{5, 6}), []byte("w"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Post(x, nil); err != nil {
		t.Fatal(err)
	}
	waitNotif(t, dst, "src")
	for reg := 0; reg < numRegions; reg++ {
		if !bytes.Equal(dkv.block(reg, 5), skv.block(reg, 2)) || !bytes.Equal(dkv.block(reg, 6), skv.block(reg, 7)) {
			t.Fatalf("region %d: the notification arrived before the data", reg)
		}
	}
	if st, err := waitState(t, src, x); st != agent.XferDone {
		t.Fatalf("state %v %v", st, err)
	}
}

// TestErrors: unknown agents, bad indices and descriptors are refused with
// errors that say what was wrong, and move nothing.
func TestErrors(t *testing.T) {
	ctx := context.Background()
	p := newAgent(t, "p", openTransport(t, "tcp"))
	d := newAgent(t, "d", openTransport(t, "tcp"))
	pkv, dkv := newKV(t, p, pattern), newKV(t, d, nil)
	if _, err := d.PrepDlist(ctx, "p", transport.MemoryHost, pkv.descs()); !errors.Is(err, agent.ErrUnknownAgent) {
		t.Fatalf("prep for an agent never added: %v", err)
	}
	if _, err := d.AddRemoteAgent(ctx, []byte("not metadata at all, more than twenty")); !errors.Is(err, agent.ErrBadMetadata) {
		t.Fatalf("bad metadata: %v", err)
	}
	if _, err := d.AddRemoteAgent(ctx, d.Metadata()); err == nil {
		t.Fatal("adding its own metadata succeeded")
	}
	if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
		t.Fatal(err)
	}
	local, _ := d.PrepDlist(ctx, agent.LocalAgent, transport.MemoryHost, dkv.descs())
	remote, _ := d.PrepDlist(ctx, "p", transport.MemoryHost, pkv.descs())
	n := numRegions * numBlocks
	cases := []struct {
		name   string
		li, ri []int
		want   error
		text   string
	}{
		{"local index", []int{n}, []int{0}, agent.ErrBadIndex, fmt.Sprintf("local index %d", n)},
		{"remote index", []int{0}, []int{-1}, agent.ErrBadIndex, "remote index -1"},
		{"counts", []int{0, 1}, []int{0}, agent.ErrBadIndex, "2 local and 1 remote"},
		{"empty", nil, nil, agent.ErrBadIndex, "0 local"},
	}
	for _, c := range cases {
		if _, err := d.MakeXfer(agent.OpRead, local, c.li, remote, c.ri, nil); !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: %v, want %v mentioning %q", c.name, err, c.want, c.text)
		}
	}
	if _, err := d.MakeXfer(agent.OpRead, remote, []int{0}, local, []int{0}, nil); err == nil {
		t.Error("swapped lists accepted")
	}
	if _, err := d.MakeXfer(agent.OpRead, 999, []int{0}, remote, []int{0}, nil); !errors.Is(err, agent.ErrBadHandle) {
		t.Errorf("unknown list: %v", err)
	}
	outside := []agent.Desc{{Addr: uint64(pkv.bufs[0].Addr()) + numBlocks*blockLen, Len: blockLen}}
	if _, err := d.PrepDlist(ctx, "p", transport.MemoryHost, outside); !errors.Is(err, agent.ErrBadDescriptor) || !errors.Is(err, transport.ErrOutOfBounds) {
		t.Errorf("remote descriptor outside the peer's memory: %v", err)
	}
	if _, err := d.PrepDlist(ctx, "", transport.MemoryHost, outside); !errors.Is(err, agent.ErrBadDescriptor) {
		t.Errorf("local descriptor outside registered memory: %v", err)
	}
	if _, err := d.PrepDlist(ctx, "", transport.MemoryCUDA, dkv.descs()[:1]); !errors.Is(err, agent.ErrBadDescriptor) {
		t.Errorf("host memory prepared as CUDA: %v", err)
	}
	half, _ := d.PrepDlist(ctx, "", transport.MemoryHost, []agent.Desc{{Addr: uint64(dkv.bufs[0].Addr()), Len: blockLen / 2}})
	if _, err := d.MakeXfer(agent.OpRead, half, []int{0}, remote, []int{0}, nil); !errors.Is(err, agent.ErrBadDescriptor) {
		t.Errorf("pairs of different lengths: %v", err)
	}
	if _, err := d.Post(12345, nil); !errors.Is(err, agent.ErrBadHandle) {
		t.Errorf("post of an unknown handle: %v", err)
	}
	if err := d.SendNotif(ctx, "nobody", []byte("x")); !errors.Is(err, agent.ErrUnknownAgent) {
		t.Errorf("notification to an unknown agent: %v", err)
	}
	if err := d.RemoveRemoteAgent(ctx, "nobody"); !errors.Is(err, agent.ErrUnknownAgent) {
		t.Errorf("remove an unknown agent: %v", err)
	}
	// After the removal the lists naming it make no transfer.
	if err := d.RemoveRemoteAgent(ctx, "p"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.MakeXfer(agent.OpRead, local, []int{0}, remote, []int{0}, nil); !errors.Is(err, agent.ErrUnknownAgent) {
		t.Errorf("transfer to a removed agent: %v", err)
	}
	for r := range dkv.bufs {
		if bytes.IndexFunc(dkv.bufs[r].Bytes(), func(c rune) bool { return c != 0 }) >= 0 {
			t.Fatalf("region %d was written by a refused request", r)
		}
	}
}

// TestRemovedAgentRefused: once an agent removes a peer that added it, the
// peer's WRITEs into its memory fail and land nothing, and its
// notifications are refused.
func TestRemovedAgentRefused(t *testing.T) {
	for _, tn := range []string{"tcp", "shm", "cma"} {
		t.Run(tn, func(t *testing.T) {
			ctx := context.Background()
			a := newAgent(t, "a", openTransport(t, tn))
			b := newAgent(t, "b", openTransport(t, tn))
			akv, bkv := newKV(t, a, nil), newKV(t, b, pattern)
			if _, err := b.AddRemoteAgent(ctx, a.Metadata()); err != nil {
				t.Fatal(err)
			}
			l, _ := b.PrepDlist(ctx, "", transport.MemoryHost, bkv.descs())
			r, err := b.PrepDlist(ctx, "a", transport.MemoryHost, akv.descs())
			if err != nil {
				t.Fatal(err)
			}
			x, err := b.MakeXfer(agent.OpWrite, l, []int{0}, r, []int{0}, nil)
			if err != nil {
				t.Fatal(err)
			}
			b.Post(x, nil)
			if st, err := waitState(t, b, x); st != agent.XferDone {
				t.Fatalf("write before the removal: %v %v", st, err)
			}
			if err := a.RemoveRemoteAgent(ctx, "b"); err != nil {
				t.Fatal(err)
			}
			y, err := b.MakeXfer(agent.OpWrite, l, []int{1}, r, []int{1}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Post(y, nil); err == nil {
				if st, err := waitState(t, b, y); st != agent.XferErr {
					t.Fatalf("write after the removal: %v %v, want ERR", st, err)
				}
			}
			if akv.block(0, 1)[0] != 0 {
				t.Fatal("a write of a removed agent landed")
			}
			if err := b.SendNotif(ctx, "a", []byte("late")); !errors.Is(err, agent.ErrRefused) {
				t.Fatalf("notification of a removed agent: %v", err)
			}
			if err := b.RemoveRemoteAgent(ctx, "a"); err != nil {
				t.Fatal(err)
			}
			if _, err := b.AddRemoteAgent(ctx, a.Metadata()); !errors.Is(err, agent.ErrRefused) {
				t.Fatalf("a removed agent adding again: %v", err)
			}
		})
	}
}

// TestCancelFences: a READ cancelled (or released) in flight lands nothing
// in local memory and sends no notification; one that ignores the cancel
// closes the segment (the agent must be added again).
func TestCancelFences(t *testing.T) {
	ctx := context.Background()
	p := newAgent(t, "p", openTransport(t, "tcp"))
	ft := faulty.Wrap(openTransport(t, "tcp"), faulty.DelayWrites(300*time.Millisecond), faulty.StallAfter(2))
	d := newAgent(t, "d", ft)
	pkv, dkv := newKV(t, p, pattern), newKV(t, d, nil)
	if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
		t.Fatal(err)
	}
	l, _ := d.PrepDlist(ctx, "", transport.MemoryHost, dkv.descs())
	r, _ := d.PrepDlist(ctx, "p", transport.MemoryHost, pkv.descs())
	x, _ := d.MakeXfer(agent.OpRead, l, []int{0}, r, []int{0}, []byte("cancelled"))
	if _, err := d.Post(x, nil); err != nil {
		t.Fatal(err)
	}
	if st, err := d.Cancel(x); st != agent.XferCanceled || err != nil {
		t.Fatalf("cancel: %v %v", st, err)
	}
	if _, err := d.State(x); !errors.Is(err, transport.ErrCanceled) {
		t.Fatalf("state after cancel: %v", err)
	}
	y, _ := d.MakeXfer(agent.OpRead, l, []int{1}, r, []int{1}, []byte("released"))
	if _, err := d.Post(y, nil); err != nil {
		t.Fatal(err)
	}
	if err := d.Release(y); err != nil {
		t.Fatal(err)
	}
	// The third submit stalls and ignores Cancel: Release closes the segment.
	z, _ := d.MakeXfer(agent.OpRead, l, []int{2}, r, []int{2}, []byte("stalled"))
	if _, err := d.Post(z, nil); err != nil {
		t.Fatal(err)
	}
	// The stalled producer resumes only after the drain timeout closed the
	// segment: its batch then fails on the closed connection.
	go func() { time.Sleep(3 * time.Second); ft.Resume() }()
	if err := d.Release(z); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // past the delay: a dropped batch would have landed by now
	for reg := range dkv.bufs {
		if bytes.IndexFunc(dkv.bufs[reg].Bytes(), func(c rune) bool { return c != 0 }) >= 0 {
			t.Fatalf("region %d written by a cancelled or released read", reg)
		}
	}
	if n := p.GetNotifs(); len(n) != 0 {
		t.Fatalf("notifications of cancelled reads: %q", n)
	}
	if _, err := d.Post(x, nil); !errors.Is(err, agent.ErrUnknownAgent) {
		t.Fatalf("post after the segment was closed: %v, want ErrUnknownAgent (add it again)", err)
	}
}

// TestMain lets the test binary act as a prefill agent in its own process
// (KVX_TEST_HELPER=prefill), so the decode can read from a real peer and
// kill it mid-read.
func TestMain(m *testing.M) {
	if os.Getenv("KVX_TEST_HELPER") == "prefill" {
		if err := helperPrefill(); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperPrefill registers a patterned KV, prints "MD <hex metadata>" and
// then "NOTIF <agent> <message>" for every notification, until stdin
// closes.
func helperPrefill() error {
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		return err
	}
	a, err := agent.New(context.Background(), agent.Config{Name: "prefill-proc", Transport: tr})
	if err != nil {
		return err
	}
	defer a.Close()
	var mems []transport.Memory
	for r := 0; r < numRegions; r++ {
		b, err := transport.AllocHost("helper", numBlocks*blockLen)
		if err != nil {
			return err
		}
		defer b.Close()
		for blk := 0; blk < numBlocks; blk++ {
			s := b.Bytes()[blk*blockLen : (blk+1)*blockLen]
			for i := range s {
				s[i] = pattern(r, blk) + byte(i%7)
			}
		}
		mems = append(mems, b.Memory())
	}
	if _, err := a.RegisterMemory(mems); err != nil {
		return err
	}
	var bases []string
	for _, m := range mems {
		bases = append(bases, fmt.Sprint(m.Addr))
	}
	// vLLM's NixlAgentMetadata carries the agent metadata and the KV base
	// addresses in the serving engine's order.
	fmt.Printf("MD %s %s\n", hex.EncodeToString(a.Metadata()), strings.Join(bases, ","))
	stdin := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stdin) }()
	for {
		sig := a.NotifSignal()
		for from, msgs := range a.GetNotifs() {
			for _, m := range msgs {
				fmt.Printf("NOTIF %s %s\n", from, m)
			}
		}
		select {
		case <-sig:
		case <-stdin:
			return nil
		}
	}
}

type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines *bufio.Scanner
	md    []byte
	bases []uint64
}

func startHelper(t *testing.T) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVX_TEST_HELPER=prefill")
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() })
	h := &helper{cmd: cmd, stdin: stdin, lines: bufio.NewScanner(out)}
	if !h.lines.Scan() {
		t.Fatal("helper printed nothing")
	}
	f := strings.Fields(h.lines.Text())
	if len(f) != 3 || f[0] != "MD" {
		t.Fatalf("helper line %q", h.lines.Text())
	}
	var err error
	if h.md, err = hex.DecodeString(f[1]); err != nil {
		t.Fatal(err)
	}
	for _, b := range strings.Split(f[2], ",") {
		v, err := strconv.ParseUint(b, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		h.bases = append(h.bases, v)
	}
	return h
}

// TestCrossProcess: the NixlConnector order against a prefill agent in
// another process (its notification printed there), then a read while the
// prefill is killed: the read ends ERR naming the lost peer, and a
// notification to the dead agent fails at the deadline.
func TestCrossProcess(t *testing.T) {
	ctx := context.Background()
	h := startHelper(t)
	// The second read's batch is held (StallAfter) until the prefill is
	// dead, so it is in flight when the peer dies, whatever the load.
	ft := faulty.Wrap(openTransport(t, "tcp"), faulty.StallAfter(1))
	d, err := agent.New(ctx, agent.Config{Name: "decode", Timeout: 2 * time.Second, DrainTimeout: 2 * time.Second, Transport: ft})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	dkv := newKV(t, d, nil)
	name, err := d.AddRemoteAgent(ctx, h.md)
	if err != nil || name != "prefill-proc" {
		t.Fatalf("add: %q %v", name, err)
	}
	// The remote list is built from the base addresses the prefill sent,
	// the way vLLM's add_remote_agent does.
	var rdescs []agent.Desc
	for _, base := range h.bases {
		for blk := 0; blk < numBlocks; blk++ {
			rdescs = append(rdescs, agent.Desc{Addr: base + uint64(blk*blockLen), Len: blockLen})
		}
	}
	if regs, err := d.RemoteRegions(name); err != nil || len(regs) != numRegions {
		t.Fatalf("remote regions: %v %v", regs, err)
	}
	l, _ := d.PrepDlist(ctx, "", transport.MemoryHost, dkv.descs())
	r, err := d.PrepDlist(ctx, name, transport.MemoryHost, rdescs)
	if err != nil {
		t.Fatal(err)
	}
	x, _ := d.MakeXfer(agent.OpRead, l, descIDs([]int{1, 8}), r, descIDs([]int{4, 15}), []byte("req-9:1"))
	d.Post(x, nil)
	if st, err := waitState(t, d, x); st != agent.XferDone {
		t.Fatalf("cross-process read: %v %v", st, err)
	}
	if !h.lines.Scan() || h.lines.Text() != "NOTIF decode req-9:1" {
		t.Fatalf("prefill printed %q, want its notification", h.lines.Text())
	}
	for reg := 0; reg < numRegions; reg++ {
		if dkv.block(reg, 1)[0] != pattern(reg, 4) || dkv.block(reg, 8)[0] != pattern(reg, 15) {
			t.Fatalf("region %d: wrong data", reg)
		}
	}
	// Peer killed mid-read.
	y, _ := d.MakeXfer(agent.OpRead, l, descIDs([]int{2}), r, descIDs([]int{3}), []byte("req-10:1"))
	if _, err := d.Post(y, nil); err != nil {
		t.Fatal(err)
	}
	h.cmd.Process.Kill()
	h.cmd.Wait()
	ft.Resume()
	st, why := waitState(t, d, y)
	if st != agent.XferErr || !errors.Is(why, transport.ErrPeerLost) {
		t.Fatalf("read from a killed prefill: %v %v, want ERR wrapping ErrPeerLost", st, why)
	}
	if err := d.SendNotif(ctx, name, []byte("x")); !errors.Is(err, agent.ErrAgentUnreachable) {
		t.Fatalf("notification to a killed agent: %v", err)
	}
	// The prefill restarts (same name, new instance): adding its new
	// metadata replaces the dead one, and reads work again.
	h2 := startHelper(t)
	if again, err := d.AddRemoteAgent(ctx, h2.md); err != nil || again != name {
		t.Fatalf("add the restarted prefill: %q %v", again, err)
	}
	var rd2 []agent.Desc
	for _, base := range h2.bases {
		for blk := 0; blk < numBlocks; blk++ {
			rd2 = append(rd2, agent.Desc{Addr: base + uint64(blk*blockLen), Len: blockLen})
		}
	}
	// A request and a list prepared against the dead instance name its
	// memory, not the new one's: refused.
	if _, err := d.Post(y, nil); !errors.Is(err, transport.ErrPeerLost) || !strings.Contains(err.Error(), "restarted") {
		t.Fatalf("post of a request prepared for the dead instance: %v", err)
	}
	if _, err := d.MakeXfer(agent.OpRead, l, []int{0}, r, []int{0}, nil); !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("a list prepared for the dead instance: %v", err)
	}
	r2, err := d.PrepDlist(ctx, name, transport.MemoryHost, rd2)
	if err != nil {
		t.Fatal(err)
	}
	z, _ := d.MakeXfer(agent.OpRead, l, descIDs([]int{6}), r2, descIDs([]int{7}), []byte("req-11:1"))
	if _, err := d.Post(z, nil); err != nil {
		t.Fatal(err)
	}
	if st, err := waitState(t, d, z); st != agent.XferDone {
		t.Fatalf("read from the restarted prefill: %v %v", st, err)
	}
	if !h2.lines.Scan() || h2.lines.Text() != "NOTIF decode req-11:1" {
		t.Fatalf("restarted prefill printed %q", h2.lines.Text())
	}
}

// TestNotificationNotDelivered: when the remote agent refuses a
// notification (its queue is full: its caller does not read them), the
// transfer whose data landed ends ERR saying so, so the two sides do not
// disagree about it.
func TestNotificationNotDelivered(t *testing.T) {
	ctx := context.Background()
	p, err := agent.New(ctx, agent.Config{Name: "p", Transport: openTransport(t, "tcp"), MaxNotifs: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d := newAgent(t, "d", openTransport(t, "tcp"))
	pkv, dkv := newKV(t, p, pattern), newKV(t, d, nil)
	if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
		t.Fatal(err)
	}
	l, _ := d.PrepDlist(ctx, "", transport.MemoryHost, dkv.descs())
	r, _ := d.PrepDlist(ctx, "p", transport.MemoryHost, pkv.descs())
	for i, want := range []agent.XferState{agent.XferDone, agent.XferErr} {
		x, _ := d.MakeXfer(agent.OpRead, l, []int{i}, r, []int{i}, []byte(fmt.Sprintf("req-%d:1", i)))
		d.Post(x, nil)
		st, why := waitState(t, d, x)
		if st != want {
			t.Fatalf("read %d: %v %v, want %v", i, st, why, want)
		}
		if st == agent.XferErr && (!errors.Is(why, agent.ErrRefused) || !strings.Contains(why.Error(), "the data landed but the notification was not delivered")) {
			t.Fatalf("read %d: reason %v", i, why)
		}
	}
	if n := p.GetNotifs(); len(n["d"]) != 1 || string(n["d"][0]) != "req-0:1" {
		t.Fatalf("prefill notifications %q", n)
	}
}

// TestAdjacentRegionsNotMerged: descriptors adjacent in memory but in two
// registered regions (one allocation registered as two halves, as two
// tensors the caching allocator placed back to back) are not merged into a
// request spanning both: the transfer is DONE.
func TestAdjacentRegionsNotMerged(t *testing.T) {
	for _, tn := range []string{"tcp", "shm", "cma"} {
		t.Run(tn, func(t *testing.T) {
			ctx := context.Background()
			p := newAgent(t, "p", openTransport(t, tn))
			d := newAgent(t, "d", openTransport(t, tn))
			halves := func(a *agent.Agent, fill bool) []agent.Desc {
				b, err := transport.AllocHost("halves", 4*blockLen)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Close() })
				if fill {
					for i := range b.Bytes() {
						b.Bytes()[i] = byte(i/blockLen + 1)
					}
				}
				m := b.Memory()
				lo, hi := m, m
				lo.Length, hi.Length = 2*blockLen, 2*blockLen
				hi.Addr += 2 * blockLen
				hi.FDOffset += 2 * blockLen
				if _, err := a.RegisterMemory([]transport.Memory{lo, hi}); err != nil {
					t.Fatal(err)
				}
				var ds []agent.Desc
				for i := 0; i < 4; i++ {
					ds = append(ds, agent.Desc{Addr: uint64(b.Addr()) + uint64(i*blockLen), Len: blockLen})
				}
				return ds
			}
			pd, dd := halves(p, true), halves(d, false)
			if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
				t.Fatal(err)
			}
			l, _ := d.PrepDlist(ctx, "", transport.MemoryHost, dd)
			r, err := d.PrepDlist(ctx, "p", transport.MemoryHost, pd)
			if err != nil {
				t.Fatal(err)
			}
			x, err := d.MakeXfer(agent.OpRead, l, []int{0, 1, 2, 3}, r, []int{0, 1, 2, 3}, nil)
			if err != nil {
				t.Fatal(err)
			}
			d.Post(x, nil)
			if st, err := waitState(t, d, x); st != agent.XferDone {
				t.Fatalf("read across two adjacent regions: %v %v", st, err)
			}
			if tel, _ := d.Telemetry(x); tel.Descs != 4 || tel.Bytes != 4*blockLen {
				t.Fatalf("telemetry %+v", tel)
			}
		})
	}
}
