package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

type sideOpts struct {
	model workload.ModelConfig
	aux   []workload.AuxBuffer
}

// newBufRank is newRank with a chosen model and aux list for one side.
func newBufRank(t *testing.T, role engine.Role, addr string, o sideOpts, checksum bool) *rank {
	t.Helper()
	l, err := workload.NewLayout(o.model, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 32})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "buf", Device: -1, Aux: o.aux, AuxRows: 4})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	cfg := engine.ManagerConfig{Role: role, KV: pool.Args(), Transports: []transport.Transport{tr}, BootstrapAddr: addr, Checksum: checksum,
		BootstrapTimeout: 20 * time.Second, WaitingTimeout: 20 * time.Second}
	if role == engine.RoleDecode {
		cfg.BootstrapAddr = ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, err := engine.NewManager(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); tr.Close(); pool.Close() })
	return &rank{m: m, pool: pool}
}

// TestRegistrationRefusedNamesBothSides: prefill and decode whose buffer
// lists differ fail at registration (REGISTER_ACK), on both sides, with an
// error naming both ranks and the difference; nothing is transferred.
func TestRegistrationRefusedNamesBothSides(t *testing.T) {
	shallow := workload.ModelConfig{Name: "shallow", NumLayers: 2, NumKVHeads: 4, HeadDim: 16, DtypeBytes: 2}
	cases := []struct {
		name     string
		pre, dec sideOpts
		want     string
		// byDecode: the decode refuses the pairing itself (it alone sees
		// every producer), after the prefill accepted the registration.
		byDecode bool
	}{
		{"aux count", sideOpts{smallGQA, workload.DefaultAux}, sideOpts{smallGQA, workload.DefaultAux[:6]}, "aux buffer counts differ: prefill has 7, decode has 6", false},
		{"kv item lens", sideOpts{smallGQA, workload.DefaultAux},
			sideOpts{workload.ModelConfig{Name: "half", NumLayers: 4, NumKVHeads: 4, HeadDim: 8, DtypeBytes: 2}, workload.DefaultAux},
			"prefill KV buffer 0 (layer 0 K) is 512 bytes per page, decode KV buffer 0 (layer 0 K) is 256 bytes per page", false},
		{"kv buffer count", sideOpts{smallGQA, workload.DefaultAux},
			sideOpts{shallow, workload.DefaultAux},
			"prefill holds layers [0, 4), decode holds [0, 2)", false},
		// The decode holds layers no producer sends: they would never be
		// written (and, with the aux row written by the producer of the last
		// layer, neither would the aux row), yet the room would succeed.
		{"decode holds more layers", sideOpts{shallow, workload.DefaultAux}, sideOpts{smallGQA, workload.DefaultAux},
			"the prefill ranks it is paired with send layers [0, 2); layers [2, 4) would never be written", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr := startBootstrap(t)
			p := newBufRank(t, engine.RolePrefill, addr, c.pre, false)
			d := newBufRank(t, engine.RoleDecode, addr, c.dec, false)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s, err := p.m.NewSender(31)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := d.m.NewReceiver(addr, 31)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			pg, _ := d.pool.Alloc(2)
			// A refusal may fail the receiver before Init (which then
			// returns that failure).
			if err := r.Init(pg); err != nil && r.Poll() != engine.KVFailed {
				t.Fatal(err)
			}
			if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed {
				t.Fatalf("receiver %s, want Failed", st)
			}
			msg := r.Failure().Error()
			by := "refused this decode's registration"
			if c.byDecode {
				by = "cannot be paired"
			}
			if !strings.Contains(msg, c.want) || !strings.Contains(msg, p.m.Endpoint()) || !strings.Contains(msg, d.m.Endpoint()) || !strings.Contains(msg, by) {
				t.Fatalf("receiver failure %q: want %q naming prefill %s and decode %s", msg, c.want, p.m.Endpoint(), d.m.Endpoint())
			}
			// The prefill learns the same outcome at once (ABORT with the
			// refusal), not at its bootstrap timeout.
			if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !errors.Is(s.Failure(), engine.ErrAborted) || !strings.Contains(s.Failure().Error(), c.want) {
				t.Fatalf("sender %s %v, want Failed/ErrAborted with %q", st, s.Failure(), c.want)
			}
		})
	}
}

