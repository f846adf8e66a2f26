package engine

import (
	"bytes"
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
)

func sampleRegister() *RegisterMsg {
	return &RegisterMsg{Endpoint: "tcp://127.0.0.1:5555", TPRank: 1, TPSize: 2, StartLayer: 0, EndLayer: 2, NumLayer: 2,
		PageSize: 16, ItemLen: 4096, NumPages: 100, HeadsPerRank: 4, BufferOffsets: []uint64{0, 409600, 819200, 1228800}, RingSlots: 64, Epoch: 77,
		Transports: []TransportOffer{
			{Name: "tcp", Endpoint: []byte("127.0.0.1:4000"), KV: RegionDesc{ID: 1, Addr: 0x7f0000000000, Length: 1638400}, Ring: RegionDesc{ID: 2, Addr: 0x7f1000000000, Length: 4096}},
			{Name: "rdma", Endpoint: []byte{0, 1, 2, 255}, KV: RegionDesc{ID: 7, Length: 1638400, Kind: MemoryCUDA, Key: []byte{9, 9}}, Ring: RegionDesc{ID: 8, Length: 4096, Key: []byte{1}}},
		}}
}

func TestControlRoundTrip(t *testing.T) {
	msgs := []interface{ Encode() [][]byte }{
		sampleRegister(),
		&TransferMsg{Room: 0, Endpoint: "tcp://[::1]:9", Pages: []int32{3, 4, 5, 100}, Slot: 7, Generation: 9, RequiredDstInfoNum: 2, Checksum: true, Epoch: 5, Tokens: 61},
		&TransferMsg{Room: 1<<63 - 1, Endpoint: "tcp://h:1", Dummy: true, RequiredDstInfoNum: 1, Epoch: 1<<63 - 1},
		&AbortMsg{Room: 42, Endpoint: "tcp://h:1", Reason: "timeout", Epoch: 9},
		&AbortMsg{Room: 42, Endpoint: "tcp://h:1", Reason: "timeout"},
		&AbortAckMsg{Room: 42, Endpoint: "tcp://h:2", Producer: 3, Epoch: 9, Clean: true},
		&AbortAckMsg{Room: 0, Endpoint: "tcp://h:2", Epoch: 0, Detail: "batch abandoned"},
		&StatusMsg{Room: 42, State: KVSuccess, Producer: 3, Endpoint: "tcp://h:2", Epoch: 4},
		&StatusMsg{Room: 43, State: KVFailed, Producer: 0, Endpoint: "tcp://h:2", Reason: "batch failed"},
		&HandshakeMsg{Endpoint: "tcp://h:2", Transport: "rdma", Reply: []byte{1, 2, 3}, Epoch: 3},
		&HandshakeAckMsg{Endpoint: "tcp://h:1", Transport: "rdma", Err: "", Epoch: 3},
		&PingMsg{Endpoint: "tcp://h:1"},
	}
	for _, m := range msgs {
		got, err := DecodeControl(m.Encode())
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("%T round trip:\n got %+v\nwant %+v", m, got, m)
		}
	}
}

