package bootstrap

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

func prefill(tp, cp, dp, pp int) PrefillServerInfo {
	return PrefillServerInfo{AttnTPSize: tp, AttnCPSize: cp, DPSize: dp, PPSize: pp, PageSize: ptr(16), KVCacheDtype: ptr("auto"), FollowBootstrapRoom: true}
}

func decode(tp, rank int) DecodeRank {
	return DecodeRank{AttnTPSize: tp, AttnTPRank: rank, AttnCPSize: 1, PPSize: 1, PageSize: 16, KVCacheDtype: "auto"}
}

// r builds an expected rank list entry.
func r(dp, cp, tp, pp int, dummy bool) TargetRank {
	return TargetRank{DP: dp, CP: cp, TP: tp, PP: pp, Dummy: dummy}
}

func TestTargetRanks(t *testing.T) {
	mla := func(d DecodeRank) DecodeRank { d.IsMLA = true; return d }
	hybrid := func(d DecodeRank) DecodeRank { d.IsMLA, d.IsHybridMLA = true, true; return d }
	allCP := func(d DecodeRank) DecodeRank { d.AllCPRanksTransfer = true; return d }
	pp := func(d DecodeRank, size, rank int) DecodeRank { d.PPSize, d.PPRank = size, rank; return d }
	dsa := func(i PrefillServerInfo) PrefillServerInfo { i.EnableDSACacheLayerSplit = true; return i }

	cases := []struct {
		name      string
		info      PrefillServerInfo
		d         DecodeRank
		dp        int
		ranks     []TargetRank
		tpRanks   []int
		cpRanks   []int
		ppRanks   []int
		dst, resp int
	}{
		{"equal TP=1", prefill(1, 1, 1, 1), decode(1, 0), 0,
			[]TargetRank{r(0, 0, 0, 0, false)}, []int{0}, []int{0}, []int{0}, 1, 1},
		{"equal TP=4 rank 2", prefill(4, 1, 1, 1), decode(4, 2), 0,
			[]TargetRank{r(0, 0, 2, 0, false)}, []int{2}, []int{0}, []int{0}, 1, 1},
		{"equal TP, engine rank wraps (tp_rank 6 of attn 4)", prefill(4, 1, 1, 1), decode(4, 6), 0,
			[]TargetRank{r(0, 0, 2, 0, false)}, []int{2}, []int{0}, []int{0}, 1, 1},
		{"equal TP, dp rank carried", prefill(2, 1, 4, 1), decode(2, 1), 3,
			[]TargetRank{r(3, 0, 1, 0, false)}, []int{1}, []int{0}, []int{0}, 1, 1},
		{"decode TP larger 4>2 rank 3", prefill(2, 1, 1, 1), decode(4, 3), 0,
			[]TargetRank{r(0, 0, 1, 0, false)}, []int{1}, []int{0}, []int{0}, 2, 1},
		{"decode TP larger 8>1 rank 5", prefill(1, 1, 1, 1), decode(8, 5), 0,
			[]TargetRank{r(0, 0, 0, 0, false)}, []int{0}, []int{0}, []int{0}, 8, 1},
		{"decode TP larger MLA (no dummies)", prefill(2, 1, 1, 1), mla(decode(8, 7)), 0,
			[]TargetRank{r(0, 0, 1, 0, false)}, []int{1}, []int{0}, []int{0}, 4, 1},
		{"prefill TP larger 8>2 non-MLA", prefill(8, 1, 1, 1), decode(2, 1), 0,
			[]TargetRank{r(0, 0, 4, 0, false), r(0, 0, 5, 0, false), r(0, 0, 6, 0, false), r(0, 0, 7, 0, false)},
			[]int{4, 5, 6, 7}, []int{0}, []int{0}, 1, 4},
		{"prefill TP larger 8>2 MLA: one real, three dummy", prefill(8, 1, 1, 1), mla(decode(2, 1)), 0,
			[]TargetRank{r(0, 0, 4, 0, false), r(0, 0, 5, 0, true), r(0, 0, 6, 0, true), r(0, 0, 7, 0, true)},
			[]int{4, 5, 6, 7}, []int{0}, []int{0}, 1, 1},
		{"prefill TP larger 4>1 MLA", prefill(4, 1, 1, 1), mla(decode(1, 0)), 0,
			[]TargetRank{r(0, 0, 0, 0, false), r(0, 0, 1, 0, true), r(0, 0, 2, 0, true), r(0, 0, 3, 0, true)},
			[]int{0, 1, 2, 3}, []int{0}, []int{0}, 1, 1},
		{"prefill TP larger hybrid MLA counts like non-MLA", prefill(4, 1, 1, 1), hybrid(decode(2, 0)), 0,
			[]TargetRank{r(0, 0, 0, 0, false), r(0, 0, 1, 0, false)},
			[]int{0, 1}, []int{0}, []int{0}, 1, 2},
		{"prefill CP 4, default: CP rank 0 only", prefill(1, 4, 1, 1), decode(1, 0), 0,
			[]TargetRank{r(0, 0, 0, 0, false)}, []int{0}, []int{0}, []int{0}, 1, 1},
		{"prefill CP 2, all-CP transfer", prefill(1, 2, 1, 1), allCP(decode(1, 0)), 0,
			[]TargetRank{r(0, 0, 0, 0, false), r(0, 1, 0, 0, false)}, []int{0}, []int{0, 1}, []int{0}, 1, 2},
		{"prefill CP 2, DSA layer split from prefill", dsa(prefill(1, 2, 1, 1)), decode(1, 0), 0,
			[]TargetRank{r(0, 0, 0, 0, false), r(0, 1, 0, 0, false)}, []int{0}, []int{0, 1}, []int{0}, 1, 2},
		{"prefill CP 2, hybrid MLA decode uses all CP", prefill(2, 2, 1, 1), hybrid(decode(1, 0)), 0,
			[]TargetRank{r(0, 0, 0, 0, false), r(0, 0, 1, 0, false), r(0, 1, 0, 0, false), r(0, 1, 1, 0, false)},
			[]int{0, 1}, []int{0, 1}, []int{0}, 1, 4},
		{"PP equal 2, decode pp rank 1", prefill(1, 1, 1, 2), pp(decode(1, 0), 2, 1), 0,
			[]TargetRank{r(0, 0, 0, 1, false)}, []int{0}, []int{0}, []int{1}, 1, 1},
		{"prefill PP 4, decode PP 1: every stage, high first", prefill(1, 1, 1, 4), decode(1, 0), 0,
			[]TargetRank{r(0, 0, 0, 3, false), r(0, 0, 0, 2, false), r(0, 0, 0, 1, false), r(0, 0, 0, 0, false)},
			[]int{0}, []int{0}, []int{0, 1, 2, 3}, 1, 4},
		{"prefill TP 4 PP 2, decode TP 2 MLA, all CP 2: full order", prefill(4, 2, 2, 2), allCP(mla(decode(2, 1))), 1,
			[]TargetRank{
				r(1, 0, 2, 1, false), r(1, 0, 2, 0, false), r(1, 0, 3, 1, true), r(1, 0, 3, 0, true),
				r(1, 1, 2, 1, false), r(1, 1, 2, 0, false), r(1, 1, 3, 1, true), r(1, 1, 3, 0, true),
			},
			[]int{2, 3}, []int{0, 1}, []int{0, 1}, 1, 4},
		{"prefill TP 4 non-MLA × PP 2 × all CP 2", prefill(4, 2, 1, 2), allCP(decode(2, 0)), 0,
			[]TargetRank{
				r(0, 0, 0, 1, false), r(0, 0, 0, 0, false), r(0, 0, 1, 1, false), r(0, 0, 1, 0, false),
				r(0, 1, 0, 1, false), r(0, 1, 0, 0, false), r(0, 1, 1, 1, false), r(0, 1, 1, 0, false),
			},
			[]int{0, 1}, []int{0, 1}, []int{0, 1}, 1, 8},
		{"unset page_size/dtype on prefill are not checked", PrefillServerInfo{AttnTPSize: 1, AttnCPSize: 1, DPSize: 1, PPSize: 1}, decode(1, 0), 0,
			[]TargetRank{r(0, 0, 0, 0, false)}, []int{0}, []int{0}, []int{0}, 1, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TargetRanks(tc.info, tc.d, tc.dp)
			if err != nil {
				t.Fatalf("TargetRanks: %v", err)
			}
			if !reflect.DeepEqual(got.Ranks, tc.ranks) {
				t.Errorf("Ranks = %+v, want %+v", got.Ranks, tc.ranks)
			}
			if !reflect.DeepEqual(got.TargetTPRanks, tc.tpRanks) || got.TargetTPRank != tc.tpRanks[0] {
				t.Errorf("TargetTPRanks = %v (real %d), want %v", got.TargetTPRanks, got.TargetTPRank, tc.tpRanks)
			}
			if !reflect.DeepEqual(got.TargetCPRanks, tc.cpRanks) {
				t.Errorf("TargetCPRanks = %v, want %v", got.TargetCPRanks, tc.cpRanks)
			}
			if !reflect.DeepEqual(got.TargetPPRanks, tc.ppRanks) {
				t.Errorf("TargetPPRanks = %v, want %v", got.TargetPPRanks, tc.ppRanks)
			}
			if got.RequiredDstInfoNum != tc.dst || got.RequiredPrefillResponseNum != tc.resp {
				t.Errorf("required_dst_info_num=%d required_prefill_response_num=%d, want %d, %d",
					got.RequiredDstInfoNum, got.RequiredPrefillResponseNum, tc.dst, tc.resp)
			}
			// Invariant: responses = number of non-dummy ranks.
			real := 0
			for _, x := range got.Ranks {
				if !x.Dummy {
					real++
				}
			}
			if real != got.RequiredPrefillResponseNum {
				t.Errorf("%d non-dummy ranks but required_prefill_response_num %d", real, got.RequiredPrefillResponseNum)
			}
		})
	}
}

