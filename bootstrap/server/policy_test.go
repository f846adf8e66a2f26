package server

import (
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// specLayout is a DeepSeek-V4.1 DSpark layout as SGLang's
// get_dsv41_spec_layout builds it (the keys its tests vary), written with
// its keys out of order and with spaces, as Python's json.dumps sends them.
const specLayout = `{"num_draft_tokens": 6, "block_size": 128, "kv_layer_ids": [1, 2], "kv_item_lens": [512, 1024],
	"state_types": ["swa", "dsv4_request_state", "swa"], "state_item_lens": [[512], [32768], [512]], "target_kv": "fp8"}`

// newestBody is a PUT /route body as SGLang's newest register_to_bootstrap
// builds it (b7e89b39): the 0094505 keys plus dsv41_spec_layout and
// decode_allocation_policy. layout and policy are raw JSON values.
func newestBody(tpSize, tpRank, port int, layout, policy string) string {
	b := sglangBody(tpSize, tpRank, 1, 0, 1, 0, 1, 0, 1, 0, port)
	return strings.TrimSuffix(b, "}") + `,"dsv41_spec_layout":` + layout + `,"decode_allocation_policy":` + policy + `}`
}

func topologyKeys(t *testing.T, s *Server) map[string]json.RawMessage {
	t.Helper()
	code, _, body := raw(t, http.MethodGet, "http://"+s.Addr()+topoQuery, "")
	if code != 200 {
		t.Fatalf("topology: %d %s", code, body)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestNewestProtocolCarriesPolicyAndLayout: ranks registering as SGLang's
// newest prefill does (prefill_complete, a DSpark layout) get 200, and the
// topology answer carries both, so that a decode running prefill_complete
// finds its own policy there (kvxfer used to answer "early" and every such
// room failed "policy mismatch"). The layout comes back equal as an object.
func TestNewestProtocolCarriesPolicyAndLayout(t *testing.T) {
	s, c := startServer(t, Options{})
	for tp := range 2 {
		if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", newestBody(2, tp, 41000+tp, specLayout, `"prefill_complete"`)); code != 200 || body != "OK" {
			t.Fatalf("PUT tp %d → %d %q", tp, code, body)
		}
	}
	m := topologyKeys(t, s)
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	want := []string{"attn_cp_size", "attn_tp_size", "decode_allocation_policy", "dp_size", "dsv41_spec_layout", "enable_dsa_cache_layer_split",
		"follow_bootstrap_room", "kv_cache_dtype", "page_size", "pp_size", "prefill_http_port", "required_dst_info_num",
		"required_prefill_response_num", "target_cp_ranks", "target_pp_ranks", "target_tp_rank", "target_tp_ranks"}
	if !slices.Equal(keys, want) {
		t.Fatalf("keys %v\nwant %v", keys, want)
	}
	if string(m["decode_allocation_policy"]) != `"prefill_complete"` {
		t.Fatalf("decode_allocation_policy = %s", m["decode_allocation_policy"])
	}
	var got, sent any
	if err := json.Unmarshal(m["dsv41_spec_layout"], &got); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(specLayout), &sent); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, sent) {
		t.Fatalf("layout answered %v, registered %v", got, sent)
	}
	info, err := c.ServerInfo(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.AllocationPolicy() != bootstrap.PolicyPrefillComplete || string(info.DSV41SpecLayout) != string(m["dsv41_spec_layout"]) {
		t.Fatalf("client: policy %q layout %s", info.AllocationPolicy(), info.DSV41SpecLayout)
	}
	if snap := s.Snapshot(); snap.Topology == nil || snap.Topology.AllocationPolicy() != bootstrap.PolicyPrefillComplete {
		t.Fatalf("/v1/table topology %+v", snap.Topology)
	}
}

// TestDisagreeingRanksRefused: as SGLang's newest server, a rank whose
// policy or layout differs from the ranks before it gets 400 (kvxfer's text
// names both values) and the table keeps what it had; an absent policy is
// "early" and a null layout none, as in SGLang; a rank alone in the table
// may change them (the whole instance restarted with a new config).
func TestDisagreeingRanksRefused(t *testing.T) {
	s, c := startServer(t, Options{})
	put := func(body string) (int, string) {
		code, _, text := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", body)
		return code, text
	}
	if code, body := put(newestBody(3, 0, 41000, specLayout, `"prefill_complete"`)); code != 200 {
		t.Fatalf("rank 0: %d %q", code, body)
	}
	for _, tc := range []struct {
		name, body string
		want       []string
	}{
		{"policy early", newestBody(3, 1, 41001, specLayout, `"early"`), []string{`"early"`, `"prefill_complete"`, "decode_allocation_policy"}},
		{"policy absent", strings.Replace(newestBody(3, 1, 41001, specLayout, `null`), `,"decode_allocation_policy":null`, "", 1), []string{`"early"`, `"prefill_complete"`}},
		{"layout null", newestBody(3, 1, 41001, `null`, `"prefill_complete"`), []string{"dsv41_spec_layout", "null", `"block_size":128`}},
		{"layout differs", newestBody(3, 1, 41001, strings.Replace(specLayout, `"num_draft_tokens": 6`, `"num_draft_tokens": 5`, 1), `"prefill_complete"`),
			[]string{"num_draft_tokens", `"num_draft_tokens":5`, `"num_draft_tokens":6`}},
	} {
		code, body := put(tc.body)
		if code != 400 {
			t.Errorf("%s: %d %q, want 400", tc.name, code, body)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(body, w) {
				t.Errorf("%s: %q does not name %s", tc.name, body, w)
			}
		}
	}
	if snap := s.Snapshot(); snap.Registered != 1 {
		t.Fatalf("refused registrations changed the table: %d ranks", snap.Registered)
	}
	// The client sees the 400 as ErrBadRequest, not retried.
	r := reg(3, 2, 41002)
	var err error
	r.DecodeAllocationPolicy = bootstrap.PolicyEarly
	if r.DSV41SpecLayout, err = bootstrap.CanonicalSpecLayout([]byte(specLayout)); err != nil {
		t.Fatal(err)
	}
	if err := c.Register(ctxT(t), r); !errors.Is(err, bootstrap.ErrBadRequest) || !strings.Contains(err.Error(), "prefill_complete") {
		t.Fatalf("Register with another policy: %v", err)
	}
	// Key order and spacing do not make a layout differ.
	if code, body := put(newestBody(3, 1, 41001, `{"target_kv":"fp8","state_item_lens":[[512],[32768],[512]],"state_types":["swa","dsv4_request_state","swa"],"kv_item_lens":[512,1024],"kv_layer_ids":[1,2],"block_size":128,"num_draft_tokens":6}`, `"prefill_complete"`)); code != 200 {
		t.Fatalf("same layout, other key order: %d %q", code, body)
	}

	// Alone in the table, a rank may re-register with another policy.
	s2, _ := startServer(t, Options{})
	for _, pol := range []string{`"prefill_complete"`, `"early"`} {
		if code, _, body := raw(t, http.MethodPut, "http://"+s2.Addr()+"/route", newestBody(1, 0, 41000, `null`, pol)); code != 200 {
			t.Fatalf("lone rank with %s: %d %q", pol, code, body)
		}
	}
	if got := topologyKeys(t, s2)["decode_allocation_policy"]; string(got) != `"early"` {
		t.Fatalf("lone rank's new policy not taken: %s", got)
	}
	// Malformed values name the field.
	for _, tc := range []struct{ layout, policy, field string }{
		{`[1,2]`, `"early"`, "dsv41_spec_layout"},
		{`"x"`, `"early"`, "dsv41_spec_layout"},
		{`null`, `7`, "decode_allocation_policy"},
		{`null`, `"pre fill"`, "decode_allocation_policy"},
	} {
		if code, _, body := raw(t, http.MethodPut, "http://"+s2.Addr()+"/route", newestBody(1, 0, 41000, tc.layout, tc.policy)); code != 400 || !strings.Contains(body, tc.field) {
			t.Errorf("layout %s policy %s: %d %q, want 400 naming %s", tc.layout, tc.policy, code, body, tc.field)
		}
	}
}

// TestCompat0094505: with --compat sglang-0094505 the topology answer is
// that commit's key set exactly (older decodes refuse unknown keys), a
// newest SGLang prefill's registration with the defaults ("early", null
// layout) is accepted, and one declaring prefill_complete or a layout is
// refused with 400 naming the flag to use, rather than silently dropped.
func TestCompat0094505(t *testing.T) {
	s, _ := startServer(t, Options{Compat: bootstrap.CompatSGLang0094505})
	for _, tc := range []struct{ layout, policy string }{{`null`, `"prefill_complete"`}, {specLayout, `"early"`}} {
		code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", newestBody(1, 0, 41000, tc.layout, tc.policy))
		if code != 400 || !strings.Contains(body, "--compat "+bootstrap.CompatSGLangNewest) {
			t.Errorf("layout %.20s policy %s: %d %q, want 400 naming --compat %s", tc.layout, tc.policy, code, body, bootstrap.CompatSGLangNewest)
		}
	}
	if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", newestBody(1, 0, 41000, `null`, `"early"`)); code != 200 {
		t.Fatalf("defaults: %d %q", code, body)
	}
	m := topologyKeys(t, s)
	if _, ok := m["decode_allocation_policy"]; ok || len(m) != 15 {
		t.Fatalf("0094505 key set has %d keys: %v", len(m), m)
	}
}