func TestControlRejects(t *testing.T) {
	good := (&StatusMsg{Room: 1, State: KVSuccess, Producer: 0, Endpoint: "tcp://h:1"}).Encode()
	mod := func(i int, v string) [][]byte {
		c := append([][]byte(nil), good...)
		c[i] = []byte(v)
		return c
	}
	cases := []struct {
		name  string
		parts [][]byte
		want  string
	}{
		{"empty", nil, "0 frames"},
		{"magic", mod(0, "NixlMsgGuard"), "want magic"},
		{"version", mod(1, "1"), "protocol version \"1\" not supported"},
		{"type", mod(2, "FOO"), "unknown message type"},
		{"room sign", mod(3, "-1"), "room"},
		{"room overflow", mod(3, "9223372036854775808"), "out of range"},
		{"room spaces", mod(3, " 1"), "ASCII decimal"},
		{"state", mod(4, "5"), "state"},
		{"endpoint", mod(6, ""), "endpoint is empty"},
		{"frames", good[:7], "want 9"},
		{"odd pages", (&TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode()[:5], "want 12"},
		{"transfer epoch 0", (&TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1}).Encode(), "epoch must be >= 1"},
		{"register epoch 0", func() [][]byte { m := sampleRegister(); m.Epoch = 0; return m.Encode() }(), "epoch must be >= 1"},
		{"tokens sign", func() [][]byte {
			f := (&TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode()
			f[11] = []byte("-3")
			return f
		}(), "tokens"},
		{"ack clean", func() [][]byte {
			f := (&AbortAckMsg{Room: 1, Endpoint: "e"}).Encode()
			f[7] = []byte("2")
			return f
		}(), "clean"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeControl(c.parts)
			if err == nil || !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want ErrBadFrame containing %q", err, c.want)
			}
		})
	}
	tr := (&TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{1, -2}, Slot: 1, RequiredDstInfoNum: 1, Epoch: 1}).Encode()
	if _, err := DecodeTransfer(tr); err == nil || !strings.Contains(err.Error(), "negative") {
		t.Fatalf("negative page accepted: %v", err)
	}
	tr[5] = []byte{1, 2, 3}
	if _, err := DecodeTransfer(tr); err == nil {
		t.Fatal("3-byte page array accepted")
	}
	reg := sampleRegister().Encode()
	reg[14] = reg[14][:8]
	if _, err := DecodeRegister(reg); err == nil || !strings.Contains(err.Error(), "buffer_offsets has 1 entries, want 4") {
		t.Fatalf("short offsets: %v", err)
	}
	reg = sampleRegister().Encode()
	reg[len(reg)-1] = reg[len(reg)-1][:10]
	if _, err := DecodeRegister(reg); err == nil || !strings.Contains(err.Error(), "region table") {
		t.Fatalf("short region table: %v", err)
	}
}

func TestRecordRoundTrip(t *testing.T) {
	r := MetaRecord{Room: 0, Generation: 5, PageCount: 3, Producer: 2, ByteCount: 1 << 33, Checksum: 0xdeadbeef, Flags: RecordFlagChecksum,
		TokenCount: 45, Epoch: 1<<40 + 3}
	b := make([]byte, RecordSize)
	r.EncodeBody(b)
	got, err := DecodeRecord(b)
	if err != nil || got.Committed() {
		t.Fatalf("uncommitted record: %+v %v", got, err)
	}
	r.EncodeCommit(b)
	got, err = DecodeRecord(b)
	r.Commit = RecordCommitMagic ^ 5
	if err != nil || !got.Committed() || got != r {
		t.Fatalf("got %+v %v, want %+v", got, err, r)
	}
	if b[RecordTokenCountOffset] != 45 || b[RecordEpochOffset] != 3 || b[RecordEpochOffset+5] != 1 {
		t.Fatalf("token_count/epoch not at their documented offsets: % x", b)
	}
	b[44] = 1
	if _, err := DecodeRecord(b); err == nil {
		t.Fatal("non-zero reserved bytes accepted")
	}
	if _, err := DecodeRecord(b[:63]); err == nil {
		t.Fatal("short record accepted")
	}
}

