package bootstrap

import (
	"bytes"
	"net/url"
	"slices"
	"testing"
)

// FuzzParseRankQuery: the allocation-free query scanner the server uses on
// every GET /route agrees with url.ParseQuery on arbitrary query strings.
func FuzzParseRankQuery(f *testing.F) {
	f.Add("prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0")
	f.Add("prefill_dp_rank=%zz")
	f.Add("prefill_dp_rank=1&prefill_dp_rank=2&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
	f.Add("prefill_dp_rank=99999999999999999999999&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
	f.Add("")
	f.Fuzz(func(t *testing.T, q string) {
		v, _ := url.ParseQuery(q)
		c1, all1, err1 := ParseRankQuery(v.Get)
		c2, all2, err2 := ParseRankQueryString(q)
		if c1 != c2 || all1 != all2 || (err1 == nil) != (err2 == nil) {
			t.Fatalf("query %q: ParseQuery path %v %v %v, raw path %v %v %v", q, c1, all1, err1, c2, all2, err2)
		}
	})
}

// FuzzParseQueryDPRanks: the fast integer path of ParseQueryDPRanks agrees
// with the element-by-element decoder on arbitrary bodies.
func FuzzParseQueryDPRanks(f *testing.F) {
	f.Add(`{"bootstrap_rooms":[5,6]}`)
	f.Add(`{"bootstrap_rooms":[9223372036854775807]}`)
	f.Add(`{"bootstrap_rooms":[-1]}`)
	f.Add(`{"bootstrap_rooms":[1, null]}`)
	f.Add(`{"bootstrap_rooms":{}}`)
	f.Add(`{"bootstrap_rooms":null}`)
	f.Fuzz(func(t *testing.T, body string) {
		m, err := jsonObject([]byte(body), "q")
		if err != nil {
			return
		}
		raw, ok := m["bootstrap_rooms"]
		if !ok {
			return
		}
		fast, ferr := ParseQueryDPRanks([]byte(body))
		if tr := bytes.TrimSpace(raw); len(tr) > 0 && tr[0] == '[' {
			slow, serr := parseRoomsSlow(raw)
			if (ferr == nil) != (serr == nil) || !slices.Equal(fast, slow) {
				t.Fatalf("rooms %s: fast %v %v, slow %v %v", raw, fast, ferr, slow, serr)
			}
		}
	})
}
