// Package bootstrap is the client side of kvxfer's bootstrap directory:
// the SGLang wire types (RegisterRequest, PrefillServerInfo,
// PrefillRankInfo), their validating parsers, the HTTP client prefill and
// decode ranks use (Client), and the pure rank-mapping rule that tells a
// decode rank which prefill ranks hold its slice of the KV cache
// (TargetRanks). The server lives in package bootstrap/server, so ranks that
// only register and resolve do not link its HTTP framework and metrics.
//
// Protocol facts (routes, JSON keys, status codes, the 503 readiness rule, the
// room→dp-rank registry and its TTL, the rank-mapping table) come from
// /work/shared/spec/sglang-bootstrap.md §2–§4, which was written from SGLang's
// python/sglang/srt/disaggregation/common/conn.py at commit 0094505d. The
// newest protocol (CompatSGLangNewest) is that file at commit b7e89b39
// (CommonKVBootstrapServer._handle_route_put/_handle_route_get,
// PrefillServerInfo, CommonKVReceiver.init, register_to_bootstrap): every
// rank's registration adds "decode_allocation_policy" (default "early") and
// "dsv41_spec_layout" (a JSON object or null); the server answers 400 to a
// rank that disagrees with the ranks before it on either ("Inconsistent
// prefill allocation policies", "DeepSeek-V4.1 DSpark PD layout differs
// across prefill ranks"); the topology answer always carries
// decode_allocation_policy and carries dsv41_spec_layout only when it is not
// null; a decode fails every room whose prefill declares another policy than
// its own ("Disaggregation decode allocation policy mismatch") and refuses a
// layout that differs from its own ("PD layout mismatch"). Where SGLang
// answers 500 to malformed input, kvxfer's server answers 400 naming the
// field; valid input gets SGLang's exact codes and key sets.
//
// Rank liveness is a kvxfer extension (SGLang's directory has none): a rank
// that registers with heartbeat_ms checks in (GET /v1/entry with its
// instance_id, Client.CheckIn) at least that often; one silent for longer
// than StaleAfter(heartbeat) is reported stale in GET /v1/table (and the
// table is then not Ready), while GET /route keeps answering it (see
// TableRank.Stale for why).
package bootstrap

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"
)

// DefaultPort is the bootstrap server's default TCP port, SGLang's
// --disaggregation-bootstrap-port default (spec §2.1).
const DefaultPort = 8998

// DefaultEntryTTL is how long a room→dp-rank entry lives, SGLang's
// SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL default (spec §2.7).
const DefaultEntryTTL = 120 * time.Second

// Compatibility levels select the PrefillServerInfo key set that GET /route
// returns for the topology query. There is no version field anywhere in
// SGLang's protocol, and an SGLang decode builds PrefillServerInfo(**data), so
// an extra or missing key breaks the pairing (spec §2.5, §10 item 2): a decode
// older than the allocation-policy change raises TypeError on the newest key
// set, so it needs CompatSGLang0094505.
const (
	// CompatSGLangNewest is the default: the key set of SGLang's newest
	// common/conn.py (commit b7e89b394f2fe306f07a9731611b2dc9caa4767f): the
	// nine topology keys, "decode_allocation_policy" (always: "early" unless
	// the ranks registered another policy) and "dsv41_spec_layout" (only when
	// the ranks registered one), plus the six decode-side keys sent as null.
	CompatSGLangNewest = "sglang-newest"
	// CompatSGLang0094505 is the key set of SGLang commit
	// 0094505da74125a31ceb354f37ae7a1b6a97d3f5 (common/conn.py), for decodes
	// of that age: the nine topology keys plus the six decode-side keys sent
	// as null. It cannot carry an allocation policy or a DSpark layout, so a
	// server at this level refuses (400) a rank that registers either
	// (decode_allocation_policy other than "early", dsv41_spec_layout not
	// null) instead of dropping it.
	CompatSGLang0094505 = "sglang-0094505"
	// DefaultCompat is the level a server uses when none is given.
	DefaultCompat = CompatSGLangNewest
)

