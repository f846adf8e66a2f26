package control

import (
	"bytes"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

func sampleGeometry() kvargs.Geometry {
	return kvargs.Geometry{TPRank: 1, TPSize: 2, PPRank: 0, PPSize: 1, StartLayer: 0, EndLayer: 2, PageSize: 16, KVHeadNum: 4, TotalKVHeadNum: 8,
		KVItemLens: []uint64{4096, 4096, 4096, 4096}, KVItems: []uint64{100, 100, 100, 99},
		AuxItemLens: []uint64{64, 512}, AuxItems: []uint64{32, 32}}
}

func sampleRegister() *RegisterMsg {
	kv := func(base transport.RegionID, kind transport.MemoryKind, key []byte) []transport.RegionDesc {
		var out []transport.RegionDesc
		for i := range 4 {
			out = append(out, transport.RegionDesc{ID: base + transport.RegionID(i), Addr: 0x7f0000000000 + uint64(i)<<20, Length: 409600, Kind: kind, Key: key})
		}
		return out
	}
	aux := []transport.RegionDesc{{ID: 20, Addr: 0x7f2000000000, Length: 2048}, {ID: 21, Addr: 0x7f3000000000, Length: 16384}}
	return &RegisterMsg{Endpoint: "tcp://127.0.0.1:5555", Geometry: sampleGeometry(), RingSlots: 64, Epoch: 77,
		Transports: []TransportOffer{
			{Name: "tcp", Endpoint: []byte("127.0.0.1:4000"), Ring: transport.RegionDesc{ID: 2, Addr: 0x7f1000000000, Length: 4096}, KV: kv(3, transport.MemoryHost, nil), Aux: aux, State: []transport.RegionDesc{}},
			{Name: "rdma", Endpoint: []byte{0, 1, 2, 255}, Ring: transport.RegionDesc{ID: 8, Length: 4096, Key: []byte{1}}, KV: kv(9, transport.MemoryCUDA, []byte{9, 9}), Aux: aux, State: []transport.RegionDesc{}},
		}}
}

func TestControlRoundTrip(t *testing.T) {
	msgs := []interface{ Encode() [][]byte }{
		sampleRegister(),
		&RegisterAckMsg{Endpoint: "tcp://h:2", Geometry: sampleGeometry(), Epoch: 77},
		&RegisterAckMsg{Endpoint: "tcp://h:2", Err: "aux buffer counts differ", Geometry: sampleGeometry(), Epoch: 1},
		&TransferMsg{Attempt: 3, Room: 0, Endpoint: "tcp://[::1]:9", Pages: []int32{3, 4, 5, 100}, Slot: 7, Generation: 9, RequiredDstInfoNum: 2, Checksum: true, Epoch: 5, Tokens: 61, AuxIndex: -1},
		&TransferMsg{Attempt: 3, Room: 3, Endpoint: "tcp://[::1]:9", Pages: []int32{8}, Slot: 1, Generation: 2, RequiredDstInfoNum: 1, Epoch: 1, AuxIndex: 5, StateIndices: []int32{2, 0}, PrefixTokens: 512},
		&TransferMsg{Attempt: 3, Room: 4, Endpoint: "tcp://[::1]:9", Pages: []int32{}, Slot: 1, Generation: 2, RequiredDstInfoNum: 1, Epoch: 1, AuxIndex: 0, PrefixTokens: 64},
		&TransferMsg{Attempt: 3, Room: 1<<63 - 1, Endpoint: "tcp://h:1", Dummy: true, RequiredDstInfoNum: 1, Epoch: 1<<63 - 1, AuxIndex: -1},
		&AbortMsg{Room: 42, Endpoint: "tcp://h:1", Reason: "timeout", Epoch: 9, Attempt: 1<<63 - 1},
		&AbortMsg{Room: 42, Endpoint: "tcp://h:1", Reason: "timeout"},
		&AbortAckMsg{Room: 42, Endpoint: "tcp://h:2", Producer: 3, Epoch: 9, Clean: true, Attempt: 12},
		&AbortAckMsg{Room: 0, Endpoint: "tcp://h:2", Epoch: 0, Detail: "batch abandoned"},
		&StatusMsg{Room: 42, State: StatusSuccess, Producer: 3, Endpoint: "tcp://h:2", Epoch: 4},
		&StatusMsg{Room: 43, State: StatusFailed, Producer: 0, Endpoint: "tcp://h:2", Reason: "batch failed"},
		&HandshakeMsg{Endpoint: "tcp://h:2", Transport: "rdma", Reply: []byte{1, 2, 3}, Epoch: 3},
		&HandshakeAckMsg{Endpoint: "tcp://h:1", Transport: "rdma", Err: "", Epoch: 3},
		&PingMsg{Endpoint: "tcp://h:1"},
		&SubscribeMsg{Room: 1<<63 - 1, Endpoint: "tcp://[::1]:9", Epoch: 12},
		&StatusMsg{Room: 44, State: StatusWaitingForInput, Producer: 1, Endpoint: "tcp://h:2", Epoch: 12},
		&VerdictAckMsg{Room: 1<<63 - 1, Endpoint: "tcp://h:2", Epoch: 7, Attempt: 1<<63 - 1, Accepted: true},
		&VerdictAckMsg{Room: 45, Endpoint: "tcp://[::1]:9", Epoch: 1, Detail: "timed out waiting for the decode's verdict"},
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
	good := (&StatusMsg{Room: 1, State: StatusSuccess, Producer: 0, Endpoint: "tcp://h:1"}).Encode()
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
		{"version", mod(1, "2"), "protocol version \"2\" not supported"},
		{"type", mod(2, "FOO"), "unknown message type"},
		{"room sign", mod(3, "-1"), "room"},
		{"room overflow", mod(3, "9223372036854775808"), "out of range"},
		{"room spaces", mod(3, " 1"), "ASCII decimal"},
		{"state", mod(4, "5"), "state"},
		{"endpoint", mod(6, ""), "endpoint is empty"},
		{"frames", good[:7], "want 9"},
		{"odd pages", (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode()[:5], "want 16"},
		{"transfer epoch 0", (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1}).Encode(), "epoch must be >= 1"},
		{"register epoch 0", func() [][]byte { m := sampleRegister(); m.Epoch = 0; return m.Encode() }(), "epoch must be >= 1"},
		{"tokens sign", func() [][]byte {
			f := (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode()
			f[11] = []byte("-3")
			return f
		}(), "tokens"},
		{"transfer attempt 0", (&TransferMsg{Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode(), "TRANSFER frame 15: attempt must be >= 1"},
		{"transfer v6 layout", (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 1}).Encode()[:15], "TRANSFER has 15 frames, want 16"},
		{"abort v6 layout", (&AbortMsg{Room: 1, Endpoint: "e", Reason: "r", Epoch: 1}).Encode()[:7], "ABORT has 7 frames, want 8"},
		{"ack v6 layout", (&AbortAckMsg{Room: 1, Endpoint: "e"}).Encode()[:9], "ABORT_ACK has 9 frames, want 10"},
		{"abort attempt 2^63", func() [][]byte {
			f := (&AbortMsg{Room: 1, Endpoint: "e", Reason: "r", Epoch: 1}).Encode()
			f[7] = []byte("9223372036854775808")
			return f
		}(), "ABORT frame 7: attempt"},
		{"ack attempt text", func() [][]byte {
			f := (&AbortAckMsg{Room: 1, Endpoint: "e"}).Encode()
			f[9] = []byte("x")
			return f
		}(), "ABORT_ACK frame 9: attempt"},
		{"ack clean", func() [][]byte {
			f := (&AbortAckMsg{Room: 1, Endpoint: "e"}).Encode()
			f[7] = []byte("2")
			return f
		}(), "clean"},
		{"verdict ack short", (&VerdictAckMsg{Room: 1, Endpoint: "e", Epoch: 1}).Encode()[:8], "VERDICT_ACK has 8 frames, want 9"},
		{"verdict ack accepted", func() [][]byte {
			f := (&VerdictAckMsg{Room: 1, Endpoint: "e", Epoch: 1}).Encode()
			f[7] = []byte("2")
			return f
		}(), "VERDICT_ACK frame 7: accepted"},
		{"verdict ack room 2^63", func() [][]byte {
			f := (&VerdictAckMsg{Room: 1, Endpoint: "e", Epoch: 1}).Encode()
			f[3] = []byte("9223372036854775808")
			return f
		}(), "VERDICT_ACK frame 3: room"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeControl(c.parts)
			if err == nil || !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want ErrBadFrame containing %q", err, c.want)
			}
		})
	}
	sub := (&SubscribeMsg{Room: 1, Endpoint: "tcp://h:1", Epoch: 1}).Encode()
	sub[5] = []byte("0")
	if _, err := DecodeControl(sub); err == nil || !strings.Contains(err.Error(), "SUBSCRIBE frame 5: epoch must be >= 1") {
		t.Fatalf("SUBSCRIBE with epoch 0: %v", err)
	}
	sub[3] = []byte("9223372036854775808") // 2^63
	if _, err := DecodeControl(sub); err == nil || !strings.Contains(err.Error(), "room") {
		t.Fatalf("SUBSCRIBE with room 2^63: %v", err)
	}
	if _, err := DecodeControl(append(sub, []byte("x"))); err == nil {
		t.Fatal("SUBSCRIBE with an extra frame accepted")
	}
	tr := (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1, -2}, Slot: 1, RequiredDstInfoNum: 1, Epoch: 1}).Encode()
	if _, err := DecodeTransfer(tr); err == nil || !strings.Contains(err.Error(), "negative") {
		t.Fatalf("negative page accepted: %v", err)
	}
	tr[5] = []byte{1, 2, 3}
	if _, err := DecodeTransfer(tr); err == nil {
		t.Fatal("3-byte page array accepted")
	}
	tr = (&TransferMsg{Attempt: 3, Room: 1, Endpoint: "e", Pages: []int32{1}, Slot: 1, RequiredDstInfoNum: 1, Epoch: 1, AuxIndex: -1, StateIndices: []int32{-1}}).Encode()
	if _, err := DecodeTransfer(tr); err == nil || !strings.Contains(err.Error(), "state index -1 is negative") {
		t.Fatalf("negative state index accepted: %v", err)
	}
	tr[12] = []byte("x")
	if _, err := DecodeTransfer(tr); err == nil || !strings.Contains(err.Error(), "aux index") {
		t.Fatalf("bad aux index accepted: %v", err)
	}
	regCases := []struct {
		frame int
		val   []byte
		want  string
	}{
		{14, packU64([]uint64{4096}), "1 KV item lengths and 4 counts, want 4 each"},
		{15, packU64([]uint64{1, 2, 3, 0}), "kv_items: entry 0 out of range"},
		{16, packU64([]uint64{64}), "1 aux item lengths but 2 row counts"},
		{8, []byte("2"), "layers [2, 2) are empty"},
		{6, []byte("1"), "pp_rank 1 not in [0, pp_size 1)"},
		{11, []byte("0"), "page_size must be > 0"},
		{12, []byte("0"), "kv_head_num 0 and total_kv_head_num 8: both > 0, or both 0"},
		{13, []byte("0"), "kv_head_num 4 and total_kv_head_num 0: both > 0, or both 0"},
		{20, []byte("0"), "ring_slots must be > 0"},
		{21, []byte("0"), "epoch must be >= 1"},
	}
	for _, c := range regCases {
		reg := sampleRegister().Encode()
		reg[c.frame] = c.val
		if _, err := DecodeRegister(reg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("REGISTER frame %d = %q: err %v, want %q", c.frame, c.val, err, c.want)
		}
	}
	// A decode that states no head counts (SGLang's KVArgs) sends both 0:
	// accepted, and they arrive as 0 (unknown), not as a default.
	reg := sampleRegister().Encode()
	reg[12], reg[13] = []byte("0"), []byte("0")
	if m, err := DecodeRegister(reg); err != nil || m.Geometry.KVHeadNum != 0 || m.Geometry.TotalKVHeadNum != 0 || !m.Geometry.HeadsUnknown() {
		t.Fatalf("REGISTER with unknown heads: %+v, %v; want accepted with both 0", m, err)
	}
	reg[10] = []byte("1") // the same on an MLA rank is refused
	if _, err := DecodeRegister(reg); err == nil || !strings.Contains(err.Error(), "kv_head_num 0 on an MLA rank") {
		t.Fatalf("MLA REGISTER with 0 heads: %v", err)
	}
	reg = sampleRegister().Encode()
	reg[len(reg)-1] = reg[len(reg)-1][:10]
	if _, err := DecodeRegister(reg); err == nil || !strings.Contains(err.Error(), "region table") {
		t.Fatalf("short region table: %v", err)
	}
	// A table missing one buffer's region is refused, naming the expected count.
	o := sampleRegister()
	o.Transports[0].KV = o.Transports[0].KV[:3]
	if _, err := DecodeRegister(o.Encode()); err == nil || !strings.Contains(err.Error(), "region table has 6 regions, want 7 (metadata ring, 4 KV, 2 aux, 0 state buffers)") {
		t.Fatalf("missing KV region: %v", err)
	}
}

