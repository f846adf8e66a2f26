package server

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// sglangBody builds a PUT /route body with SGLang's keys in the order its
// CommonKVManager.register_to_bootstrap builds the dict (spec §3).
func sglangBody(tpSize, tpRank, cpSize, cpRank, attnDPSize, attnDPRank, ppSize, ppRank, sysDPSize, sysDPRank, port int) string {
	return fmt.Sprintf(`{"attn_tp_size":%d,"attn_tp_rank":%d,"attn_cp_size":%d,"attn_cp_rank":%d,"attn_dp_size":%d,"attn_dp_rank":%d,`+
		`"pp_size":%d,"pp_rank":%d,"system_dp_size":%d,"system_dp_rank":%d,"rank_ip":"127.0.0.1","rank_port":%d,"page_size":64,`+
		`"kv_cache_dtype":"auto","load_balance_method":"follow_bootstrap_room","enable_dsa_cache_layer_split":false,"prefill_http_port":30000}`,
		tpSize, tpRank, cpSize, cpRank, attnDPSize, attnDPRank, ppSize, ppRank, sysDPSize, sysDPRank, port)
}

// TestSGLangRegistrationShapes registers whole prefill instances as SGLang
// files them — DP attention (system_dp_size 1, system_dp_rank = the
// attention-DP rank), plain DP, CP 2 and PP 2 — and checks every PUT is
// 200 "OK", the topology is ready with SGLang's dp_size, and every rank is
// found at its table key.
func TestSGLangRegistrationShapes(t *testing.T) {
	type rank struct {
		body  string
		coord bootstrap.Coord
	}
	type shape struct {
		name           string
		tp, cp, dp, pp int
		ranks          []rank
	}
	var shapes []shape
	// DP attention 2 and 4: attn_tp = tp/dp per DP group; SGLang sends
	// system_dp_size 1 and system_dp_rank = attn_dp_rank.
	for _, dp := range []int{2, 4} {
		sh := shape{name: fmt.Sprintf("dp-attention-%d", dp), tp: 2, cp: 1, dp: dp, pp: 1}
		for d := range dp {
			for tp := range 2 {
				port := 41000 + d*10 + tp
				sh.ranks = append(sh.ranks, rank{sglangBody(2, tp, 1, 0, dp, d, 1, 0, 1, d, port), bootstrap.Coord{DP: d, TP: tp}})
			}
		}
		shapes = append(shapes, sh)
	}
	// Plain DP 2 (no DP attention): attn_dp_size 1, attn_dp_rank 0,
	// system_dp_size 2, system_dp_rank = the DP rank.
	sh := shape{name: "plain-dp-2", tp: 2, cp: 1, dp: 2, pp: 1}
	for d := range 2 {
		for tp := range 2 {
			sh.ranks = append(sh.ranks, rank{sglangBody(2, tp, 1, 0, 1, 0, 1, 0, 2, d, 42000+d*10+tp), bootstrap.Coord{DP: d, TP: tp}})
		}
	}
	shapes = append(shapes, sh)
	// CP 2 and PP 2.
	sh = shape{name: "cp-2", tp: 2, cp: 2, dp: 1, pp: 1}
	for cp := range 2 {
		for tp := range 2 {
			sh.ranks = append(sh.ranks, rank{sglangBody(2, tp, 2, cp, 1, 0, 1, 0, 1, 0, 43000+cp*10+tp), bootstrap.Coord{CP: cp, TP: tp}})
		}
	}
	shapes = append(shapes, sh)
	sh = shape{name: "pp-2", tp: 2, cp: 1, dp: 1, pp: 2}
	for pp := range 2 {
		for tp := range 2 {
			sh.ranks = append(sh.ranks, rank{sglangBody(2, tp, 1, 0, 1, 0, 2, pp, 1, 0, 44000+pp*10+tp), bootstrap.Coord{TP: tp, PP: pp}})
		}
	}
	shapes = append(shapes, sh)

	for _, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			s, c := startServer(t, Options{})
			ctx := ctxT(t)
			for i, r := range sh.ranks {
				if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", r.body); code != 200 || body != "OK" {
					t.Fatalf("PUT %s → %d %q, want 200 OK", r.body, code, body)
				}
				if i < len(sh.ranks)-1 {
					if _, err := c.ServerInfo(ctx); err == nil {
						t.Fatalf("ready after %d of %d ranks", i+1, len(sh.ranks))
					}
				}
			}
			info, err := c.ServerInfo(ctx)
			if err != nil {
				t.Fatalf("topology after every rank registered: %v", err)
			}
			if info.AttnTPSize != sh.tp || info.AttnCPSize != sh.cp || info.DPSize != sh.dp || info.PPSize != sh.pp {
				t.Fatalf("topology %+v, want tp %d cp %d dp %d pp %d", info, sh.tp, sh.cp, sh.dp, sh.pp)
			}
			for _, r := range sh.ranks {
				ri, err := c.RankInfo(ctx, r.coord.DP, r.coord.CP, r.coord.TP, r.coord.PP)
				if err != nil {
					t.Fatalf("rank %s: %v", r.coord, err)
				}
				if want := `"rank_port":` + fmt.Sprint(ri.RankPort); !strings.Contains(r.body, want) {
					t.Fatalf("rank %s answers port %d, registered by %s", r.coord, ri.RankPort, r.body)
				}
			}
		})
	}
}