func TestMetaRing(t *testing.T) {
	r, err := NewMetaRing(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s0, g0, _ := r.Acquire()
	s1, _, _ := r.Acquire()
	if _, _, err := r.Acquire(); err == nil {
		t.Fatal("third slot of a 2-slot ring")
	}
	rec := MetaRecord{Room: 9, Generation: g0}
	b := r.mem.Bytes()[r.Offset(s0):]
	rec.EncodeBody(b)
	rec.EncodeCommit(b)
	got, err := r.Read(s0)
	if err != nil || !got.Committed() || got.Room != 9 {
		t.Fatalf("read %+v %v", got, err)
	}
	r.Release(s0)
	s2, g2, _ := r.Acquire()
	got, _ = r.Read(s2)
	if s2 != s0 || g2 == g0 || got.Committed() {
		t.Fatalf("reacquired slot %d gen %d (old %d) committed %v: a stale record must not look committed", s2, g2, g0, got.Committed())
	}
	_ = s1
	if _, err := r.Read(5); err == nil {
		t.Fatal("read outside the ring")
	}
}

func TestLayouts(t *testing.T) {
	cases := []struct {
		model           string
		tp, tpRank, pp  int
		ppRank          int
		itemLen         uint64
		buffers, layers int
		start           int
	}{
		{"llama-3.1-8b", 1, 0, 1, 0, 16 * 8 * 128 * 2, 64, 32, 0},
		{"llama-3.1-8b", 2, 1, 1, 0, 16 * 4 * 128 * 2, 64, 32, 0},
		{"llama-3.1-8b", 16, 3, 1, 0, 16 * 1 * 128 * 2, 64, 32, 0}, // GQA replicas
		{"llama-3.1-70b", 1, 0, 2, 1, 16 * 8 * 128 * 2, 80, 40, 40},
		{"qwen2.5-7b", 1, 0, 3, 2, 16 * 4 * 128 * 2, 18, 9, 19},
		{"qwen3-32b", 8, 7, 1, 0, 16 * 1 * 128 * 2, 128, 64, 0},
		{"deepseek-v3", 8, 5, 1, 0, 16 * 576 * 2, 61, 61, 0}, // MLA: replicated latent
	}
	for _, c := range cases {
		m, err := LookupModel(c.model)
		if err != nil {
			t.Fatal(err)
		}
		l, err := NewLayout(m, LayoutOptions{TPSize: c.tp, TPRank: c.tpRank, PPSize: c.pp, PPRank: c.ppRank, NumPages: 10})
		if err != nil {
			t.Fatalf("%s: %v", c.model, err)
		}
		if l.ItemLen() != c.itemLen || l.NumBuffers() != c.buffers || l.Layers() != c.layers || l.StartLayer != c.start {
			t.Errorf("%s tp %d/%d pp %d/%d: item %d buffers %d layers %d start %d; want %d %d %d %d", c.model, c.tpRank, c.tp, c.ppRank, c.pp,
				l.ItemLen(), l.NumBuffers(), l.Layers(), l.StartLayer, c.itemLen, c.buffers, c.layers, c.start)
		}
		if l.PoolBytes() != uint64(c.buffers)*10*c.itemLen {
			t.Errorf("%s: pool bytes %d", c.model, l.PoolBytes())
		}
	}
	m, _ := LookupModel("llama-3.1-8b")
	for _, o := range []LayoutOptions{{TPSize: 3, NumPages: 1}, {TPSize: 2, TPRank: 2, NumPages: 1}, {PPSize: 33, NumPages: 1}, {NumPages: 0}} {
		if _, err := NewLayout(m, o); err == nil {
			t.Errorf("layout %+v accepted", o)
		}
	}
	if _, err := LookupModel("gpt-9"); err == nil || !strings.Contains(err.Error(), "llama-3.1-8b") {
		t.Errorf("unknown model error does not list the built-ins: %v", err)
	}
}

func TestSliceHeads(t *testing.T) {
	m := ModelConfig{NumLayers: 2, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2}
	lay := func(tp, r int) *Layout {
		l, err := NewLayout(m, LayoutOptions{TPSize: tp, TPRank: r, NumPages: 1})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	hb := uint64(256)
	cases := []struct {
		src, dst       *Layout
		srcOff, dstOff uint64
		length         uint64
	}{
		{lay(1, 0), lay(1, 0), 0, 0, 8 * hb},
		{lay(2, 0), lay(1, 0), 0, 0, 4 * hb},
		{lay(2, 1), lay(1, 0), 0, 4 * hb, 4 * hb},
		{lay(1, 0), lay(2, 1), 4 * hb, 0, 4 * hb},
		{lay(4, 3), lay(2, 1), 0, 2 * hb, 2 * hb},
		{lay(2, 1), lay(16, 15), 3 * hb, 0, hb}, // decode rank 15 holds head 7 = src rank 1's head 3
	}
	for i, c := range cases {
		s, err := SliceHeads(c.src, c.dst)
		if err != nil || s.SrcOffset != c.srcOff || s.DstOffset != c.dstOff || s.Length != c.length {
			t.Errorf("case %d: %+v %v; want src %d dst %d len %d", i, s, err, c.srcOff, c.dstOff, c.length)
		}
	}
}

func TestLoadHFConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := dir + "/" + name
		if err := osWriteFile(p, body); err != nil {
			t.Fatal(err)
		}
		return p
	}
	m, err := LoadHFConfig(write("llama.json", `{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}`))
	if err != nil || m.NumLayers != 32 || m.NumKVHeads != 8 || m.HeadDim != 128 || m.DtypeBytes != 2 || m.MLA {
		t.Fatalf("llama config: %+v %v", m, err)
	}
	m, err = LoadHFConfig(write("ds.json", `{"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}`))
	if err != nil || !m.MLA || m.HeadDim != 576 || m.NumKVHeads != 1 {
		t.Fatalf("deepseek config: %+v %v", m, err)
	}
	m, err = LookupModel(write("vl.json", `{"text_config": {"num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64}}`))
	if err != nil || m.NumLayers != 4 || m.HeadDim != 64 {
		t.Fatalf("nested text_config: %+v %v", m, err)
	}
	for body, want := range map[string]string{
		`{"num_attention_heads": 4}`: "num_hidden_layers",
		`{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}`:                      "not a positive multiple",
		`{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "torch_dtype": "int4"}`: "torch_dtype",
		`[1,2]`: "not valid JSON",
	} {
		if _, err := LoadHFConfig(write("bad.json", body)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err %v, want %q", body, err, want)
		}
	}
}