// TestTargetRanksNonDividing: TP sizes where neither divides the other map
// as SGLang's _resolve_rank_mapping computes them (integer division).
func TestTargetRanksNonDividing(t *testing.T) {
	cases := []struct {
		name       string
		P, D, e    int
		mla        bool
		tps        []int
		dst, resps int
	}{
		// P=3, D=2: r = 1; decode e takes [e]; prefill rank 2 is never contacted.
		{"prefill 3 decode 2 rank 0", 3, 2, 0, false, []int{0}, 1, 1},
		{"prefill 3 decode 2 rank 1", 3, 2, 1, false, []int{1}, 1, 1},
		{"prefill 3 decode 2 mla", 3, 2, 1, true, []int{1}, 1, 1},
		// P=5, D=2: r = 2.
		{"prefill 5 decode 2 rank 1", 5, 2, 1, false, []int{2, 3}, 1, 2},
		// P=2, D=3: ratio 1; ranks 0, 1 map to 0, 1 (rank 2 is refused).
		{"prefill 2 decode 3 rank 1", 2, 3, 1, false, []int{1}, 1, 1},
		// P=4, D=6: ratio 1; rank 3 maps to 3.
		{"prefill 4 decode 6 rank 3", 4, 6, 3, true, []int{3}, 1, 1},
	}
	for _, tc := range cases {
		d := decode(tc.D, tc.e)
		d.IsMLA = tc.mla
		got, err := TargetRanks(prefill(tc.P, 1, 1, 1), d, 0)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !reflect.DeepEqual(got.TargetTPRanks, tc.tps) || got.RequiredDstInfoNum != tc.dst || got.RequiredPrefillResponseNum != tc.resps {
			t.Errorf("%s: tp ranks %v dst %d responses %d, want %v %d %d", tc.name, got.TargetTPRanks, got.RequiredDstInfoNum, got.RequiredPrefillResponseNum, tc.tps, tc.dst, tc.resps)
		}
	}
}