// Decode allocation policies: SGLang's
// --disaggregation-decode-allocation-policy (newest common/conn.py, b7e89b39).
// Under "early" a decode reserves its KV pages as soon as it has resolved the
// prefill ranks; under "prefill_complete" it subscribes to each prefill rank
// (ZMQ [BOOTSTRAP, room, decode_ip, decode_port]) and reserves them only once
// the prefill has finished computing the request and said so (a
// WaitingForInput status), so KV memory is not held while the prefill
// computes. Both roles must run the same policy; SGLang serves
// prefill_complete only with prefill attention TP 1, CP 1 and PP 1.
const (
	// PolicyEarly is SGLang's default policy (also what an absent key means).
	PolicyEarly = "early"
	// PolicyPrefillComplete defers the decode's allocation until the prefill
	// finished computing.
	PolicyPrefillComplete = "prefill_complete"
)

// MaxSpecLayoutBytes bounds a dsv41_spec_layout object (bytes of JSON); real
// layouts are a few KiB.
const MaxSpecLayoutBytes = 1 << 20

// CanonicalSpecLayout validates a dsv41_spec_layout value and returns it in
// canonical form (object keys sorted, no insignificant space, numbers as
// written), so that two layouts are equal when SGLang's dict comparison
// calls them equal (up to numbers written differently, e.g. 1 and 1.0). A
// JSON null, or nothing, gives nil (no layout). Errors: not a JSON object,
// invalid JSON, larger than MaxSpecLayoutBytes.
func CanonicalSpecLayout(raw []byte) (json.RawMessage, error) {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 || string(t) == "null" {
		return nil, nil
	}
	if len(t) > MaxSpecLayoutBytes {
		return nil, fmt.Errorf("%d bytes, over the limit of %d", len(t), MaxSpecLayoutBytes)
	}
	if t[0] != '{' {
		return nil, fmt.Errorf("want a JSON object (SGLang's get_dsv41_spec_layout) or null, got %s", truncate(string(t)))
	}
	dec := json.NewDecoder(bytes.NewReader(t))
	dec.UseNumber()
	var v map[string]any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("invalid JSON object: %v", err)
	}
	if dec.More() {
		return nil, errors.New("trailing data after the JSON object")
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("re-encode: %v", err)
	}
	return b, nil
}

// DiffSpecLayouts names the top-level keys on which two canonical layouts
// (CanonicalSpecLayout; nil for none) differ, sorted, as SGLang's decode does
// in its "PD layout mismatch" error; nil when they are equal.
func DiffSpecLayouts(a, b json.RawMessage) []string {
	if bytes.Equal(a, b) {
		return nil
	}
	var ma, mb map[string]json.RawMessage
	_ = json.Unmarshal(a, &ma)
	_ = json.Unmarshal(b, &mb)
	keys := map[string]bool{}
	for k, v := range ma {
		if w, ok := mb[k]; !ok || !bytes.Equal(v, w) {
			keys[k] = true
		}
	}
	for k := range mb {
		if _, ok := ma[k]; !ok {
			keys[k] = true
		}
	}
	out := make([]string, 0, len(keys))
	for k := range keys {
		out = append(out, k)
	}
	slices.Sort(out)
	if len(out) == 0 { // one side has no layout at all
		out = append(out, "(the whole layout)")
	}
	return out
}

// Rank liveness (a kvxfer extension; SGLang's directory has none).
const (
	// StaleAfterBeats is how many of its declared heartbeat intervals a rank
	// may miss before the directory reports it stale: a kvxfer prefill checks
	// its entry every DirectoryCheckInterval ±20 %, each check bounded by
	// max(2 intervals, 2 s), so a live rank's check-ins are at most about
	// 3.2 intervals apart even when the directory answers slowly.
	StaleAfterBeats = 4
	// MinStaleAfter is the shortest silence that makes a rank stale, however
	// short its interval (GC pauses and scheduling noise on a loaded host).
	MinStaleAfter = time.Second
	// MaxHeartbeatMS bounds a declared heartbeat interval (one day).
	MaxHeartbeatMS = 86_400_000
)

// StaleAfter is how long a rank that declared heartbeat interval hb may be
// silent (no check-in, no registration) before the directory reports it
// stale: StaleAfterBeats × hb, at least MinStaleAfter. 0 for hb ≤ 0 (the rank
// declared none and is never stale).
func StaleAfter(hb time.Duration) time.Duration {
	if hb <= 0 {
		return 0
	}
	return max(StaleAfterBeats*hb, MinStaleAfter)
}

