package server

import (
	"strings"
	"testing"
)

// rankIPBody is a complete one-rank PUT /route body with the given rank_ip
// (a JSON string literal).
func rankIPBody(ipJSON string) string {
	return `{"attn_tp_size":1,"attn_tp_rank":0,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":0,"rank_ip":` +
		ipJSON + `,"rank_port":6001,"page_size":16,"kv_cache_dtype":"auto"}`
}

// TestRouteRankIP checks through the listener which rank_ip values PUT
// /route accepts: a 400 naming rank_ip and what is accepted for hosts no
// decode can reach, 200 "OK" and the unbracketed host in GET /route for the
// rest.
func TestRouteRankIP(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	cases := []struct {
		ip   string
		want string // stored host; "" = rejected
	}{
		{"127.0.0.1", "127.0.0.1"},
		{"198.51.100.77", "198.51.100.77"},
		{"::1", "::1"},
		{"[::1]", "::1"},
		{"[fd00::7]", "fd00::7"},
		{"fe80::1%eth0", "fe80::1%eth0"},
		{"::ffff:10.0.0.1", "::ffff:10.0.0.1"},
		{"localhost", "localhost"},
		{"prefill-0.prefill.svc.cluster.local", "prefill-0.prefill.svc.cluster.local"},
		{"example.com.", "example.com."},
		{"node_1", "node_1"},
		{"10.0.0.1a", "10.0.0.1a"}, // last label not all-numeric: a hostname
		{"a1.b2", "a1.b2"},

		{"999.1.1.1", ""},
		{"1.2.3", ""},
		{"1.2.3.4.5", ""},
		{"01.02.03.04", ""},
		{"1.2.3.04", ""},
		{"123", ""},
		{"0x7f.1", ""},
		{"0x7f000001", ""},
		{"0.0.0.0", ""},
		{"::", ""},
		{"[::]", ""},
		{"::ffff:0.0.0.0", ""},
		{"224.0.0.1", ""},
		{"ff02::1", ""},
		{"255.255.255.255", ""},
		{"[127.0.0.1]", ""},
		{"[]", ""},
		{"", ""},
		{"a..b", ""},
		{"-a.example", ""},
		{"a-.example", ""},
		{"not a host!", ""},
		{strings.Repeat("a", 64) + ".example", ""},
	}
	for _, tc := range cases {
		code, _, body := raw(t, "PUT", "http://"+s.Addr()+"/route", rankIPBody(`"`+tc.ip+`"`))
		if tc.want == "" {
			if code != 400 || !strings.HasPrefix(body, "rank_ip: ") || !strings.Contains(body, "dotted quad") || !strings.Contains(body, "RFC 1123 hostname") {
				t.Errorf("rank_ip %q: got %d %q, want 400 naming rank_ip and what is accepted", tc.ip, code, body)
			}
			continue
		}
		if code != 200 || body != "OK" {
			t.Errorf("rank_ip %q: got %d %q, want 200 OK", tc.ip, code, body)
			continue
		}
		ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
		if err != nil || ri.RankIP != tc.want {
			t.Errorf("rank_ip %q: stored %+v %v, want %q", tc.ip, ri, err, tc.want)
		}
	}
}