// transferWith runs one request whose decode states prefixPages pages it
// already holds (filled here with the earlier room's pattern) and an aux
// row; it returns the two ranks' metrics after checking the whole prompt and
// the aux row on the decode.
func transferWith(t *testing.T, addr string, p, d *rank, room, earlier uint64, tokens, prefixPages int) (engine.TransferMetric, engine.TransferMetric) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ps := d.m.PageSize()
	total := d.m.PagesForTokens(tokens)
	dpages, err := d.pool.Alloc(total)
	if err != nil {
		t.Fatal(err)
	}
	defer d.pool.Free(dpages)
	if err := workload.FillPattern(d.pool, earlier, dpages[:prefixPages], 0); err != nil {
		t.Fatal(err)
	}
	r, err := d.m.NewReceiver(addr, room)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.SendMetadata(dpages[prefixPages:], 3, nil, prefixPages*ps); err != nil {
		t.Fatal(err)
	}
	s, err := p.m.NewSender(room)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s: %v", st, s.Failure())
	}
	if got := s.PopDecodePrefixLen(); got != prefixPages*ps {
		t.Fatalf("PopDecodePrefixLen %d, want %d", got, prefixPages*ps)
	}
	src, err := p.pool.Alloc(total)
	if err != nil {
		t.Fatal(err)
	}
	defer p.pool.Free(src)
	// The prefill computed the whole prompt; the prefix pages hold the same
	// tokens' KV of this room, which the decode does not want.
	if err := workload.FillPattern(p.pool, room, src, 0); err != nil {
		t.Fatal(err)
	}
	if err := workload.FillAux(p.pool, room, 1); err != nil {
		t.Fatal(err)
	}
	n, err := s.InitTokens(tokens, 1)
	if err != nil || n != total-prefixPages {
		t.Fatalf("InitTokens: %d pages, %v; want %d", n, err, total-prefixPages)
	}
	if err := s.Send(src[prefixPages:prefixPages+n/2], false); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(src[prefixPages+n/2:], true); err != nil {
		t.Fatal(err)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("receiver %s: %v", st, r.Failure())
	}
	if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
		t.Fatalf("sender %s: %v", st, s.Failure())
	}
	// The whole prompt: the held prefix is the earlier room's, the rest this room's.
	if err := workload.VerifyPattern(d.pool, earlier, dpages[:prefixPages], 0); err != nil {
		t.Fatal(err)
	}
	if err := workload.VerifyPattern(d.pool, room, dpages[prefixPages:], prefixPages); err != nil {
		t.Fatal(err)
	}
	if err := workload.VerifyAux(d.pool, room, 3); err != nil {
		t.Fatal(err)
	}
	row, err := r.AuxRow(0)
	if err != nil || !bytes.Equal(row, p.pool.AuxRow(0, 1)) {
		t.Fatalf("AuxRow(0) = %x, %v; want the prefill's row %x", row, err, p.pool.AuxRow(0, 1))
	}
	return s.TransferMetric(), r.TransferMetric()
}

func TestAuxRowAndPrefixReuse(t *testing.T) {
	for _, checksum := range []bool{false, true} {
		addr := startBootstrap(t)
		p := newBufRank(t, engine.RolePrefill, addr, sideOpts{smallGQA, workload.DefaultAux}, false)
		d := newBufRank(t, engine.RoleDecode, addr, sideOpts{smallGQA, workload.DefaultAux}, checksum)
		item := p.pool.Layout().ItemLen() * uint64(p.pool.Layout().NumBuffers())
		var auxRow uint64
		for _, a := range workload.DefaultAux {
			auxRow += a.RowBytes
		}
		for _, c := range []struct {
			tokens, prefix int
		}{{30, 0}, {30, 3}, {32, 8}} { // 8 pages of 4 tokens; the last: everything held
			sm, rm := transferWith(t, addr, p, d, uint64(100+c.prefix), 7, c.tokens, c.prefix)
			sent := uint64(8-c.prefix) * item
			if sm.Bytes != sent || rm.Bytes != sent || sm.SkippedBytes != uint64(c.prefix)*item || rm.SkippedBytes != sm.SkippedBytes ||
				sm.PrefixTokens != 4*c.prefix || rm.PrefixTokens != sm.PrefixTokens || sm.AuxBytes != auxRow || rm.AuxBytes != auxRow ||
				sm.Latency <= 0 || rm.Latency <= 0 || sm.Pages != 8-c.prefix {
				t.Errorf("checksum %v prefix %d: sender %+v receiver %+v; want %d bytes sent, %d skipped, %d aux", checksum, c.prefix, sm, rm, sent, uint64(c.prefix)*item, auxRow)
			}
		}
	}
}