// Errors returned by the client and by TargetRanks. Test with errors.Is; the
// wrapping error names the address, field or sizes involved.
var (
	// ErrNotReady: the server answered 503 — not every (dp, cp, tp, pp) rank of
	// the prefill instance has registered yet. Retry later.
	ErrNotReady = errors.New("bootstrap: prefill server not fully registered yet")
	// ErrNotFound: the server answered 404 — no rank registered at the asked
	// (dp, cp, tp, pp) coordinates.
	ErrNotFound = errors.New("bootstrap: rank not registered")
	// ErrUnauthorized: the server answered 401 — the bearer token is missing or wrong.
	ErrUnauthorized = errors.New("bootstrap: unauthorized (bearer token missing or wrong)")
	// ErrConflict: the server answered 409 — the registration's topology
	// (sizes, page_size, kv_cache_dtype, …) disagrees with the table's.
	ErrConflict = errors.New("bootstrap: registration conflicts with the registered topology")
	// ErrBadRequest: the server answered 400 — the request was malformed; the
	// wrapping error carries the server's message naming the field.
	ErrBadRequest = errors.New("bootstrap: bad request")
	// ErrRegisterDeadline: Register kept failing until its context or its
	// deadline (WithRegisterTimeout) expired. The wrapping error names the
	// server, the attempt count and the last failure. SGLang only logs this
	// (spec §10 item 4); kvxfer returns it.
	ErrRegisterDeadline = errors.New("bootstrap: registration deadline exceeded")
	// ErrWrongLeader: the server answering at the leader's bootstrap address is
	// not the one serving the expected dist-init-addr (usually a wrong
	// --port on a follower node or a port collision).
	ErrWrongLeader = errors.New("bootstrap: server at leader address is not the expected leader")
	// ErrMismatch: prefill and decode cannot be paired (page_size or
	// kv_cache_dtype differ, TP sizes not divisible, CP/PP unsupported).
	ErrMismatch = errors.New("bootstrap: prefill/decode pairing unsupported")
	// ErrReplaced: the server answered 412 — the entry at the rank's
	// coordinates names another instance: a PUT from an instance older
	// (lower epoch) than the entry's, or a conditional DELETE whose
	// instance_id is not the entry's. The rank was replaced (a rolling
	// restart); it must not take the coordinates back. The wrapping error
	// names the entry's instance and endpoint.
	ErrReplaced = errors.New("bootstrap: rank replaced by another instance")
	// ErrUnsupported: the server does not offer a kvxfer extension route
	// (e.g. an SGLang bootstrap server has no GET /v1/entry).
	ErrUnsupported = errors.New("bootstrap: route not offered by this server (not a kvxfer directory)")
	// ErrNotDirectory: the server answered GET /route's topology query
	// with 2xx content that is no PrefillServerInfo (an HTML page, another
	// service's JSON): the address is some other HTTP server, not a
	// bootstrap directory. The wrapping error carries the *FieldError
	// naming what was wrong with the answer.
	ErrNotDirectory = errors.New("bootstrap: the answer is not a bootstrap directory's")
)

