package server

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// fuzzServer returns a server with a complete 2-rank table, and its snapshot.
func fuzzServer(f *testing.F) *Server {
	s := New(Options{Logger: quiet})
	for tp := range 2 {
		if err := s.Register(reg(2, tp, 9000+tp)); err != nil {
			f.Fatal(err)
		}
	}
	return s
}

func serve(s *Server, method, target, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, "http://bootstrap.test/", strings.NewReader(body))
	req.URL.RawQuery = ""
	if i := strings.IndexByte(target, '?'); i >= 0 {
		req.URL.Path, req.URL.RawQuery = target[:i], target[i+1:]
	} else {
		req.URL.Path = target
	}
	req.RequestURI = req.URL.RequestURI()
	w := httptest.NewRecorder()
	s.Handler().ServeHTTP(w, req)
	return w
}

// checkTableIntact fails when the table is no longer a consistent
// SGLang-shaped directory: every rank within the topology's sizes and ports
// valid.
func checkTableIntact(t *testing.T, s *Server) {
	snap := s.Snapshot()
	if snap.Topology == nil {
		if snap.Registered != 0 {
			t.Fatalf("ranks without topology: %+v", snap)
		}
		return
	}
	ti := snap.Topology
	if snap.Registered > snap.Expected {
		t.Fatalf("%d ranks registered, topology expects %d", snap.Registered, snap.Expected)
	}
	for _, r := range snap.Ranks {
		if r.DP >= ti.DPSize || r.CP >= ti.AttnCPSize || r.TP >= ti.AttnTPSize || r.PP >= ti.PPSize ||
			r.RankPort < 1 || r.RankPort > 65535 || r.RankIP == "" {
			t.Fatalf("corrupt entry %+v for topology %+v", r, *ti)
		}
	}
}

// FuzzPutRoute feeds arbitrary PUT /route bodies: never a 5xx, a 200 only
// for bodies ParseRegisterRequest accepts (409/412 for valid ones the table
// refuses), and the table stays consistent; a rejected body leaves the table
// unchanged.
func FuzzPutRoute(f *testing.F) {
	f.Add(`{"attn_tp_size":2,"attn_tp_rank":1,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":0,"rank_ip":"198.51.100.77","rank_port":65001,"page_size":16,"kv_cache_dtype":"auto","load_balance_method":"round_robin","prefill_http_port":30000}`)
	f.Add(`{"attn_tp_size":1,"attn_tp_rank":0,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":0,"rank_ip":"::1","rank_port":1,"page_size":1,"kv_cache_dtype":null}`)
	f.Add(`{"attn_tp_size":"2"}`)
	f.Add(`{}`)
	f.Add(`[1,2]`)
	f.Add(`{"rank_port":1e400}`)
	// Unusable rank_ip values (400) next to usable ones (200).
	for _, ip := range []string{"999.1.1.1", "1.2.3", "01.02.03.04", "0.0.0.0", "::", "[::]", "224.0.0.1", "0x7f.1",
		"[::1]", "fe80::1%eth0", "prefill-0.svc.cluster.local"} {
		f.Add(strings.Replace(rankIPBody(`"`+ip+`"`), `"attn_tp_size":1,"attn_tp_rank":0`, `"attn_tp_size":2,"attn_tp_rank":1`, 1))
	}
	f.Add(strings.Replace(rankIPBody(`"10.0.0.9"`), `{`, `{"instance_id":"a-1","epoch":9,`, 1))
	f.Add(strings.Replace(rankIPBody(`"10.0.0.9"`), `{`, `{"instance_id":"b:2","epoch":3,`, 1))
	// The newest keys (decode_allocation_policy, dsv41_spec_layout) and
	// kvxfer's heartbeat_ms: valid ones the table refuses (400, another
	// policy than the table's "early"), malformed ones, and agreeing ones.
	for _, extra := range []string{
		`"decode_allocation_policy":"prefill_complete",`, `"decode_allocation_policy":"early",`, `"decode_allocation_policy":null,`,
		`"decode_allocation_policy":"",`, `"decode_allocation_policy":["early"],`,
		`"dsv41_spec_layout":{"block_size":128,"kv_layer_ids":[1,2]},`, `"dsv41_spec_layout":null,`, `"dsv41_spec_layout":[],`,
		`"dsv41_spec_layout":{"a":1e999},`, `"dsv41_spec_layout":{"a":{"b":[{"c":null}]}},`,
		`"instance_id":"p-1","heartbeat_ms":2000,`, `"heartbeat_ms":2000,`, `"instance_id":"p-1","heartbeat_ms":0,`, `"instance_id":"p-1","heartbeat_ms":1e3,`,
	} {
		f.Add(strings.Replace(strings.Replace(rankIPBody(`"10.0.0.9"`), `"attn_tp_size":1,"attn_tp_rank":0`, `"attn_tp_size":2,"attn_tp_rank":1`, 1), `{`, `{`+extra, 1))
	}
	s := fuzzServer(f)
	f.Fuzz(func(t *testing.T, body string) {
		before := s.Snapshot()
		w := serve(s, http.MethodPut, "/route", body)
		if w.Code >= 500 {
			t.Fatalf("PUT %q → %d %q", body, w.Code, w.Body.String())
		}
		r, perr := bootstrap.ParseRegisterRequest([]byte(body))
		// A valid body gets 400 only for a policy or layout other than the
		// table's (the fuzz table's ranks registered the defaults).
		inconsistent := perr == nil && (r.AllocationPolicy() != bootstrap.PolicyEarly || r.DSV41SpecLayout != nil)
		if (perr != nil && w.Code != 400) || (perr == nil && w.Code != 200 && w.Code != 409 && w.Code != 412 && !(inconsistent && w.Code == 400)) {
			t.Fatalf("PUT %q → %d %q, parser says %v", body, w.Code, w.Body.String(), perr)
		}
		if w.Code != 200 {
			after := s.Snapshot()
			before.DPRooms, after.DPRooms = 0, 0
			if !reflect.DeepEqual(before, after) {
				t.Fatalf("rejected PUT %q changed the table", body)
			}
		}
		checkTableIntact(t, s)
	})
}