// TestRequestRefusals: bad indices and prefixes are refused before anything
// moves, and a prefix longer than the prompt fails both sides naming both
// counts.
func TestRequestRefusals(t *testing.T) {
	addr := startBootstrap(t)
	p := newBufRank(t, engine.RolePrefill, addr, sideOpts{smallGQA, workload.DefaultAux}, false)
	d := newBufRank(t, engine.RoleDecode, addr, sideOpts{smallGQA, workload.DefaultAux}, false)
	r, err := d.m.NewReceiver(addr, 41)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, c := range []struct {
		pages  []int32
		aux    int
		state  []int32
		prefix int
		want   string
	}{
		{[]int32{1, 32}, -1, nil, 0, "destination page 32 (index 1 of 2) is beyond KV buffer 0 (layer 0 K), which holds 32 pages"},
		{[]int32{3, 3}, -1, nil, 0, "destination page 3 is given twice, at indices 0 and 1 of 2"},
		{[]int32{5, 1, 2, 9, 2}, -1, nil, 0, "destination page 2 is given twice, at indices 2 and 4 of 5"},
		{[]int32{1}, 4, nil, 0, "aux index 4 is beyond aux buffer 0, which holds 4 rows"},
		{[]int32{1}, -1, []int32{0}, 0, "1 state indices given, but there are no state buffers"},
		{[]int32{1}, -1, nil, 6, "decode_prefix_len 6: want whole pages of 4 tokens"},
		{[]int32{1}, -1, nil, -4, "decode_prefix_len -4"},
	} {
		if err := r.SendMetadata(c.pages, c.aux, c.state, c.prefix); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("SendMetadata(%v, %d, %v, %d): %v, want %q", c.pages, c.aux, c.state, c.prefix, err, c.want)
		}
	}
	// A prefix of 8 pages (32 tokens) for a 20-token prompt.
	pg, _ := d.pool.Alloc(1)
	if err := r.SendMetadata(pg, 0, nil, 32); err != nil {
		t.Fatal(err)
	}
	s, err := p.m.NewSender(41)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
		t.Fatalf("sender %s: %v", st, s.Failure())
	}
	if err := s.Init(1, 4); err == nil || !strings.Contains(err.Error(), "aux index 4 is beyond aux buffer 0") {
		t.Fatalf("Init with aux 4: %v", err)
	}
	if err := s.Send([]int32{99}, true); err == nil || !strings.Contains(err.Error(), "page index 99 is beyond") {
		t.Fatalf("Send of page 99: %v", err)
	}
	_, err = s.InitTokens(20, 0)
	want := "states a prefix of 32 tokens, longer than the prefill's prompt of 20 tokens"
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), d.m.Endpoint()) {
		t.Fatalf("InitTokens(20): %v, want %q naming the decode", err, want)
	}
	if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r.Failure().Error(), want) || !strings.Contains(r.Failure().Error(), p.m.Endpoint()) {
		t.Fatalf("receiver %s %v, want Failed with %q naming the prefill", st, r.Failure(), want)
	}
	if s.Poll() != engine.KVFailed {
		t.Fatalf("sender %s, want Failed", s.Poll())
	}

	// The decode asks for an aux row the prefill sender was not given.
	r2, err := d.m.NewReceiver(addr, 42)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.SendMetadata(pg, 2, nil, 0); err != nil {
		t.Fatal(err)
	}
	s2, err := p.m.NewSender(42)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	s2.Wait(ctx, engine.KVWaitingForInput)
	src, _ := p.pool.Alloc(1)
	if err := s2.Init(1, -1); err != nil {
		t.Fatal(err)
	}
	if err := s2.Send(src, true); err != nil {
		t.Fatal(err)
	}
	want = "asked for aux row 2, but this prefill sender has no aux_index"
	if st := r2.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(r2.Failure().Error(), want) {
		t.Fatalf("receiver %s %v, want Failed with %q", st, r2.Failure(), want)
	}
	if _, err := r2.AuxRow(0); err == nil {
		t.Fatal("AuxRow of a failed receiver")
	}
}