func TestPageAllocator(t *testing.T) {
	a := NewPageAllocator(8)
	p1, err := a.Alloc(3)
	if err != nil || !reflect.DeepEqual(p1, []int32{0, 1, 2}) {
		t.Fatalf("alloc 3: %v %v", p1, err)
	}
	p2, _ := a.Alloc(4)
	if _, err := a.Alloc(2); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("over-allocation: %v", err)
	}
	if err := a.Free([]int32{1}); err != nil {
		t.Fatal(err)
	}
	if err := a.Free([]int32{1}); err == nil {
		t.Fatal("double free accepted")
	}
	if err := a.Free([]int32{8}); err == nil {
		t.Fatal("out-of-range free accepted")
	}
	if err := a.Free([]int32{0, 0}); err == nil || a.FreePages() != 2 {
		t.Fatalf("duplicate in one free: %v, free %d", err, a.FreePages())
	}
	p3, _ := a.Alloc(2)
	if !reflect.DeepEqual(p3, []int32{1, 7}) {
		t.Fatalf("lowest-first after free: %v", p3)
	}
	_ = p2
	if _, err := a.Alloc(-1); err == nil {
		t.Fatal("negative count accepted")
	}
}

func FuzzDecodeControl(f *testing.F) {
	for _, m := range []interface{ Encode() [][]byte }{
		sampleRegister(),
		&TransferMsg{Room: 5, Endpoint: "tcp://h:1", Pages: []int32{1, 2}, Slot: 1, Generation: 2, RequiredDstInfoNum: 1, Epoch: 3, Tokens: 7},
		&StatusMsg{Room: 1, State: KVSuccess, Endpoint: "tcp://h:1", Epoch: 2},
		&AbortMsg{Room: 1, Endpoint: "e", Reason: "r", Epoch: 4},
		&AbortAckMsg{Room: 1, Endpoint: "e", Producer: 1, Epoch: 4, Clean: true, Detail: "d"},
		&HandshakeMsg{Endpoint: "e", Transport: "rdma", Reply: []byte{1}, Epoch: 1},
		&HandshakeAckMsg{Endpoint: "e", Transport: "rdma", Epoch: 1},
		&PingMsg{Endpoint: "e"},
	} {
		f.Add(bytes.Join(m.Encode(), []byte{0}))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		parts := bytes.Split(data, []byte{0})
		msg, err := DecodeControl(parts)
		if err != nil {
			if !errors.Is(err, ErrBadFrame) {
				t.Fatalf("error does not wrap ErrBadFrame: %v", err)
			}
			return
		}
		// Whatever decodes must re-encode and decode to the same value.
		enc := msg.(interface{ Encode() [][]byte }).Encode()
		again, err := DecodeControl(enc)
		if err != nil || !reflect.DeepEqual(again, msg) {
			t.Fatalf("re-decode: %+v %v, first %+v", again, err, msg)
		}
	})
}