// RegisterRequest is the PUT /route body a prefill rank sends (spec §2.3).
// The JSON tags are exactly SGLang's keys. All integer fields are required;
// kv_cache_dtype must be present but may be null.
type RegisterRequest struct {
	// AttnTPSize is the prefill attention-TP size (≥ 1).
	AttnTPSize int `json:"attn_tp_size"`
	// AttnTPRank is this rank's attention-TP rank, in [0, AttnTPSize).
	AttnTPRank int `json:"attn_tp_rank"`
	// AttnCPSize is the prefill attention-CP size (≥ 1).
	AttnCPSize int `json:"attn_cp_size"`
	// AttnCPRank is this rank's attention-CP rank, in [0, AttnCPSize).
	AttnCPRank int `json:"attn_cp_rank"`
	// AttnDPSize is the attention-DP size; it is the instance's dp_size when
	// SystemDPSize == 1.
	AttnDPSize int `json:"attn_dp_size"`
	// AttnDPRank is the DP table key when SystemDPSize == 1; otherwise it is
	// not read.
	AttnDPRank int `json:"attn_dp_rank"`
	// PPSize is the pipeline-parallel size (≥ 1).
	PPSize int `json:"pp_size"`
	// PPRank is this rank's PP rank, in [0, PPSize).
	PPRank int `json:"pp_rank"`
	// SystemDPSize is 1 when DP-attention is on, else --dp-size; when > 1 it is
	// the instance's dp_size.
	SystemDPSize int `json:"system_dp_size"`
	// SystemDPRank is the DP table key when SystemDPSize != 1; otherwise it
	// is not read (SGLang under DP attention sends the attention-DP rank here).
	SystemDPRank int `json:"system_dp_rank"`
	// RankIP is the host of this rank's control (ZMQ PULL) socket: an IPv4 or
	// IPv6 address (unbracketed) or a hostname.
	RankIP string `json:"rank_ip"`
	// RankPort is the port of this rank's control socket, 1–65535.
	RankPort int `json:"rank_port"`
	// PageSize is the KV page size in tokens (≥ 1).
	PageSize int `json:"page_size"`
	// KVCacheDtype is the --kv-cache-dtype CLI string ("auto", "fp8_e4m3", …)
	// or nil; the key is always sent.
	KVCacheDtype *string `json:"kv_cache_dtype"`
	// LoadBalanceMethod is the prefill's --load-balance-method;
	// "follow_bootstrap_room" (the default when empty) means dp = room % dp_size.
	LoadBalanceMethod string `json:"load_balance_method,omitempty"`
	// EnableDSACacheLayerSplit passes DSA cache layer splitting across CP through.
	EnableDSACacheLayerSplit bool `json:"enable_dsa_cache_layer_split"`
	// PrefillHTTPPort is the prefill's HTTP API port, or nil.
	PrefillHTTPPort *int `json:"prefill_http_port,omitempty"`
	// InstanceID identifies the rank's process (a kvxfer extension; SGLang
	// ranks send none): at most 64 characters of [A-Za-z0-9._:-]. With it,
	// the server refuses a PUT from an instance older than the entry's
	// (ErrReplaced) and DELETE can be made conditional on it.
	InstanceID string `json:"instance_id,omitempty"`
	// Epoch orders instances of the same coordinates (a kvxfer extension):
	// kvxfer ranks send their start time in Unix nanoseconds, so a
	// replacement started later wins. 0 when not sent.
	Epoch uint64 `json:"epoch,omitempty"`
	// DecodeAllocationPolicy is the prefill's
	// --disaggregation-decode-allocation-policy (newest SGLang sends it
	// always): PolicyEarly or PolicyPrefillComplete; "" (absent or null)
	// means PolicyEarly, as SGLang's data.get(…, "early"). Every rank of an
	// instance must register the same one (400 otherwise).
	DecodeAllocationPolicy string `json:"decode_allocation_policy,omitempty"`
	// DSV41SpecLayout is the prefill's DeepSeek-V4.1 DSpark speculative KV
	// layout (SGLang's get_dsv41_spec_layout(kv_args): a JSON object such as
	// {"block_size":…,"num_draft_tokens":…,"kv_layer_ids":[…],…}), or nil
	// (absent or null: no DSpark). Opaque to kvxfer: the parser stores it in
	// canonical form (CanonicalSpecLayout), the server compares it across
	// ranks (400 when a rank's differs) and answers it in PrefillServerInfo.
	DSV41SpecLayout json.RawMessage `json:"dsv41_spec_layout,omitempty"`
	// HeartbeatMS is how often, in ms, this rank checks in with the
	// directory (Client.CheckIn), a kvxfer extension: the directory reports
	// it stale after StaleAfter of silence. 0 (absent): the rank makes no
	// promise and is never reported stale. Needs InstanceID (the check-in
	// names the instance); 1 … MaxHeartbeatMS.
	HeartbeatMS int `json:"heartbeat_ms,omitempty"`
}

// AllocationPolicy returns the registration's decode allocation policy,
// PolicyEarly when none was given.
func (r RegisterRequest) AllocationPolicy() string {
	if r.DecodeAllocationPolicy == "" {
		return PolicyEarly
	}
	return r.DecodeAllocationPolicy
}