// TestTransportRefusesBuffers: a transport that cannot move a buffer (shm
// and device memory, shm and memory without a backing fd, tcp and device
// memory without the CUDA bounce) is left out; none left is an error that
// names every transport and the buffer it refused.
func TestTransportRefusesBuffers(t *testing.T) {
	open := func(names ...string) []transport.Transport {
		var ts []transport.Transport
		for _, n := range names {
			tr, err := transport.OpenTransport(n, transport.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { tr.Close() })
			ts = append(ts, tr)
		}
		return ts
	}
	l, err := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "refuse", Device: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Host memory without an fd (as malloc'ed memory): shm is left out.
	args := pool.Args()
	for i := range args.KVBuffers {
		args.KVBuffers[i].FD = -1
	}
	m, err := engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RoleDecode, KV: args, Transports: open("shm", "tcp")})
	if err != nil {
		t.Fatal(err)
	}
	if got := m.TransportNames(); len(got) != 1 || got[0] != "tcp" {
		t.Fatalf("transports %v, want [tcp] (shm cannot share memory without an fd)", got)
	}
	m.Close()

	// Device memory (fake addresses: refused before anything touches them).
	dev := pool.Args()
	for i := range dev.KVBuffers {
		dev.KVBuffers[i].Memory = transport.Memory{Addr: uintptr(0x7000_0000_0000 + i<<20), Length: l.BufferLen(), Kind: transport.MemoryCUDA, Device: 0, FD: -1}
	}
	dev.GPUID = 0
	_, err = engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RoleDecode, KV: dev, Transports: open("shm")})
	if err == nil || !strings.Contains(err.Error(), "shm cannot register KV buffer 0 (layer 0 K) (cuda:0") {
		t.Fatalf("device buffers on shm: %v, want a refusal naming shm and the buffer", err)
	}
	if !strings.Contains(err.Error(), "no transport can register") {
		t.Fatalf("refusal %q does not say no transport is left", err)
	}
	if _, err := engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RoleDecode, KV: kvargs.KVArgs{}, Transports: open("tcp")}); !errors.Is(err, kvargs.ErrBadKVArgs) {
		t.Fatalf("empty KV args: %v, want ErrBadKVArgs", err)
	}
}

// newStateRank is newBufRank with two state buffers (4 slots of 128 and 64
// bytes) appended to the KV arguments; it returns them too.
func newStateRank(t *testing.T, role engine.Role, addr string) (*rank, []kvargs.Buffer) {
	t.Helper()
	l, err := workload.NewLayout(smallGQA, workload.LayoutOptions{PageSize: 4, TPSize: 1, PPSize: 1, NumPages: 16})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := workload.NewKVBuffers(l, workload.BufferOptions{Name: "state", Device: -1, Aux: workload.DefaultAux, AuxRows: 4})
	if err != nil {
		t.Fatal(err)
	}
	args := pool.Args()
	var states []kvargs.Buffer
	for _, item := range []uint64{128, 64} {
		h, err := transport.AllocHost("state", int64(4*item))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		m := h.Memory()
		m.Length = 4 * item
		states = append(states, kvargs.Buffer{Memory: m, ItemLen: item})
	}
	args.StateBuffers = states
	tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	cfg := engine.ManagerConfig{Role: role, KV: args, Transports: []transport.Transport{tr}, BootstrapAddr: addr, Checksum: role == engine.RoleDecode,
		BootstrapTimeout: 20 * time.Second, WaitingTimeout: 20 * time.Second}
	if role == engine.RoleDecode {
		cfg.BootstrapAddr = ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, err := engine.NewManager(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); tr.Close(); pool.Close() })
	return &rank{m: m, pool: pool}, states
}

