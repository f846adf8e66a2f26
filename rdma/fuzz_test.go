package rdma

import "testing"

func FuzzDecodeHandshake(f *testing.F) {
	f.Add(encodeHandshake(handshake{QPs: []qpInfo{{Dev: "rxe0", QPN: 17, PSN: 5, GID: "::ffff:10.0.0.1", MTU: 3, Global: true}}}))
	f.Add([]byte(`{"v":1,"qps":[]}`))
	f.Add([]byte(`{"v":1,"qps":[{"dev":"x","qpn":16777216,"mtu":9,"gid":"zz"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHandshake(b)
		if err != nil {
			return
		}
		for _, q := range h.QPs {
			if q.QPN >= 1<<24 || q.PSN >= 1<<24 || q.MTU < 1 || q.MTU > 5 {
				t.Fatalf("accepted invalid QP %+v", q)
			}
		}
	})
}

func FuzzDecodeRegionKey(f *testing.F) {
	f.Add(encodeRegionKey(regionKey{Devs: []devKey{{Dev: "rxe0", Chunks: []mrChunkDesc{{Off: 0, Len: 4096, RKey: 1}, {Off: 4096, Len: 10, RKey: 2}}}}}))
	f.Add([]byte(`{"v":1,"devs":[{"dev":"a","chunks":[{"off":5,"len":1}]}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		k, err := decodeRegionKey(b)
		if err != nil {
			return
		}
		for _, d := range k.Devs {
			var off uint64
			for _, c := range d.Chunks {
				if c.Off != off || c.Len == 0 {
					t.Fatalf("accepted a non-tiling key %+v", d)
				}
				off += c.Len
			}
			if k.extent(d.Dev) == 0 {
				t.Fatal("zero extent")
			}
		}
	})
}