// FuzzRouteQuery feeds arbitrary GET and DELETE /route and GET /v1/entry
// query strings: never a 5xx, and only SGLang's codes (200, 400, 404, 503)
// plus 412 for a conditional DELETE naming another instance.
func FuzzRouteQuery(f *testing.F) {
	f.Add("prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=9&target_pp_rank=0")
	f.Add("prefill_dp_rank=%zz")
	f.Add("prefill_dp_rank=99999999999999999999999&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
	f.Add("")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0&instance_id=p1")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0&instance_id=")
	f.Add("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0&instance_id=%20bad")
	f.Add("prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1&instance_id=p1")
	s := fuzzServer(f)
	f.Fuzz(func(t *testing.T, q string) {
		for _, m := range []string{http.MethodGet, http.MethodDelete} {
			w := serve(s, m, "/route?"+q, "")
			switch w.Code {
			case 200, 400, 404, 503:
			case 412:
				if m != http.MethodDelete {
					t.Fatalf("%s /route?%s → 412", m, q)
				}
			default:
				t.Fatalf("%s /route?%s → %d %q", m, q, w.Code, w.Body.String())
			}
			checkTableIntact(t, s)
		}
		if w := serve(s, http.MethodGet, "/v1/entry?"+q, ""); w.Code != 200 && w.Code != 400 && w.Code != 404 {
			t.Fatalf("GET /v1/entry?%s → %d %q", q, w.Code, w.Body.String())
		}
		// Re-fill the table so later inputs see a ready server again.
		for tp := range 2 {
			if err := s.Register(reg(2, tp, 9000+tp)); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// FuzzDPRankBodies feeds arbitrary /register_dp_rank and /query_dp_ranks
// bodies: never a 5xx; a 200 query answer is a JSON object of decimal rooms.
func FuzzDPRankBodies(f *testing.F) {
	f.Add(`{"bootstrap_room":5,"dp_rank":1}`, `{"bootstrap_rooms":[5,6]}`)
	f.Add(`{"bootstrap_room":9223372036854775807,"dp_rank":0}`, `{"bootstrap_rooms":[9223372036854775807]}`)
	f.Add(`{"bootstrap_room":-1,"dp_rank":0}`, `{"bootstrap_rooms":[-1]}`)
	f.Add(`{"bootstrap_room":1.5}`, `{"bootstrap_rooms":{}}`)
	f.Add(`null`, `{"bootstrap_rooms":null}`)
	s := fuzzServer(f)
	f.Fuzz(func(t *testing.T, regBody, queryBody string) {
		w := serve(s, http.MethodPost, "/register_dp_rank", regBody)
		if w.Code != 200 && w.Code != 400 {
			t.Fatalf("register_dp_rank %q → %d %q", regBody, w.Code, w.Body.String())
		}
		room, dp, err := bootstrap.ParseRegisterDPRank([]byte(regBody))
		if (err == nil && dp < 1) != (w.Code == 200) { // dp_size is 1 in this table
			t.Fatalf("register_dp_rank %q → %d, parser: room %d dp %d err %v", regBody, w.Code, room, dp, err)
		}
		w = serve(s, http.MethodPost, "/query_dp_ranks", queryBody)
		if w.Code != 200 && w.Code != 400 {
			t.Fatalf("query_dp_ranks %q → %d %q", queryBody, w.Code, w.Body.String())
		}
		if w.Code == 200 {
			var m map[string]int
			if err := json.Unmarshal(w.Body.Bytes(), &m); err != nil {
				t.Fatalf("query answer %q is not a room→dp object: %v", w.Body.String(), err)
			}
		}
	})
}
