package bootstrap

import (
	"bytes"
	"encoding/json"
	"net/url"
	"reflect"
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

// FuzzParsePrefillServerInfo: any topology answer a directory (SGLang's of
// either age, or anything at that address) sends decodes without panicking;
// an accepted one encodes and decodes back to itself (its layout is already
// canonical), and its layout and policy are valid.
func FuzzParsePrefillServerInfo(f *testing.F) {
	f.Add(`{"attn_tp_size":2,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":16,"kv_cache_dtype":"auto","follow_bootstrap_room":true,"enable_dsa_cache_layer_split":false,"prefill_http_port":null,"target_tp_rank":null,"target_tp_ranks":null,"target_cp_ranks":null,"target_pp_ranks":null,"required_dst_info_num":null,"required_prefill_response_num":null}`)
	f.Add(`{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":256,"kv_cache_dtype":"fp8_e4m3","follow_bootstrap_room":true,"enable_dsa_cache_layer_split":false,"dsv41_spec_layout":{"block_size":128,"num_draft_tokens":6,"kv_layer_ids":[1,2]},"decode_allocation_policy":"prefill_complete","prefill_http_port":30000}`)
	f.Add(`{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":null,"kv_cache_dtype":null,"follow_bootstrap_room":false,"dsv41_spec_layout":null,"decode_allocation_policy":"early"}`)
	f.Add(`{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"dsv41_spec_layout":[1],"decode_allocation_policy":""}`)
	f.Add(`{"attn_tp_size":0}`)
	f.Add(`{"prefill_tp_size":1,"prefill_dp_size":1}`)
	f.Add(`[]`)
	f.Fuzz(func(t *testing.T, body string) {
		info, err := ParsePrefillServerInfo([]byte(body))
		if err != nil {
			return
		}
		if info.AttnTPSize < 1 || info.AttnCPSize < 1 || info.DPSize < 1 || info.PPSize < 1 || !ValidPolicyName(info.AllocationPolicy()) {
			t.Fatalf("accepted %q as %+v", body, info)
		}
		b, err := json.Marshal(info)
		if err != nil {
			t.Fatalf("re-encode %+v: %v", info, err)
		}
		again, err := ParsePrefillServerInfo(b)
		if err != nil || !reflect.DeepEqual(info, again) {
			t.Fatalf("%q: round trip %s gave %+v, %v; want %+v", body, b, again, err, info)
		}
	})
}

// FuzzCanonicalSpecLayout: canonical form is idempotent and an object; two
// spellings of one layout (the canonical one and the input) compare equal.
func FuzzCanonicalSpecLayout(f *testing.F) {
	f.Add(`{"num_draft_tokens": 6, "block_size": 128, "kv_layer_ids": [1, 2], "state_types": ["swa"], "state_item_lens": [[512]]}`)
	f.Add(`null`)
	f.Add(`{}`)
	f.Add(`{"a":1}{"b":2}`)
	f.Add(`{"a":1e400,"b":-0.0,"c":"\u003c"}`)
	f.Add(`{"a":{"a":{"a":[[[[{}]]]]}}}`)
	f.Add(`[1]`)
	f.Fuzz(func(t *testing.T, in string) {
		c, err := CanonicalSpecLayout([]byte(in))
		if err != nil || c == nil {
			return
		}
		if c[0] != '{' || !json.Valid(c) {
			t.Fatalf("%q: canonical %s is not a JSON object", in, c)
		}
		c2, err := CanonicalSpecLayout(c)
		if err != nil || !bytes.Equal(c, c2) {
			t.Fatalf("%q: canonical %s re-canonicalised to %s, %v", in, c, c2, err)
		}
		if d := DiffSpecLayouts(c, c2); d != nil {
			t.Fatalf("equal layouts differ in %v", d)
		}
	})
}