// DPSize returns the instance's dp_size as SGLang derives it: AttnDPSize when
// SystemDPSize == 1, else SystemDPSize (spec §2.3).
func (r RegisterRequest) DPSize() int {
	if r.SystemDPSize == 1 {
		return r.AttnDPSize
	}
	return r.SystemDPSize
}

// DPRank returns the DP table key: AttnDPRank when SystemDPSize == 1, else
// SystemDPRank (spec §2.3).
func (r RegisterRequest) DPRank() int {
	if r.SystemDPSize == 1 {
		return r.AttnDPRank
	}
	return r.SystemDPRank
}

// FollowBootstrapRoom reports whether the prefill routes DP by room % dp_size
// (load_balance_method empty or "follow_bootstrap_room").
func (r RegisterRequest) FollowBootstrapRoom() bool {
	return r.LoadBalanceMethod == "" || r.LoadBalanceMethod == LoadBalanceFollowBootstrapRoom
}

// LoadBalanceFollowBootstrapRoom is the load_balance_method value that makes a
// prefill pick its DP worker as bootstrap_room % dp_size.
const LoadBalanceFollowBootstrapRoom = "follow_bootstrap_room"

// PrefillServerInfo is the topology a decode gets from GET /route with all four
// parameters −1 (spec §2.5). The fields are in the order of SGLang's
// dataclass (newest, b7e89b39); the decode-side fields are always sent as
// null by the server. DecodeAllocationPolicy is sent only under
// CompatSGLangNewest (always there), DSV41SpecLayout only under it and only
// when not null (SGLang pops a null one). ParsePrefillServerInfo decodes it,
// ignoring unknown keys.
type PrefillServerInfo struct {
	// AttnTPSize is the prefill attention-TP size.
	AttnTPSize int `json:"attn_tp_size"`
	// AttnCPSize is the prefill attention-CP size.
	AttnCPSize int `json:"attn_cp_size"`
	// DPSize is the prefill DP size.
	DPSize int `json:"dp_size"`
	// PPSize is the prefill PP size.
	PPSize int `json:"pp_size"`
	// PageSize is the KV page size in tokens, or nil (then not checked).
	PageSize *int `json:"page_size"`
	// KVCacheDtype is the prefill's --kv-cache-dtype string, or nil.
	KVCacheDtype *string `json:"kv_cache_dtype"`
	// FollowBootstrapRoom is true when the prefill routes DP by room % dp_size.
	FollowBootstrapRoom bool `json:"follow_bootstrap_room"`
	// EnableDSACacheLayerSplit is true when DSA cache layers are split across CP.
	EnableDSACacheLayerSplit bool `json:"enable_dsa_cache_layer_split"`
	// DSV41SpecLayout is the prefill ranks' DeepSeek-V4.1 DSpark layout (a
	// canonical JSON object, see CanonicalSpecLayout), or nil: sent only
	// under CompatSGLangNewest and only when not nil. A decode with DSpark
	// refuses a prefill whose layout differs from its own.
	DSV41SpecLayout json.RawMessage `json:"dsv41_spec_layout,omitempty"`
	// DecodeAllocationPolicy is the prefill ranks' decode allocation policy
	// (PolicyEarly or PolicyPrefillComplete); sent only under
	// CompatSGLangNewest. nil reads as PolicyEarly (AllocationPolicy).
	DecodeAllocationPolicy *string `json:"decode_allocation_policy,omitempty"`
	// PrefillHTTPPort is the prefill HTTP API port, or nil.
	PrefillHTTPPort *int `json:"prefill_http_port"`

	// The decode-side fields: SGLang's dataclass carries them, so the server
	// sends them (as null) to keep the key set exact. TargetRanks computes
	// their values; the server never fills them.

	// TargetTPRank is the decode-side "real" target TP rank (null on the wire).
	TargetTPRank *int `json:"target_tp_rank"`
	// TargetTPRanks is the decode-side target TP rank list (null on the wire).
	TargetTPRanks []int `json:"target_tp_ranks"`
	// TargetCPRanks is the decode-side target CP rank list (null on the wire).
	TargetCPRanks []int `json:"target_cp_ranks"`
	// TargetPPRanks is the decode-side target PP rank list (null on the wire).
	TargetPPRanks []int `json:"target_pp_ranks"`
	// RequiredDstInfoNum is decode-side (null on the wire).
	RequiredDstInfoNum *int `json:"required_dst_info_num"`
	// RequiredPrefillResponseNum is decode-side (null on the wire).
	RequiredPrefillResponseNum *int `json:"required_prefill_response_num"`
}

