package transport

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func sampleDescriptor() SegmentDescriptor {
	return SegmentDescriptor{
		Name: "10.0.0.1:17000", Epoch: 0xfeed, RPC: "10.0.0.1:17000", Kind: "engine", Hostname: "h", PID: 7, Devices: []string{"mlx5_0"},
		PreparedFor: "p#1",
		Transports:  []SegmentTransport{{Name: "rdma", Endpoint: []byte{1, 2}, PerPeer: true}},
		Regions: []RegionDesc{
			{ID: 1, Addr: 0x1000, Length: 0x1000, Kind: MemoryHost, Key: []byte("k")},
			{ID: 2, Addr: 0x7f0000000000, Length: 1 << 30, Kind: MemoryCUDA},
		},
	}
}

func TestSegmentDescriptorRoundTrip(t *testing.T) {
	d := sampleDescriptor()
	got, err := DecodeSegmentDescriptor(d.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, d) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, d)
	}
}

func TestSegmentDescriptorRejects(t *testing.T) {
	mut := func(f func(*SegmentDescriptor)) []byte {
		d := sampleDescriptor()
		f(&d)
		return d.Encode()
	}
	for _, c := range []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, "empty"},
		{"not json", []byte("{"), "not JSON"},
		{"version", []byte(`{"v":2}`), "version 2"},
		{"no name", mut(func(d *SegmentDescriptor) { d.Name = "" }), "name is empty"},
		{"zero epoch", mut(func(d *SegmentDescriptor) { d.Epoch = 0 }), "epoch is 0"},
		{"long rpc", mut(func(d *SegmentDescriptor) { d.RPC = strings.Repeat("x", 2000) }), "rpc address"},
		{"no transports", mut(func(d *SegmentDescriptor) { d.Transports = nil }), "0 transports"},
		{"dup transport", mut(func(d *SegmentDescriptor) { d.Transports = append(d.Transports, d.Transports[0]) }), "listed twice"},
		{"shared without endpoint", mut(func(d *SegmentDescriptor) { d.Transports[0] = SegmentTransport{Name: "tcp"} }), "no endpoint"},
		{"zero length", mut(func(d *SegmentDescriptor) { d.Regions[0].Length = 0 }), "empty or wraps"},
		{"wraps", mut(func(d *SegmentDescriptor) { d.Regions[1].Addr = ^uint64(0) - 10 }), "empty or wraps"},
		{"dup region", mut(func(d *SegmentDescriptor) { d.Regions[1].ID = 1 }), "region 1 listed twice"},
		{"overlap", mut(func(d *SegmentDescriptor) { d.Regions[1].Addr = 0x1800 }), "overlap"},
		{"kind", bytes.Replace(sampleDescriptor().Encode(), []byte(`"kind":"cuda"`), []byte(`"kind":"tpu"`), 1), `kind "tpu"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeSegmentDescriptor(c.in)
			if !errors.Is(err, ErrBadDescriptor) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want ErrBadDescriptor mentioning %q", err, c.want)
			}
		})
	}
}

func TestFindRegion(t *testing.T) {
	rs := []RegionDesc{{ID: 1, Addr: 100, Length: 50}, {ID: 2, Addr: 200, Length: 100}, {ID: 3, Addr: 300, Length: 10}}
	for _, c := range []struct {
		addr, n uint64
		id      RegionID
		ok      bool
	}{
		{100, 50, 1, true}, {149, 1, 1, true}, {120, 31, 0, false}, {99, 2, 0, false},
		{150, 10, 0, false}, {200, 1, 2, true}, {299, 1, 2, true}, {299, 2, 0, false}, // spans two regions
		{300, 10, 3, true}, {305, 6, 0, false}, {0, 1, 0, false}, {200, 0, 0, false},
		{^uint64(0) - 1, 5, 0, false},
	} {
		r, ok := FindRegion(rs, c.addr, c.n)
		if ok != c.ok || (ok && r.ID != c.id) {
			t.Errorf("FindRegion(%d, %d) = %d,%v; want %d,%v", c.addr, c.n, r.ID, ok, c.id, c.ok)
		}
	}
}

// FuzzDecodeSegmentDescriptor: a descriptor from a peer or the metadata
// store is outside input.
func FuzzDecodeSegmentDescriptor(f *testing.F) {
	d := sampleDescriptor()
	f.Add(d.Encode())
	d.Regions = nil
	f.Add(d.Encode())
	f.Add([]byte(`{"v":1,"name":"a","epoch":1,"rpc":"h:1","transports":[{"name":"tcp","endpoint":"YQ=="}],"regions":[{"id":1,"addr":0,"length":1,"kind":"host"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := DecodeSegmentDescriptor(data)
		if err != nil {
			if !errors.Is(err, ErrBadDescriptor) {
				t.Fatalf("error does not wrap ErrBadDescriptor: %v", err)
			}
			return
		}
		for i := 1; i < len(d.Regions); i++ {
			if d.Regions[i].Addr < d.Regions[i-1].Addr+d.Regions[i-1].Length {
				t.Fatalf("accepted overlapping or unsorted regions %+v", d.Regions)
			}
		}
		again, err := DecodeSegmentDescriptor(d.Encode())
		if err != nil || !reflect.DeepEqual(again, d) {
			t.Fatalf("re-decode: %+v %v, first %+v", again, err, d)
		}
	})
}