func FuzzDecodeRegister(f *testing.F) {
	f.Add(bytes.Join(sampleRegister().Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		parts := append(header(MsgRegister), bytes.Split(data, []byte{0})...)
		m, err := DecodeRegister(parts)
		if err == nil && (m.TPRank >= m.TPSize || m.StartLayer >= m.EndLayer || len(m.Transports) > maxTransports) {
			t.Fatalf("accepted inconsistent REGISTER %+v", m)
		}
	})
}

func FuzzDecodeTransfer(f *testing.F) {
	f.Add(bytes.Join((&TransferMsg{Room: 5, Endpoint: "tcp://h:1", Pages: []int32{1, 2}, Slot: 1, RequiredDstInfoNum: 1, Epoch: 2, Tokens: 8}).Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeTransfer(append(header(MsgTransfer), bytes.Split(data, []byte{0})...))
		if err == nil {
			for _, p := range m.Pages {
				if p < 0 {
					t.Fatalf("accepted negative page %d", p)
				}
			}
			if m.Room > maxRoom || m.RequiredDstInfoNum < 1 || m.Epoch < 1 || m.Tokens < 0 {
				t.Fatalf("accepted %+v", m)
			}
		}
	})
}

func FuzzDecodeStatus(f *testing.F) {
	f.Add(bytes.Join((&StatusMsg{Room: 1, State: KVFailed, Producer: 2, Endpoint: "e", Reason: "x", Epoch: 3}).Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeStatus(append(header(MsgStatus), bytes.Split(data, []byte{0})...))
		if err == nil && !m.State.Valid() {
			t.Fatalf("accepted state %d", m.State)
		}
	})
}

func FuzzDecodeAbortHandshakePing(f *testing.F) {
	f.Add(uint8(0), []byte("1\x00e\x00reason\x005"))
	f.Add(uint8(1), []byte("e\x00rdma\x00\x01\x02\x003"))
	f.Add(uint8(2), []byte("e\x00rdma\x00\x003"))
	f.Add(uint8(3), []byte("e"))
	f.Add(uint8(4), []byte("1\x00e\x002\x009\x001\x00detail"))
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		rest := bytes.Split(data, []byte{0})
		switch which % 5 {
		case 4:
			if m, err := DecodeAbortAck(append(header(MsgAbortAck), rest...)); err == nil && m.Room > maxRoom {
				t.Fatalf("accepted room %d", m.Room)
			}
		case 0:
			_, _ = DecodeAbort(append(header(MsgAbort), rest...))
		case 1:
			_, _ = DecodeHandshake(append(header(MsgHandshake), rest...))
		case 2:
			_, _ = DecodeHandshakeAck(append(header(MsgHandshakeAck), rest...))
		default:
			_, _ = DecodePing(append(header(MsgPing), rest...))
		}
	})
}

func FuzzUnpackRegions(f *testing.F) {
	f.Add(PackRegions(sampleRegister().Transports[1:][0].regions()))
	f.Fuzz(func(t *testing.T, b []byte) {
		rs, err := UnpackRegions(b)
		if err == nil && !bytes.Equal(PackRegions(rs), b) {
			t.Fatalf("region table does not re-encode to its input")
		}
	})
}

func (o TransportOffer) regions() []RegionDesc { return []RegionDesc{o.KV, o.Ring} }

func FuzzDecodeRecord(f *testing.F) {
	b := make([]byte, RecordSize)
	r := MetaRecord{Room: 3, Generation: 1, PageCount: 2}
	r.EncodeBody(b)
	r.EncodeCommit(b)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, err := DecodeRecord(b)
		if err != nil {
			return
		}
		out := make([]byte, RecordSize)
		rec.EncodeBody(out)
		if !bytes.Equal(out[:RecordCommitOffset], b[:RecordCommitOffset]) {
			t.Fatalf("record body does not re-encode")
		}
		if rec.Committed() != (rec.Commit == RecordCommitMagic^rec.Generation) {
			t.Fatal("Committed disagrees with the commit word")
		}
	})
}

func osWriteFile(p, body string) error { return os.WriteFile(p, []byte(body), 0o644) }