func FuzzDecodeControl(f *testing.F) {
	for _, m := range []interface{ Encode() [][]byte }{
		sampleRegister(),
		&RegisterAckMsg{Endpoint: "tcp://h:2", Geometry: sampleGeometry(), Epoch: 2},
		&TransferMsg{Attempt: 3, Room: 5, Endpoint: "tcp://h:1", Pages: []int32{1, 2}, Slot: 1, Generation: 2, RequiredDstInfoNum: 1, Epoch: 3, Tokens: 7, AuxIndex: 3, StateIndices: []int32{1}, PrefixTokens: 16},
		&StatusMsg{Room: 1, State: StatusSuccess, Endpoint: "tcp://h:1", Epoch: 2},
		&AbortMsg{Room: 1, Endpoint: "e", Reason: "r", Epoch: 4, Attempt: 6},
		&AbortAckMsg{Room: 1, Endpoint: "e", Producer: 1, Epoch: 4, Clean: true, Detail: "d", Attempt: 6},
		&HandshakeMsg{Endpoint: "e", Transport: "rdma", Reply: []byte{1}, Epoch: 1},
		&HandshakeAckMsg{Endpoint: "e", Transport: "rdma", Epoch: 1},
		&PingMsg{Endpoint: "e"},
		&SubscribeMsg{Room: 7, Endpoint: "tcp://h:1", Epoch: 3},
		&VerdictAckMsg{Room: 7, Endpoint: "tcp://h:1", Epoch: 3, Attempt: 2, Accepted: true},
		&ProbeMsg{Endpoint: "tcp://h:3", ID: 9, Length: 64, Transports: []ProbeOffer{{Name: "tcp", Endpoint: []byte("h:4"), Region: transport.RegionDesc{ID: 1, Addr: 4096, Length: 64}}}},
		&ProbeResultMsg{Endpoint: "tcp://h:1", ID: 9, Rank: "prefill dp0/tp0/pp0", Transports: []string{"tcp", "shm"},
			Results: []ProbeResult{{Transport: "tcp", Handshake: 3 * time.Microsecond, Transfer: 9 * time.Microsecond}, {Transport: "shm", Stage: "handshake", Err: "x", NotApplicable: true}}},
		&ProbeResultMsg{Endpoint: "tcp://h:1", ID: 9, Refused: "no"},
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
		if err != nil {
			return
		}
		g := m.Geometry
		if g.TPRank >= g.TPSize || g.StartLayer >= g.EndLayer || len(m.Transports) > maxTransports || len(g.KVItemLens) != len(g.KVItems) || m.Epoch < 1 {
			t.Fatalf("accepted inconsistent REGISTER %+v", m)
		}
		for _, o := range m.Transports {
			if len(o.KV) != len(g.KVItemLens) || len(o.Aux) != len(g.AuxItemLens) || len(o.State) != len(g.StateItemLens) {
				t.Fatalf("accepted a region table that does not match the buffers: %+v", o)
			}
		}
	})
}