func TestTargetRanksRejects(t *testing.T) {
	cases := []struct {
		name string
		info PrefillServerInfo
		d    DecodeRank
		dp   int
		want []string // substrings naming both sides
	}{
		{"page size", prefill(1, 1, 1, 1), func() DecodeRank { d := decode(1, 0); d.PageSize = 32; return d }(), 0, []string{"page_size", "prefill 16", "decode 32"}},
		{"dtype auto vs bfloat16", prefill(1, 1, 1, 1), func() DecodeRank { d := decode(1, 0); d.KVCacheDtype = "bfloat16"; return d }(), 0, []string{"kv_cache_dtype", `"auto"`, `"bfloat16"`}},
		{"decode TP 3 vs prefill 2, rank 2 maps past prefill", prefill(2, 1, 1, 1), decode(3, 2), 0, []string{"decode attn_tp_size 3", "prefill attn_tp_size 2", "prefill tp rank 2"}},
		{"decode CP 2", prefill(1, 2, 1, 1), func() DecodeRank { d := decode(1, 0); d.AttnCPSize = 2; return d }(), 0, []string{"decode attn_cp_size is 2"}},
		{"PP 2 vs 4", prefill(1, 1, 1, 4), func() DecodeRank { d := decode(1, 0); d.PPSize = 2; return d }(), 0, []string{"decode pp_size 2", "prefill pp_size 4"}},
		{"dp out of range", prefill(1, 1, 2, 1), decode(1, 0), 2, []string{"dp rank 2", "[0, 2)"}},
		{"negative dp", prefill(1, 1, 2, 1), decode(1, 0), -1, []string{"dp rank -1"}},
		{"zero prefill sizes", PrefillServerInfo{}, decode(1, 0), 0, []string{"prefill sizes"}},
		{"zero decode tp", prefill(1, 1, 1, 1), DecodeRank{PPSize: 1, AttnCPSize: 1}, 0, []string{"decode sizes"}},
		{"negative tp rank", prefill(1, 1, 1, 1), decode(1, -1), 0, []string{"attn_tp_rank=-1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := TargetRanks(tc.info, tc.d, tc.dp)
			if !errors.Is(err, ErrMismatch) {
				t.Fatalf("err = %v, want ErrMismatch", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestSelectDPRank(t *testing.T) {
	cases := []struct {
		info PrefillServerInfo
		room uint64
		dp   int
		ok   bool
	}{
		{prefill(1, 1, 1, 1), 12345, 0, true},
		{prefill(1, 1, 4, 1), 10, 2, true},
		{prefill(1, 1, 3, 1), 1<<63 - 1, int((1<<63 - 1) % 3), true},
		{PrefillServerInfo{DPSize: 4}, 10, 0, false},
		{PrefillServerInfo{DPSize: 1}, 10, 0, true},
	}
	for _, tc := range cases {
		dp, ok := SelectDPRank(tc.info, tc.room)
		if dp != tc.dp || ok != tc.ok {
			t.Errorf("SelectDPRank(dp_size=%d follow=%v, room %d) = %d, %v; want %d, %v",
				tc.info.DPSize, tc.info.FollowBootstrapRoom, tc.room, dp, ok, tc.dp, tc.ok)
		}
	}
}

func TestLeaderBootstrapAddr(t *testing.T) {
	cases := []struct {
		in   string
		port int
		want string
		err  string
	}{
		{"10.0.0.1:5000", 8998, "10.0.0.1:8998", ""},
		{"[fd00::1]:5000", 9000, "[fd00::1]:9000", ""},
		{"node0.cluster:29500", 8998, "node0.cluster:8998", ""},
		{"10.0.0.1", 8998, "", "want host:port"},
		{":5000", 8998, "", "no host"},
		{"10.0.0.1:5000", 0, "", "out of range"},
		{"10.0.0.1:5000", 70000, "", "out of range"},
	}
	for _, tc := range cases {
		got, err := LeaderBootstrapAddr(tc.in, tc.port)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("LeaderBootstrapAddr(%q, %d) err = %v, want containing %q", tc.in, tc.port, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("LeaderBootstrapAddr(%q, %d) = %q, %v; want %q", tc.in, tc.port, got, err, tc.want)
		}
	}
}

func TestRegisterHostAndEndpoint(t *testing.T) {
	for in, want := range map[string]string{"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "10.1.2.3": "10.1.2.3"} {
		if got := RegisterHost(in); got != want {
			t.Errorf("RegisterHost(%q) = %q, want %q", in, got, want)
		}
	}
	if got := (PrefillRankInfo{RankIP: "fe80::1", RankPort: 5}).Endpoint(); got != "tcp://[fe80::1]:5" {
		t.Errorf("Endpoint = %q", got)
	}
}

func TestNormalizeAddr(t *testing.T) {
	cases := map[string]string{
		"127.0.0.1:8998":        "127.0.0.1:8998",
		"[::1]:8998":            "[::1]:8998",
		"::1:8998":              "",
		"http://host:1/":        "host:1",
		"fd00::2:3:4:8998":      "",
		"::1":                   "",
		"127.0.0.1":             "",
		"[::1]":                 "",
		"bad":                   "",
		"host:0":                "",
		"host:99999":            "",
		":8998":                 "",
		"[::1]:x":               "",
		"http://[fe80::1]:8998": "[fe80::1]:8998",
	}
	for in, want := range cases {
		got, err := normalizeAddr(in)
		if want == "" {
			if err == nil {
				t.Errorf("normalizeAddr(%q) = %q, want error", in, got)
			}
			continue
		}
		if err != nil || got != want {
			t.Errorf("normalizeAddr(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// TestAddressFormHints: the IPv6 forms issue 18 names are refused at once
// with the form to use (not after a register deadline).
func TestAddressFormHints(t *testing.T) {
	for in, hint := range map[string]string{
		"::1:8998":         "[::1]:8998",
		"fd00::2:3:4:8998": "[fd00::2:3:4]:8998",
		"::1":              "[::1]:8998",
		"[fd00::2]":        "[fd00::2]:8998",
		"10.0.0.1":         "10.0.0.1:8998",
		"::zz:1":           "[::1]:8998",
	} {
		_, err := NewClient(in)
		if err == nil || !strings.Contains(err.Error(), hint) {
			t.Errorf("NewClient(%q) = %v, want an error suggesting %s", in, err, hint)
		}
	}
}