// TestDPAttentionIssueInput is issue 13's smallest input: an SGLang
// DP-attention rank (system_dp_size 1, system_dp_rank 1) that kvxfer used
// to refuse with 400; SGLang answers 200 and so must we, and once the other
// DP rank registers the directory is ready.
func TestDPAttentionIssueInput(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	in := `{"attn_tp_size":1,"attn_tp_rank":0,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":2,"attn_dp_rank":1,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":1,"rank_ip":"127.0.0.1","rank_port":41001,"page_size":64,"kv_cache_dtype":"auto"}`
	if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", in); code != 200 || body != "OK" {
		t.Fatalf("PUT → %d %q, want 200 OK", code, body)
	}
	other := strings.Replace(strings.Replace(in, `"attn_dp_rank":1`, `"attn_dp_rank":0`, 1), `"system_dp_rank":1`, `"system_dp_rank":0`, 1)
	other = strings.Replace(other, "41001", "41000", 1)
	if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", other); code != 200 {
		t.Fatalf("PUT dp 0 → %d %q", code, body)
	}
	info, err := c.ServerInfo(ctx)
	if err != nil || info.DPSize != 2 {
		t.Fatalf("topology %+v %v, want ready with dp_size 2", info, err)
	}
	ri, err := c.RankInfo(ctx, 1, 0, 0, 0)
	if err != nil || ri.RankPort != 41001 {
		t.Fatalf("rank dp=1: %+v %v", ri, err)
	}
}

// TestDPRankKeyStillChecked: ranks that can never be served are still
// refused — the DP table key out of its size, under either form.
func TestDPRankKeyStillChecked(t *testing.T) {
	s, _ := startServer(t, Options{})
	for _, tc := range []struct{ body, field string }{
		// DP attention: attn_dp_rank is the key.
		{sglangBody(1, 0, 1, 0, 2, 2, 1, 0, 1, 0, 41000), "attn_dp_rank"},
		// Plain DP: system_dp_rank is the key.
		{sglangBody(1, 0, 1, 0, 1, 0, 1, 0, 2, 2, 41000), "system_dp_rank"},
		// Negative ranks are never rank numbers.
		{strings.Replace(sglangBody(1, 0, 1, 0, 2, 0, 1, 0, 1, 0, 41000), `"system_dp_rank":0`, `"system_dp_rank":-1`, 1), "system_dp_rank"},
	} {
		if code, _, body := raw(t, http.MethodPut, "http://"+s.Addr()+"/route", tc.body); code != 400 || !strings.Contains(body, tc.field) {
			t.Errorf("PUT %s → %d %q, want 400 naming %s", tc.body, code, body, tc.field)
		}
	}
}