func FuzzDecodeRegisterAck(f *testing.F) {
	f.Add(bytes.Join((&RegisterAckMsg{Endpoint: "tcp://h:2", Err: "x", Geometry: sampleGeometry(), Epoch: 3}).Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeRegisterAck(append(header(MsgRegisterAck), bytes.Split(data, []byte{0})...))
		if err == nil && (m.Geometry.PPRank >= m.Geometry.PPSize || m.Geometry.PageSize == 0 || len(m.Geometry.AuxItemLens) != len(m.Geometry.AuxItems)) {
			t.Fatalf("accepted inconsistent REGISTER_ACK %+v", m)
		}
	})
}

func FuzzDecodeTransfer(f *testing.F) {
	f.Add(bytes.Join((&TransferMsg{Attempt: 3, Room: 5, Endpoint: "tcp://h:1", Pages: []int32{1, 2}, Slot: 1, RequiredDstInfoNum: 1, Epoch: 2, Tokens: 8, AuxIndex: 2, StateIndices: []int32{4}, PrefixTokens: 32}).Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeTransfer(append(header(MsgTransfer), bytes.Split(data, []byte{0})...))
		if err == nil {
			for _, p := range m.Pages {
				if p < 0 {
					t.Fatalf("accepted negative page %d", p)
				}
			}
			for _, p := range m.StateIndices {
				if p < 0 {
					t.Fatalf("accepted negative state index %d", p)
				}
			}
			if m.Room > MaxRoom || m.RequiredDstInfoNum < 1 || m.Epoch < 1 || m.Tokens < 0 || m.PrefixTokens < 0 || m.AuxIndex < -1 || m.Attempt < 1 || m.Attempt > MaxAttempt {
				t.Fatalf("accepted %+v", m)
			}
		}
	})
}