// AllocationPolicy returns the prefill's decode allocation policy,
// PolicyEarly when the answer carried none (an older directory, or
// CompatSGLang0094505), as SGLang's dataclass default.
func (i PrefillServerInfo) AllocationPolicy() string {
	if i.DecodeAllocationPolicy == nil || *i.DecodeAllocationPolicy == "" {
		return PolicyEarly
	}
	return *i.DecodeAllocationPolicy
}

// PrefillRankInfo is the per-rank GET /route answer: the control-socket
// endpoint of one prefill rank (spec §2.6): exactly SGLang's two keys for a
// rank that registered without an instance id (every SGLang rank), plus
// instance_id and epoch for a kvxfer rank (an SGLang decode reads the answer
// as a dict and ignores them).
type PrefillRankInfo struct {
	// RankIP is the rank's host (IP or hostname, IPv6 unbracketed).
	RankIP string `json:"rank_ip"`
	// RankPort is the rank's control port, 1–65535.
	RankPort int `json:"rank_port"`
	// InstanceID is the registering process's instance id, or "".
	InstanceID string `json:"instance_id,omitempty"`
	// Epoch is the registering instance's epoch, or 0.
	Epoch uint64 `json:"epoch,omitempty"`
}

// Endpoint returns "tcp://host:port" with IPv6 hosts bracketed, the ZMQ form.
func (r PrefillRankInfo) Endpoint() string {
	return "tcp://" + JoinHostPort(r.RankIP, r.RankPort)
}

// Coord is one prefill rank's position in the table
// prefill_port_table[dp][cp][tp][pp].
type Coord struct {
	// DP is the prefill DP rank (attn_dp_rank, or system_dp_rank when system_dp_size > 1).
	DP int `json:"dp"`
	// CP is the attention-CP rank.
	CP int `json:"cp"`
	// TP is the attention-TP rank.
	TP int `json:"tp"`
	// PP is the pipeline rank.
	PP int `json:"pp"`
}

// String formats the coordinates as SGLang's 404 text does.
func (c Coord) String() string {
	return fmt.Sprintf("dp_rank=%d cp_rank=%d tp_rank=%d pp_rank=%d", c.DP, c.CP, c.TP, c.PP)
}

// DecodeRank describes the decode rank that is resolving its producers
// (the decode side of spec §4.3).
type DecodeRank struct {
	// AttnTPSize is the decode attention-TP size D (≥ 1).
	AttnTPSize int
	// AttnTPRank is the decode rank's TP rank; e = AttnTPRank % AttnTPSize.
	AttnTPRank int
	// AttnCPSize is the decode attention-CP size; SGLang requires 1.
	AttnCPSize int
	// AttnCPRank is the decode CP rank (0).
	AttnCPRank int
	// PPSize is the decode PP size: equal to the prefill's, or 1.
	PPSize int
	// PPRank is the decode PP rank.
	PPRank int
	// IsMLA is true for an MLA KV pool: with prefill TP > decode TP only one
	// producer sends, the others are dummy ranks.
	IsMLA bool
	// IsHybridMLA marks SGLang's separate "hybrid MLA" flag: counted like
	// non-MLA (no dummy ranks) and it enables all-CP-rank transfer.
	IsHybridMLA bool
	// AllCPRanksTransfer mirrors SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER:
	// every prefill CP rank sends.
	AllCPRanksTransfer bool
	// PageSize is the decode KV page size in tokens; 0 skips the check.
	PageSize int
	// KVCacheDtype is the decode --kv-cache-dtype string; "" skips the check.
	KVCacheDtype string
}

// TargetRank is one prefill rank a decode rank must contact.
type TargetRank struct {
	// DP, CP, TP, PP are the prefill rank's table coordinates (GET /route's
	// prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank).
	DP, CP, TP, PP int
	// Dummy is true when the rank must be contacted (empty page list) but sends
	// no data and no status (MLA with prefill TP > decode TP, spec §5.3).
	Dummy bool
}

