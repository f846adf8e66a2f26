package bootstrap

import (
	"fmt"
	"net"
	"strconv"
)

// TargetRanks computes which prefill ranks a decode rank needs, following
// SGLang's CommonKVManager._resolve_rank_mapping and
// CommonKVReceiver._setup_bootstrap_infos (spec §4.2–§4.4). It is pure.
//
// With D the decode attention-TP size, P the prefill's, and e = AttnTPRank % D:
//   - D == P: TP ranks [e]; required_dst_info_num 1; responses 1.
//   - D > P:  TP ranks [e / (D/P)]; required_dst_info_num D/P; responses 1.
//   - D < P:  TP ranks [e·(P/D) … (e+1)·(P/D)−1], the first one real;
//     required_dst_info_num 1; responses 1 for MLA (the others are dummy),
//     P/D otherwise (hybrid MLA counts as non-MLA).
//
// (All divisions are integer divisions.)
//
// CP: prefill CP 1 → [decode cp rank]; else [0] unless all CP ranks transfer
// (AllCPRanksTransfer, IsHybridMLA or info.EnableDSACacheLayerSplit), then
// [0 … Pcp−1] and responses ×= Pcp. PP: equal sizes → [decode pp rank];
// decode PP 1 → [0 … Ppp−1] and responses ×= Ppp. Ranks lists, for each CP
// rank, for each TP rank, the PP ranks from high to low, all at dp = dpRank.
//
// TP sizes where neither divides the other are mapped as SGLang maps them,
// with integer division (D > P: ratio D // P; D < P: r = P // D).
//
// Errors wrap ErrMismatch and name both sides: page_size or kv_cache_dtype
// differ (when both sides state them), a decode rank that SGLang's integer
// division maps past the prefill's TP ranks, decode CP size ≠ 1, PP sizes
// neither equal nor decode 1, or a rank/size out of range.
func TargetRanks(info PrefillServerInfo, d DecodeRank, dpRank int) (*Targets, error) {
	if info.AttnTPSize < 1 || info.AttnCPSize < 1 || info.DPSize < 1 || info.PPSize < 1 {
		return nil, fmt.Errorf("%w: prefill sizes must be ≥ 1 (attn_tp_size=%d attn_cp_size=%d dp_size=%d pp_size=%d)",
			ErrMismatch, info.AttnTPSize, info.AttnCPSize, info.DPSize, info.PPSize)
	}
	if d.AttnTPSize < 1 || d.PPSize < 1 || d.AttnCPSize < 1 {
		return nil, fmt.Errorf("%w: decode sizes must be ≥ 1 (attn_tp_size=%d attn_cp_size=%d pp_size=%d)",
			ErrMismatch, d.AttnTPSize, d.AttnCPSize, d.PPSize)
	}
	if d.AttnTPRank < 0 || d.PPRank < 0 || d.PPRank >= d.PPSize || d.AttnCPRank < 0 || d.AttnCPRank >= d.AttnCPSize {
		return nil, fmt.Errorf("%w: decode rank out of range (attn_tp_rank=%d, cp_rank=%d of %d, pp_rank=%d of %d)",
			ErrMismatch, d.AttnTPRank, d.AttnCPRank, d.AttnCPSize, d.PPRank, d.PPSize)
	}
	if dpRank < 0 || dpRank >= info.DPSize {
		return nil, fmt.Errorf("%w: prefill dp rank %d out of range [0, %d)", ErrMismatch, dpRank, info.DPSize)
	}
	if info.PageSize != nil && d.PageSize != 0 && *info.PageSize != d.PageSize {
		return nil, fmt.Errorf("%w: page_size differs: prefill %d tokens, decode %d tokens (set --page-size equal on both)",
			ErrMismatch, *info.PageSize, d.PageSize)
	}
	if info.KVCacheDtype != nil && d.KVCacheDtype != "" && *info.KVCacheDtype != d.KVCacheDtype {
		return nil, fmt.Errorf("%w: kv_cache_dtype differs: prefill %q, decode %q (the strings must match exactly)",
			ErrMismatch, *info.KVCacheDtype, d.KVCacheDtype)
	}
	if d.AttnCPSize != 1 {
		return nil, fmt.Errorf("%w: decode attn_cp_size is %d; SGLang decodes require 1 (prefill attn_cp_size %d)",
			ErrMismatch, d.AttnCPSize, info.AttnCPSize)
	}
	if d.PPSize != info.PPSize && d.PPSize != 1 {
		return nil, fmt.Errorf("%w: decode pp_size %d must equal prefill pp_size %d or be 1",
			ErrMismatch, d.PPSize, info.PPSize)
	}
	if d.PPSize == info.PPSize && d.PPRank >= info.PPSize {
		return nil, fmt.Errorf("%w: decode pp_rank %d out of range for prefill pp_size %d", ErrMismatch, d.PPRank, info.PPSize)
	}

	D, P := d.AttnTPSize, info.AttnTPSize
	e := d.AttnTPRank % D
	t := &Targets{RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 1}
	switch {
	case D == P:
		t.TargetTPRanks = []int{e}
	case D > P:
		// SGLang's integer division: with D not a multiple of P the ratio
		// rounds down, and the last decode ranks map past the prefill's
		// ranks (SGLang then fails their lookups with 404): refuse those
		// ranks here, naming both sizes.
		tp := e / (D / P)
		if tp >= P {
			return nil, fmt.Errorf("%w: decode attn_tp_size %d and prefill attn_tp_size %d: SGLang's mapping sends decode tp rank %d to prefill tp rank %d, which does not exist (decode rank // (%d // %d)); use TP sizes where one divides the other",
				ErrMismatch, D, P, e, tp, D, P)
		}
		t.TargetTPRanks = []int{tp}
		t.RequiredDstInfoNum = D / P
	default: // D < P
		// SGLang's integer division: with P not a multiple of D, prefill
		// ranks past D·(P // D) are never contacted. Whether the ranks
		// contacted hold every KV head this decode rank needs is the head
		// layout's question, checked when the producers are resolved (MLA
		// replicates the KV, so any one rank serves).
		r := P / D
		t.TargetTPRanks = make([]int, r)
		for i := range r {
			t.TargetTPRanks[i] = e*r + i
		}
		if !d.IsMLA || d.IsHybridMLA {
			t.RequiredPrefillResponseNum = r
		}
	}
	t.TargetTPRank = t.TargetTPRanks[0]

	if info.AttnCPSize == 1 {
		t.TargetCPRanks = []int{d.AttnCPRank}
	} else if d.AllCPRanksTransfer || d.IsHybridMLA || info.EnableDSACacheLayerSplit {
		t.TargetCPRanks = seq(info.AttnCPSize)
		t.RequiredPrefillResponseNum *= info.AttnCPSize
	} else {
		t.TargetCPRanks = []int{0}
	}

	if d.PPSize == info.PPSize {
		t.TargetPPRanks = []int{d.PPRank}
	} else {
		t.TargetPPRanks = seq(info.PPSize)
		t.RequiredPrefillResponseNum *= info.PPSize
	}

	dummyOK := d.IsMLA && !d.IsHybridMLA
	for _, cp := range t.TargetCPRanks {
		for _, tp := range t.TargetTPRanks {
			for i := len(t.TargetPPRanks) - 1; i >= 0; i-- {
				t.Ranks = append(t.Ranks, TargetRank{
					DP: dpRank, CP: cp, TP: tp, PP: t.TargetPPRanks[i],
					Dummy: dummyOK && tp != t.TargetTPRank,
				})
			}
		}
	}
	return t, nil
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// SelectDPRank picks the prefill DP rank for a room without asking the
// server, as the decode's fast path does (spec §4.1 step 3): 0 when dp_size
// is 1, room % dp_size when the prefill follows the bootstrap room. It
// returns false when neither applies; then the prefill registered the room
// with POST /register_dp_rank and the decode must use Client.QueryDPRanks.
// (A request's disagg_prefill_dp_rank, when present, takes precedence over
// both; that is the caller's choice.)
func SelectDPRank(info PrefillServerInfo, room uint64) (int, bool) {
	if info.DPSize <= 1 {
		return 0, true
	}
	if info.FollowBootstrapRoom {
		return int(room % uint64(info.DPSize)), true
	}
	return 0, false
}

// LeaderBootstrapAddr returns the "host:port" every rank of a multi-node
// prefill registers to: the host of distInitAddr (the leader's
// --dist-init-addr, "host:port", IPv6 bracketed) with the leader's bootstrap
// port, IPv6 bracketed. SGLang broadcasts rank 0's port over torch
// (spec §2.1); kvxfer makes it configuration: every node is given the same
// --dist-init-addr and the leader's bootstrap port. Errors name the bad input.
func LeaderBootstrapAddr(distInitAddr string, bootstrapPort int) (string, error) {
	host, _, err := net.SplitHostPort(distInitAddr)
	if err != nil {
		return "", fmt.Errorf("bootstrap: dist-init-addr %q: want host:port (IPv6 as [addr]:port): %v", distInitAddr, err)
	}
	if host == "" {
		return "", fmt.Errorf("bootstrap: dist-init-addr %q has no host; give the leader node's address", distInitAddr)
	}
	if bootstrapPort < 1 || bootstrapPort > 65535 {
		return "", fmt.Errorf("bootstrap: leader bootstrap port %d out of range 1–65535", bootstrapPort)
	}
	return JoinHostPort(host, bootstrapPort), nil
}

// RegisterHost returns the host a single-node prefill rank registers to,
// SGLang's rule (spec §2.1): the server's listen host, with 0.0.0.0 → 127.0.0.1
// and :: → ::1, "" → 127.0.0.1.
func RegisterHost(listenHost string) string {
	switch listenHost {
	case "", "0.0.0.0":
		return "127.0.0.1"
	case "::", "[::]":
		return "::1"
	}
	return listenHost
}

// JoinHostPort formats "host:port", bracketing IPv6 hosts (and tolerating
// an already-bracketed host), the form every kvxfer address takes.
func JoinHostPort(host string, port int) string {
	if len(host) > 1 && host[0] == '[' && host[len(host)-1] == ']' {
		host = host[1 : len(host)-1]
	}
	return net.JoinHostPort(host, strconv.Itoa(port))
}