func FuzzDecodeStatus(f *testing.F) {
	f.Add(bytes.Join((&StatusMsg{Room: 1, State: StatusFailed, Producer: 2, Endpoint: "e", Reason: "x", Epoch: 3}).Encode()[3:], []byte{0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeStatus(append(header(MsgStatus), bytes.Split(data, []byte{0})...))
		if err == nil && (m.State < StatusFailed || m.State > StatusSuccess) {
			t.Fatalf("accepted state %d", m.State)
		}
	})
}

func FuzzDecodeAbortHandshakePing(f *testing.F) {
	f.Add(uint8(0), []byte("1\x00e\x00reason\x005\x007"))
	f.Add(uint8(0), []byte("1\x00e\x00reason\x005"))
	f.Add(uint8(1), []byte("e\x00rdma\x00\x01\x02\x003"))
	f.Add(uint8(2), []byte("e\x00rdma\x00\x003"))
	f.Add(uint8(3), []byte("e"))
	f.Add(uint8(4), []byte("1\x00e\x002\x009\x001\x00detail\x0011"))
	f.Add(uint8(4), []byte("1\x00e\x002\x009\x001\x00detail"))
	f.Add(uint8(5), []byte("1\x00e\x002\x003\x001\x00"))
	f.Add(uint8(5), []byte("1\x00e\x002\x003\x000\x00failed"))
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		rest := bytes.Split(data, []byte{0})
		switch which % 6 {
		case 5:
			if m, err := DecodeVerdictAck(append(header(MsgVerdictAck), rest...)); err == nil && (m.Room > MaxRoom || m.Attempt > MaxAttempt) {
				t.Fatalf("accepted room %d attempt %d", m.Room, m.Attempt)
			}
		case 4:
			if m, err := DecodeAbortAck(append(header(MsgAbortAck), rest...)); err == nil && (m.Room > MaxRoom || m.Attempt > MaxAttempt) {
				t.Fatalf("accepted room %d attempt %d", m.Room, m.Attempt)
			}
		case 0:
			if m, err := DecodeAbort(append(header(MsgAbort), rest...)); err == nil && (m.Room > MaxRoom || m.Attempt > MaxAttempt) {
				t.Fatalf("accepted room %d attempt %d", m.Room, m.Attempt)
			}
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
	f.Add(packRegions(sampleRegister().Transports[1:][0].Regions()))
	f.Fuzz(func(t *testing.T, b []byte) {
		rs, err := unpackRegions(b)
		if err == nil && !bytes.Equal(packRegions(rs), b) {
			t.Fatalf("region table does not re-encode to its input")
		}
	})
}

// DecodeForeign reads the fields every version keeps from a frame of
// another version, and refuses what does not hold them.
func TestDecodeForeign(t *testing.T) {
	as := func(v int, frames [][]byte) [][]byte {
		frames[1] = []byte(strconv.Itoa(v))
		return SealControl(frames, "inst", 1, 1, time.Now(), nil)
	}
	for _, c := range []struct {
		name  string
		parts [][]byte
		want  ForeignFrame
		bad   bool
	}{
		{"register v5", as(5, sampleRegister().Encode()), ForeignFrame{Version: 5, Type: MsgRegister, Endpoint: sampleRegister().Endpoint}, false},
		{"abort v9", as(9, (&AbortMsg{Room: 9, Endpoint: "tcp://h:1", Reason: "r", Epoch: 2, Attempt: 4}).Encode()),
			ForeignFrame{Version: 9, Type: MsgAbort, Endpoint: "tcp://h:1", Room: 9, HasRoom: true, Reason: "r"}, false},
		// A peer of protocol 7 (no VERDICT_ACK; the other frames as now).
		{"transfer v7", as(7, (&TransferMsg{Attempt: 1, Room: 10, Endpoint: "tcp://h:4", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 2}).Encode()),
			ForeignFrame{Version: 7, Type: MsgTransfer, Endpoint: "tcp://h:4", Room: 10, HasRoom: true}, false},
		// A peer of protocol 6: TRANSFER, ABORT and ABORT_ACK without the
		// attempt frame still name their sender and room.
		{"transfer v6", as(6, (&TransferMsg{Attempt: 1, Room: 11, Endpoint: "tcp://h:5", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 2}).Encode()[:15]),
			ForeignFrame{Version: 6, Type: MsgTransfer, Endpoint: "tcp://h:5", Room: 11, HasRoom: true}, false},
		{"abort v6", as(6, (&AbortMsg{Room: 12, Endpoint: "tcp://h:5", Reason: "pool full", Epoch: 2}).Encode()[:7]),
			ForeignFrame{Version: 6, Type: MsgAbort, Endpoint: "tcp://h:5", Room: 12, HasRoom: true, Reason: "pool full"}, false},
		{"abort_ack v6", as(6, (&AbortAckMsg{Room: 13, Endpoint: "tcp://h:6", Clean: true}).Encode()[:9]),
			ForeignFrame{Version: 6, Type: MsgAbortAck, Endpoint: "tcp://h:6", Room: 13, HasRoom: true}, false},
		{"status v4", as(4, (&StatusMsg{Room: 3, State: StatusSuccess, Endpoint: "tcp://h:2", Epoch: 1}).Encode()),
			ForeignFrame{Version: 4, Type: MsgStatus, Endpoint: "tcp://h:2", Room: 3, HasRoom: true}, false},
		{"version v9", as(9, (&VersionMsg{Endpoint: "tcp://h:3", Reason: "why"}).Encode()),
			ForeignFrame{Version: 9, Type: MsgVersion, Endpoint: "tcp://h:3", Reason: "why"}, false},
		{"unknown type", [][]byte{[]byte(ControlMagic), []byte("9"), []byte("NEWTHING"), []byte("x")}, ForeignFrame{Version: 9, Type: "NEWTHING"}, false},
		{"short transfer", [][]byte{[]byte(ControlMagic), []byte("5"), []byte(MsgTransfer), []byte("1")}, ForeignFrame{}, true},
		{"not an endpoint", [][]byte{[]byte(ControlMagic), []byte("5"), []byte(MsgPing), []byte("h:1")}, ForeignFrame{}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			v, ok := ForeignVersion(c.parts, ControlVersion)
			if !ok {
				t.Fatal("not seen as another version")
			}
			got, err := DecodeForeign(c.parts, v)
			if c.bad {
				if err == nil || !errors.Is(err, ErrBadFrame) {
					t.Fatalf("err %v, want ErrBadFrame", err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
	if _, ok := ForeignVersion((&PingMsg{Endpoint: "tcp://h:1"}).Encode(), ControlVersion); ok {
		t.Fatal("this build's own frame taken as another version")
	}
	key := ControlKey("t")
	sealed := SealControl((&PingMsg{Endpoint: "tcp://h:1"}).Encode(), "i", 1, 1, time.Now(), key)
	sealed[1] = []byte("9")
	if ForeignTagValid(sealed, key) {
		t.Fatal("a frame altered after sealing verified")
	}
	f := (&PingMsg{Endpoint: "tcp://h:1"}).Encode()
	f[1] = []byte("9")
	if !ForeignTagValid(SealControl(f, "i", 1, 1, time.Now(), key), key) || ForeignTagValid(SealControl(f, "i", 1, 1, time.Now(), nil), key) {
		t.Fatal("ForeignTagValid: a tagged frame must verify, an untagged one must not")
	}
}

// FuzzDecodeForeign: frames of any version and content never panic, and an
// accepted frame names a tcp:// endpoint or none.
func FuzzDecodeForeign(f *testing.F) {
	for _, m := range [][][]byte{sampleRegister().Encode(), (&AbortMsg{Room: 1, Endpoint: "tcp://h:1", Reason: "r", Epoch: 4}).Encode()[:7],
		(&TransferMsg{Attempt: 2, Room: 3, Endpoint: "tcp://h:1", Pages: []int32{1}, RequiredDstInfoNum: 1, Epoch: 4}).Encode()[:15],
		(&AbortAckMsg{Room: 1, Endpoint: "tcp://h:2", Epoch: 4}).Encode()[:9], (&AbortMsg{Room: 1, Endpoint: "tcp://h:1", Reason: "r", Epoch: 4, Attempt: 5}).Encode(),
		(&VersionMsg{Endpoint: "tcp://h:3", Reason: "x"}).Encode(), (&StatusMsg{Room: 1, State: StatusSuccess, Endpoint: "tcp://h:1", Epoch: 2}).Encode()} {
		m[1] = []byte("5")
		f.Add(bytes.Join(m, []byte{0}))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		parts := bytes.Split(data, []byte{0})
		v, ok := ForeignVersion(parts, ControlVersion)
		if !ok {
			return
		}
		got, err := DecodeForeign(parts, v)
		if err != nil {
			if !errors.Is(err, ErrBadFrame) {
				t.Fatalf("error does not wrap ErrBadFrame: %v", err)
			}
			return
		}
		if got.Endpoint != "" && !strings.HasPrefix(got.Endpoint, "tcp://") {
			t.Fatalf("accepted endpoint %q", got.Endpoint)
		}
		_ = ForeignTagValid(parts, ControlKey("k"))
	})
}