// TestStateSlots: the prefill's state slots (SetStateIndices) land in the
// decode's slots (SendMetadata) with the last chunk, checksummed; a count
// mismatch fails both sides naming both counts.
func TestStateSlots(t *testing.T) {
	addr := startBootstrap(t)
	p, pst := newStateRank(t, engine.RolePrefill, addr)
	d, dst := newStateRank(t, engine.RoleDecode, addr)
	for i, b := range pst {
		mem := b.Bytes()
		for k := range mem {
			mem[k] = byte(i*100 + k*7 + 3)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	run := func(room uint64, src, dstIdx []int32) (*engine.Sender, *engine.Receiver) {
		r, err := d.m.NewReceiver(addr, room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		pg, _ := d.pool.Alloc(2)
		t.Cleanup(func() { d.pool.Free(pg) })
		if err := r.SendMetadata(pg, 1, dstIdx, 0); err != nil {
			t.Fatal(err)
		}
		s, err := p.m.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		s.Wait(ctx, engine.KVWaitingForInput)
		sp, _ := p.pool.Alloc(2)
		t.Cleanup(func() { p.pool.Free(sp) })
		if err := s.Init(2, 0); err != nil {
			t.Fatal(err)
		}
		if err := s.SetStateIndices(src); err != nil {
			t.Fatal(err)
		}
		if err := s.Send(sp, true); err != nil {
			t.Fatal(err)
		}
		r.Wait(ctx, engine.KVSuccess)
		s.Wait(ctx, engine.KVSuccess)
		return s, r
	}
	s, r := run(61, []int32{1, 3}, []int32{2, 0})
	if r.Poll() != engine.KVSuccess || s.Poll() != engine.KVSuccess {
		t.Fatalf("receiver %s %v, sender %s %v", r.Poll(), r.Failure(), s.Poll(), s.Failure())
	}
	for i := range pst {
		item := pst[i].ItemLen
		src, got := pst[i].Bytes(), dst[i].Bytes()
		if !bytes.Equal(got[2*item:3*item], src[1*item:2*item]) || !bytes.Equal(got[0:item], src[3*item:4*item]) {
			t.Fatalf("state buffer %d: slots 2 and 0 do not hold the prefill's slots 1 and 3", i)
		}
		if !bytes.Equal(got[item:2*item], make([]byte, item)) {
			t.Fatalf("state buffer %d: slot 1 was written", i)
		}
	}
	if mt := r.TransferMetric(); mt.AuxBytes != 2*(128+64)+auxBytes() {
		t.Fatalf("receiver metric %+v: want %d aux+state bytes", mt, 2*(128+64)+auxBytes())
	}
	if err := s.SetStateIndices([]int32{4}); err == nil || !strings.Contains(err.Error(), "state index 4 (position 0 of 1) is beyond state buffer") {
		t.Fatalf("state index 4: %v", err)
	}
	if err := s.SetStateIndices([]int32{1, 1}); err == nil || !strings.Contains(err.Error(), "state index 1 is given twice, at positions 0 and 1 of 2") {
		t.Fatalf("state indices [1 1]: %v", err)
	}
	s, r = run(62, []int32{1}, []int32{2, 0})
	want := "gave 2 state indices, this prefill sender has 1"
	if r.Poll() != engine.KVFailed || !strings.Contains(r.Failure().Error(), want) || s.Poll() != engine.KVFailed {
		t.Fatalf("receiver %s %v, sender %s: want both Failed with %q", r.Poll(), r.Failure(), s.Poll(), want)
	}
}

// auxBytes is one row of every DefaultAux buffer.
func auxBytes() uint64 {
	var n uint64
	for _, a := range workload.DefaultAux {
		n += a.RowBytes
	}
	return n
}

// TestWritesFollowContiguousRuns: TransferMetric.Writes counts one KV write
// per run of pages contiguous on both sides per buffer: a request on fresh
// pools is one write per buffer; on fragmented pools (workload's random
// free-list order) about one per page and buffer. Every byte still lands.
func TestWritesFollowContiguousRuns(t *testing.T) {
	for _, fragment := range []bool{false, true} {
		addr := startBootstrap(t)
		p := newBufRank(t, engine.RolePrefill, addr, sideOpts{smallGQA, workload.DefaultAux}, false)
		d := newBufRank(t, engine.RoleDecode, addr, sideOpts{smallGQA, workload.DefaultAux}, false)
		if fragment {
			p.pool.Fragment(1)
			d.pool.Fragment(2)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		const tokens = 4 * 20 // 20 pages of 4 tokens
		dst, _ := d.pool.Alloc(20)
		src, _ := p.pool.Alloc(20)
		r, err := d.m.NewReceiver(addr, 55)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if err := r.SendMetadata(dst, 0, nil, 0); err != nil {
			t.Fatal(err)
		}
		s, err := p.m.NewSender(55)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := workload.FillPattern(p.pool, 55, src, 0); err != nil {
			t.Fatal(err)
		}
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("sender %s: %v", st, s.Failure())
		}
		if _, err := s.InitTokens(tokens, 0); err != nil {
			t.Fatal(err)
		}
		if err := s.Send(src, true); err != nil {
			t.Fatal(err)
		}
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			t.Fatalf("receiver %s: %v", st, r.Failure())
		}
		if err := workload.VerifyPattern(d.pool, 55, dst, 0); err != nil {
			t.Fatal(err)
		}
		s.Wait(ctx, engine.KVSuccess)
		runs := 0
		for i := range src {
			if i == 0 || src[i] != src[i-1]+1 || dst[i] != dst[i-1]+1 {
				runs++
			}
		}
		nbuf := p.pool.Layout().NumBuffers()
		mt := s.TransferMetric()
		if mt.Writes != runs*nbuf {
			t.Errorf("fragment %v: %d writes, want %d runs x %d buffers = %d", fragment, mt.Writes, runs, nbuf, runs*nbuf)
		}
		if fragment && runs < 15 || !fragment && runs != 1 {
			t.Errorf("fragment %v: %d contiguous runs in 20 pages", fragment, runs)
		}
		t.Logf("fragment %v: %d pages, %d runs, %d writes of %d bytes on average", fragment, len(src), runs, mt.Writes, mt.Bytes/uint64(max(mt.Writes, 1)))
	}
}

// TestDecodeWithoutHeadCounts: a decode whose KVArgs give no kv_head_num /
// total_kv_head_num (SGLang's decode fills neither) takes the prefill's head
// geometry from REGISTER_ACK: at equal and different TP sizes every byte
// lands where a decode that stated its heads would have it (checksum on),
// and a decode whose rows are not the prefill's heads per rank is refused
// at registration on both sides, naming both.
func TestDecodeWithoutHeadCounts(t *testing.T) {
	for _, c := range []struct{ ptp, dtp int }{{1, 1}, {2, 1}, {1, 2}, {4, 2}} {
		t.Run(fmt.Sprintf("prefill tp %d decode tp %d", c.ptp, c.dtp), func(t *testing.T) {
			addr, pre, dec := topologyWith(t, smallGQA, c.ptp, 1, c.dtp, func(o *rankOpts) {
				o.noHeads, o.checksum = o.role == engine.RoleDecode, o.role == engine.RoleDecode
			})
			for _, d := range dec {
				if g := d.m.Geometry(); !g.HeadsUnknown() {
					t.Fatalf("decode geometry %+v: want heads unknown", g)
				}
			}
			for i, room := range []uint64{3, 1<<63 - 2} {
				for _, r := range transferOne(t, addr, pre, dec, room, 3+i) {
					if r.Poll() != engine.KVSuccess {
						t.Fatalf("room %d: %s %v", room, r.Poll(), r.Failure())
					}
				}
			}
		})
	}
	t.Run("rows of another model", func(t *testing.T) {
		// The decode's rows hold 2 heads of 16 elements, the prefill's
		// heads per rank are 4 of 16: taken from the prefill, they do not fit.
		addr := startBootstrap(t)
		p := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, addr: addr})
		d := newRank(t, rankOpts{role: engine.RoleDecode, model: workload.ModelConfig{Name: "narrow", NumLayers: 4, NumKVHeads: 2, HeadDim: 16, DtypeBytes: 2}, tp: 1, noHeads: true})
		s, err := p.m.NewSender(9)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		failsNaming(t, addr, d, 9, "refused this decode's registration", p.m.Endpoint(), d.m.Endpoint(),
			"decode's KVArgs give no KV head counts", "4 KV heads over decode tp 1 is 4 heads per token row of 32 bytes", "holds 64 bytes per token (2 heads)")
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if st := s.Wait(ctx, engine.KVSuccess); st != engine.KVFailed || !strings.Contains(s.Failure().Error(), "4 heads per token row") {
			t.Fatalf("sender %s %v: want Failed naming the refusal", st, s.Failure())
		}
	})
}