// Coord returns the rank's table coordinates.
func (t TargetRank) Coord() Coord { return Coord{DP: t.DP, CP: t.CP, TP: t.TP, PP: t.PP} }

// Targets is what TargetRanks computes: SGLang's _resolve_rank_mapping
// results (spec §4.3) plus the ordered rank list of _setup_bootstrap_infos
// (spec §4.4: for each CP, for each TP, PP ranks high to low).
type Targets struct {
	// Ranks are the prefill ranks to contact, in SGLang's lookup order.
	Ranks []TargetRank
	// TargetTPRank is the "real" TP rank (the first of TargetTPRanks).
	TargetTPRank int
	// TargetTPRanks are the prefill TP ranks holding this decode rank's heads.
	TargetTPRanks []int
	// TargetCPRanks are the prefill CP ranks to contact.
	TargetCPRanks []int
	// TargetPPRanks are the prefill PP ranks to contact (ascending).
	TargetPPRanks []int
	// RequiredDstInfoNum is how many decode ranks each producer waits for
	// before sending (D/P when decode TP is larger, else 1).
	RequiredDstInfoNum int
	// RequiredPrefillResponseNum is how many distinct producer Success
	// statuses the decode must collect for a room.
	RequiredPrefillResponseNum int
}

// TableSnapshot is the GET /v1/table answer (a kvxfer extension for
// diagnosis): the whole directory at one instant.
type TableSnapshot struct {
	// Compat is the PrefillServerInfo key set this server emits.
	Compat string `json:"compat"`
	// Ready is true when every distinct rank has registered and none is
	// stale (TableRank.Stale). GET /route's topology query answers 200 as
	// soon as Registered == Expected, stale ranks or not, as SGLang's does:
	// the topology is still right, and a decode judges a dead rank itself.
	Ready bool `json:"ready"`
	// Registered is the number of distinct ranks registered.
	Registered int `json:"registered"`
	// Stale is the number of registered ranks silent beyond their
	// heartbeat bound (TableRank.Stale).
	Stale int `json:"stale"`
	// Expected is dp·cp·tp·pp of the topology (0 before the first registration).
	Expected int `json:"expected"`
	// Topology is the PrefillServerInfo the server would answer, or null.
	Topology *PrefillServerInfo `json:"topology"`
	// Ranks lists every registered rank, sorted by (dp, cp, tp, pp).
	Ranks []TableRank `json:"ranks"`
	// Missing lists the coordinates not yet registered (at most 1024).
	Missing []Coord `json:"missing"`
	// DPRooms is the number of live room→dp-rank entries.
	DPRooms int `json:"dp_rooms"`
	// EntryTTLSeconds is the room→dp-rank entry lifetime in seconds.
	EntryTTLSeconds float64 `json:"entry_ttl_seconds"`
	// DistInitAddr is the multi-node leader address the server was given, or "".
	DistInitAddr string `json:"dist_init_addr,omitempty"`
}

// TableRank is one registered rank in a TableSnapshot.
type TableRank struct {
	Coord
	PrefillRankInfo
	// RegisteredAt is the time of the latest registration (RFC 3339).
	RegisteredAt time.Time `json:"registered_at"`
	// Reregistrations counts registrations that replaced this entry.
	Reregistrations int `json:"reregistrations"`
	// HeartbeatMS is the check-in interval the rank declared (heartbeat_ms),
	// 0 when it declared none (every SGLang rank): such a rank is never
	// reported stale.
	HeartbeatMS int `json:"heartbeat_ms,omitempty"`
	// Stale is true when the rank declared a heartbeat and has neither
	// checked in nor registered for longer than StaleAfter(HeartbeatMS): it
	// is dead, hung, or cut off from the directory. GET /route still answers
	// its endpoint: the directory's evidence is second hand (a rank cut off
	// from the directory alone still serves its decodes), a decode judges the
	// rank first hand (kvxfer: its control connection drops or the peer
	// timeout passes; SGLang: its waiting timeout), and a restarted rank
	// replaces the entry when it registers.
	Stale bool `json:"stale,omitempty"`
	// SilentSince is the time of the rank's last check-in or registration,
	// set only while it is Stale (so the table does not change with every
	// check-in).
	SilentSince *time.Time `json:"silent_since,omitempty"`
}
