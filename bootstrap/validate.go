package bootstrap

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Limits the server enforces on registrations (none of them binds a real
// deployment: SGLang instances have at most a few hundred ranks).
const (
	// MaxParallelSize bounds each of dp/cp/tp/pp size.
	MaxParallelSize = 1 << 16
	// MaxRanks bounds dp·cp·tp·pp, the number of table entries.
	MaxRanks = 1 << 20
)

// FieldError is a malformed request naming the offending field; the
// server answers it with 400 and its text. Returned (as error) by the Parse*
// functions of this package.
type FieldError struct {
	// Field is the JSON key or query parameter, e.g. "rank_port",
	// "bootstrap_rooms[3]" or "prefill_dp_rank".
	Field string
	// Msg says what is wrong and what is accepted.
	Msg string
	// Missing is true when the field is absent or empty (GET /route answers
	// SGLang's "Missing inputs for bootstrap server." then).
	Missing bool
}

// Error formats "field: message".
func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// NewFieldError returns a *FieldError for field with a formatted message.
func NewFieldError(field, format string, args ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

func fieldErr(field, format string, args ...any) error { return NewFieldError(field, format, args...) }

// jsonObject parses body as one JSON object and returns its raw members.
func jsonObject(body []byte, what string) (map[string]json.RawMessage, error) {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return nil, fieldErr("body", "empty; want a JSON object (%s)", what)
	}
	if trimmed[0] != '{' {
		return nil, fieldErr("body", "not a JSON object (%s)", what)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(trimmed, &m); err != nil {
		return nil, fieldErr("body", "invalid JSON: %v", err)
	}
	return m, nil
}

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

// parseInt decodes a JSON integer (no fraction, no exponent, no quotes) into
// an int64; want describes the accepted values for the error ("an integer
// in [1, 65535]"). SGLang sends Python ints, so "1e3" or "6001.0" is
// refused as not a whole JSON integer (named so), not taken as 1000.
func parseInt(field string, raw json.RawMessage, want string) (int64, error) {
	s := string(bytes.TrimSpace(raw))
	if s == "" || s == "null" {
		return 0, fieldErr(field, "is null; want %s", want)
	}
	if s[0] == '"' {
		return 0, fieldErr(field, "is a string (%s); want %s, as a JSON number without quotes", truncate(s), want)
	}
	if s[0] != '-' && (s[0] < '0' || s[0] > '9') {
		return 0, fieldErr(field, "is %s; want %s", truncate(s), want)
	}
	v, err := strconv.ParseInt(s, 10, 64)
	switch {
	case err == nil:
		return v, nil
	case strings.ContainsAny(s, ".eE"):
		return 0, fieldErr(field, "%s is not written as a whole JSON integer (no fraction or exponent); want %s", truncate(s), want)
	case errors.Is(err, strconv.ErrRange):
		return 0, fieldErr(field, "%s is out of range; want %s", truncate(s), want)
	}
	return 0, fieldErr(field, "%s is not a JSON integer; want %s", truncate(s), want)
}

// intRange words [lo, hi] for parseInt's want, naming a TCP port as one.
func intRange(field string, lo, hi int64) string {
	if strings.HasSuffix(field, "_port") && lo == 1 && hi == 65535 {
		return "an integer port 1–65535"
	}
	return fmt.Sprintf("an integer in [%d, %d]", lo, hi)
}

func truncate(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

func reqInt(m map[string]json.RawMessage, field string, lo, hi int64) (int, error) {
	raw, ok := m[field]
	if !ok {
		return 0, fieldErr(field, "missing (required integer)")
	}
	v, err := parseInt(field, raw, intRange(field, lo, hi))
	if err != nil {
		return 0, err
	}
	if v < lo || v > hi {
		return 0, fieldErr(field, "%d is out of range; want %s", v, intRange(field, lo, hi))
	}
	return int(v), nil
}

func optString(m map[string]json.RawMessage, field string) (*string, bool, error) {
	raw, ok := m[field]
	if !ok {
		return nil, false, nil
	}
	if isNull(raw) {
		return nil, true, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, true, fieldErr(field, "want a string or null, got %s", truncate(string(bytes.TrimSpace(raw))))
	}
	return &s, true, nil
}

func optBool(m map[string]json.RawMessage, field string) (bool, error) {
	raw, ok := m[field]
	if !ok || isNull(raw) {
		return false, nil
	}
	switch string(bytes.TrimSpace(raw)) {
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, fieldErr(field, "want true or false, got %s", truncate(string(bytes.TrimSpace(raw))))
}

// ParseRegisterRequest decodes and validates a PUT /route body. Every field
// is type-checked (integers must be JSON integers) and range-checked: sizes
// in [1, MaxParallelSize] with dp·cp·tp·pp ≤ MaxRanks, each rank in [0, size)
// — of the two DP ranks only the table key (attn_dp_rank when
// system_dp_size is 1, else system_dp_rank; the other is ignored as SGLang
// ignores it, so a DP-attention rank filing system_dp_rank = its attention-DP
// rank is accepted),
// rank_port and prefill_http_port in 1–65535, page_size ≥ 1, rank_ip a
// usable IPv4 or IPv6 address (brackets are removed; not unspecified,
// multicast or broadcast) or an RFC 1123 hostname (see validHost),
// kv_cache_dtype present (string or null), decode_allocation_policy
// (optional, string or null) a policy name (ValidPolicyName; any name, so a
// policy newer than this build still registers), dsv41_spec_layout
// (optional) a JSON object or null (CanonicalSpecLayout), instance_id
// (kvxfer's, optional) per ValidInstanceID, epoch (optional) in
// [0, 2^63−1] and heartbeat_ms (kvxfer's, optional) in [1, MaxHeartbeatMS]
// and only with an instance_id. Unknown keys are ignored, as a newer SGLang
// may add some. The error message names the field.
func ParseRegisterRequest(body []byte) (RegisterRequest, error) {
	var r RegisterRequest
	m, err := jsonObject(body, "PUT /route registration")
	if err != nil {
		return r, err
	}
	ints := []struct {
		dst    *int
		name   string
		lo, hi int64
	}{
		{&r.AttnTPSize, "attn_tp_size", 1, MaxParallelSize},
		{&r.AttnCPSize, "attn_cp_size", 1, MaxParallelSize},
		{&r.AttnDPSize, "attn_dp_size", 1, MaxParallelSize},
		{&r.PPSize, "pp_size", 1, MaxParallelSize},
		{&r.SystemDPSize, "system_dp_size", 1, MaxParallelSize},
		{&r.RankPort, "rank_port", 1, 65535},
		{&r.PageSize, "page_size", 1, 1 << 30},
	}
	for _, f := range ints {
		if *f.dst, err = reqInt(m, f.name, f.lo, f.hi); err != nil {
			return r, err
		}
	}
	// The DP table key is attn_dp_rank when system_dp_size is 1 (DP
	// attention, or no DP), else system_dp_rank (spec §2.3); SGLang never
	// reads the other one, and under DP attention it files system_dp_rank
	// equal to the attention-DP rank with system_dp_size 1. Only the key is
	// checked against its size: the other field need only be a rank number.
	dpAttn := r.SystemDPSize == 1
	ranks := []struct {
		dst  *int
		name string
		size int // 0: not a table key, any value in [0, MaxParallelSize]
		of   string
	}{
		{&r.AttnTPRank, "attn_tp_rank", r.AttnTPSize, "attn_tp_size"},
		{&r.AttnCPRank, "attn_cp_rank", r.AttnCPSize, "attn_cp_size"},
		{&r.AttnDPRank, "attn_dp_rank", keySize(dpAttn, r.AttnDPSize), "attn_dp_size (the DP table key while system_dp_size is 1)"},
		{&r.PPRank, "pp_rank", r.PPSize, "pp_size"},
		{&r.SystemDPRank, "system_dp_rank", keySize(!dpAttn, r.SystemDPSize), "system_dp_size"},
	}
	for _, f := range ranks {
		v, err := reqInt(m, f.name, 0, MaxParallelSize)
		if err != nil {
			return r, err
		}
		if f.size > 0 && v >= f.size {
			return r, fieldErr(f.name, "%d must be < %s %d", v, f.of, f.size)
		}
		*f.dst = v
	}
	if total := int64(r.DPSize()) * int64(r.AttnCPSize) * int64(r.AttnTPSize) * int64(r.PPSize); total > MaxRanks {
		return r, fieldErr("attn_tp_size", "dp·cp·tp·pp = %d ranks exceeds the limit %d", total, MaxRanks)
	}

	ip, present, err := optString(m, "rank_ip")
	if err != nil {
		return r, err
	}
	if !present || ip == nil {
		return r, fieldErr("rank_ip", "missing (required string: IP address or hostname)")
	}
	if r.RankIP, err = validHost(*ip); err != nil {
		return r, fieldErr("rank_ip", "%v", err)
	}

	dt, present, err := optString(m, "kv_cache_dtype")
	if err != nil {
		return r, err
	}
	if !present {
		return r, fieldErr("kv_cache_dtype", "missing (required key; string such as \"auto\", or null)")
	}
	if dt != nil && (len(*dt) > 64 || !printable(*dt)) {
		return r, fieldErr("kv_cache_dtype", "want a short printable string, got %q", truncate(*dt))
	}
	r.KVCacheDtype = dt

	lb, _, err := optString(m, "load_balance_method")
	if err != nil {
		return r, err
	}
	if lb != nil {
		if len(*lb) > 64 || !printable(*lb) {
			return r, fieldErr("load_balance_method", "want a short printable string, got %q", truncate(*lb))
		}
		r.LoadBalanceMethod = *lb
	}
	if r.EnableDSACacheLayerSplit, err = optBool(m, "enable_dsa_cache_layer_split"); err != nil {
		return r, err
	}
	id, _, err := optString(m, "instance_id")
	if err != nil {
		return r, err
	}
	if id != nil {
		if !ValidInstanceID(*id) {
			return r, fieldErr("instance_id", "%q: want 1–64 characters of letters, digits, '.', '_', ':' or '-'", truncate(*id))
		}
		r.InstanceID = *id
	}
	if raw, ok := m["epoch"]; ok && !isNull(raw) {
		v, err := parseInt("epoch", raw, "an integer in [0, 2^63-1]")
		if err != nil {
			return r, err
		}
		if v < 0 {
			return r, fieldErr("epoch", "%d is negative; want an integer in [0, 2^63-1]", v)
		}
		r.Epoch = uint64(v)
	}
	pol, _, err := optString(m, "decode_allocation_policy")
	if err != nil {
		return r, err
	}
	if pol != nil {
		if !ValidPolicyName(*pol) {
			return r, fieldErr("decode_allocation_policy", "%q: want a policy name such as %q or %q (1–64 letters, digits, '_', '-' or '.')",
				truncate(*pol), PolicyEarly, PolicyPrefillComplete)
		}
		r.DecodeAllocationPolicy = *pol
	}
	if raw, ok := m["dsv41_spec_layout"]; ok {
		if r.DSV41SpecLayout, err = CanonicalSpecLayout(raw); err != nil {
			return r, fieldErr("dsv41_spec_layout", "%v", err)
		}
	}
	if raw, ok := m["heartbeat_ms"]; ok && !isNull(raw) {
		v, err := parseInt("heartbeat_ms", raw, fmt.Sprintf("an integer in [1, %d] (ms)", MaxHeartbeatMS))
		if err != nil {
			return r, err
		}
		if v < 1 || v > MaxHeartbeatMS {
			return r, fieldErr("heartbeat_ms", "%d out of range [1, %d] (the rank's check-in interval in ms)", v, MaxHeartbeatMS)
		}
		if r.InstanceID == "" {
			return r, fieldErr("heartbeat_ms", "needs instance_id: a check-in (GET /v1/entry&instance_id=…) names the instance it keeps alive")
		}
		r.HeartbeatMS = int(v)
	}
	if raw, ok := m["prefill_http_port"]; ok && !isNull(raw) {
		v, err := parseInt("prefill_http_port", raw, intRange("prefill_http_port", 1, 65535))
		if err != nil {
			return r, err
		}
		if v < 1 || v > 65535 {
			return r, fieldErr("prefill_http_port", "%d out of range [1, 65535]", v)
		}
		p := int(v)
		r.PrefillHTTPPort = &p
	}
	return r, nil
}

// ValidPolicyName reports whether p can be a decode allocation policy name:
// 1–64 characters of letters, digits, '_', '-' or '.' (SGLang's are
// PolicyEarly and PolicyPrefillComplete; the directory only carries and
// compares the name, so it accepts newer ones too).
func ValidPolicyName(p string) bool {
	if p == "" || len(p) > 64 {
		return false
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

// ParsePrefillServerInfo decodes a GET /route topology answer (spec §2.5)
// from any directory, SGLang's or kvxfer's, of either key set: unknown keys
// are ignored and missing newer ones read as SGLang's defaults (no DSpark
// layout, policy PolicyEarly). Errors name the key: not a JSON object, a
// size below 1 (attn_tp_size, attn_cp_size, dp_size, pp_size), a page_size
// below 1, a decode_allocation_policy that is not a policy name, a
// dsv41_spec_layout that is neither an object nor null. A null layout reads
// as nil; a layout is returned in canonical form.
func ParsePrefillServerInfo(data []byte) (*PrefillServerInfo, error) {
	var info PrefillServerInfo
	if t := bytes.TrimSpace(data); len(t) == 0 || t[0] != '{' {
		return nil, fieldErr("body", "not a JSON object (PrefillServerInfo)")
	}
	if err := json.Unmarshal(data, &info); err != nil {
		return nil, fieldErr("body", "decode PrefillServerInfo: %v", err)
	}
	if info.AttnTPSize < 1 || info.AttnCPSize < 1 || info.DPSize < 1 || info.PPSize < 1 {
		return nil, fieldErr("attn_tp_size", "sizes must be ≥ 1, got attn_tp_size=%d attn_cp_size=%d dp_size=%d pp_size=%d",
			info.AttnTPSize, info.AttnCPSize, info.DPSize, info.PPSize)
	}
	if info.PageSize != nil && *info.PageSize < 1 {
		return nil, fieldErr("page_size", "%d: want ≥ 1 or null", *info.PageSize)
	}
	if p := info.DecodeAllocationPolicy; p != nil && !ValidPolicyName(*p) {
		return nil, fieldErr("decode_allocation_policy", "%q is not a policy name (want e.g. %q or %q)", truncate(*p), PolicyEarly, PolicyPrefillComplete)
	}
	layout, err := CanonicalSpecLayout(info.DSV41SpecLayout)
	if err != nil {
		return nil, fieldErr("dsv41_spec_layout", "%v", err)
	}
	info.DSV41SpecLayout = layout
	return &info, nil
}

// keySize returns size when the field is a table key, else 0 (unchecked).
func keySize(isKey bool, size int) int {
	if isKey {
		return size
	}
	return 0
}

// ValidInstanceID reports whether id is a usable instance id: 1–64
// characters of letters, digits, '.', '_', ':' or '-'.
func ValidInstanceID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == ':' || c == '-') {
			return false
		}
	}
	return true
}

func printable(s string) bool {
	for _, c := range s {
		if c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}

// rankIPWant is what validHost accepts, for error messages.
const rankIPWant = "want an IPv4 address (dotted quad 0-255, no leading zeros), an IPv6 address " +
	"(brackets optional, zone allowed), neither unspecified (0.0.0.0, ::) nor multicast/broadcast, " +
	"or an RFC 1123 hostname (letters, digits, '-', '_' in dot-separated labels; the last label not all-numeric)"

// ValidateHost checks that h is a host a peer can connect to (see
// validHost: an IPv4 or IPv6 address, brackets optional, that is not a
// wildcard, multicast or broadcast, or an RFC 1123 hostname) and returns it
// unbracketed; the error says what is accepted.
func ValidateHost(h string) (string, error) { return validHost(h) }

// validHost accepts a host a decode can connect to: an IPv4 address in
// canonical dotted-quad form, an IPv6 address (optionally bracketed, zone
// allowed), or an RFC 1123 hostname; it returns the host unbracketed.
// Loopback is allowed (single-node and tests). Rejected: the unspecified
// addresses (0.0.0.0, ::, and ::ffff:0.0.0.0), multicast and the IPv4
// limited broadcast, since no connection can reach a rank there, and
// all-numeric dotted strings that are not valid IPv4 ("999.1.1.1", "1.2.3",
// "01.02.03.04"): RFC 1123 §2.1 rules them out as hostnames, and resolvers
// would read some of them as inet_aton shorthands for other addresses.
// Underscores are tolerated in labels (container and service names use them).
func validHost(h string) (string, error) {
	bad := func() (string, error) {
		return "", fmt.Errorf("%q is not a usable address; %s", truncate(h), rankIPWant)
	}
	if h == "" {
		return "", fmt.Errorf("empty; %s", rankIPWant)
	}
	if len(h) >= 2 && h[0] == '[' && h[len(h)-1] == ']' {
		inner := h[1 : len(h)-1]
		if a, err := netip.ParseAddr(inner); err == nil && a.Is6() {
			if !usableIP(a) {
				return bad()
			}
			return inner, nil
		}
		return "", fmt.Errorf("%q: brackets only around an IPv6 address; %s", truncate(h), rankIPWant)
	}
	if a, err := netip.ParseAddr(h); err == nil {
		if !usableIP(a) {
			return bad()
		}
		return h, nil
	}
	if !IsHostname(h) {
		return bad()
	}
	return h, nil
}

// usableIP reports whether a can be a unicast connection target.
func usableIP(a netip.Addr) bool {
	u := a.Unmap()
	return !u.IsUnspecified() && !u.IsMulticast() && u != netip.AddrFrom4([4]byte{255, 255, 255, 255})
}

// IsHostname reports whether h is an RFC 1123 hostname: at most 253
// characters (plus an optional final dot), labels of 1–63 letters, digits,
// '-' or '_' not starting or ending with '-', and a last label that is not
// all-numeric (nor a 0x hex number), so that no numeric address form passes.
func IsHostname(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	labels := strings.Split(h, ".")
	for _, label := range labels {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return !numericLabel(labels[len(labels)-1])
}

// numericLabel reports whether l is a decimal number or a 0x hex number,
// the forms inet_aton reads as (part of) an IPv4 address.
func numericLabel(l string) bool {
	digits := l
	hex := false
	if len(l) >= 2 && l[0] == '0' && (l[1] == 'x' || l[1] == 'X') {
		digits, hex = l[2:], true
	}
	for i := 0; i < len(digits); i++ {
		c := digits[i]
		if !(c >= '0' && c <= '9' || hex && (c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F')) {
			return false
		}
	}
	return true
}

// parseRoom decodes one bootstrap_room: a JSON integer in [0, 2^63−1].
func parseRoom(field string, raw json.RawMessage) (uint64, error) {
	v, err := parseInt(field, raw, "a bootstrap_room, an integer in [0, 2^63-1]")
	if err != nil {
		return 0, err
	}
	if v < 0 {
		return 0, fieldErr(field, "%d is negative; rooms are in [0, 2^63-1]", v)
	}
	return uint64(v), nil
}

// ParseRegisterDPRank decodes a POST /register_dp_rank body
// {"bootstrap_room": int, "dp_rank": int}; the room must be in
// [0, 2^63−1] and dp_rank in [0, MaxParallelSize).
func ParseRegisterDPRank(body []byte) (room uint64, dpRank int, err error) {
	m, err := jsonObject(body, "register_dp_rank")
	if err != nil {
		return 0, 0, err
	}
	raw, ok := m["bootstrap_room"]
	if !ok {
		return 0, 0, fieldErr("bootstrap_room", "missing (required integer in [0, 2^63-1])")
	}
	if room, err = parseRoom("bootstrap_room", raw); err != nil {
		return 0, 0, err
	}
	if dpRank, err = reqInt(m, "dp_rank", 0, MaxParallelSize-1); err != nil {
		return 0, 0, err
	}
	return room, dpRank, nil
}

// ParseQueryDPRanks decodes a POST /query_dp_ranks body
// {"bootstrap_rooms": [int, …]}; each room must be in [0, 2^63−1]. The error
// names the bad element's index.
func ParseQueryDPRanks(body []byte) ([]uint64, error) {
	m, err := jsonObject(body, "query_dp_ranks")
	if err != nil {
		return nil, err
	}
	raw, ok := m["bootstrap_rooms"]
	if !ok {
		return nil, fieldErr("bootstrap_rooms", "missing (required array of integers)")
	}
	if s := bytes.TrimSpace(raw); len(s) == 0 || s[0] != '[' {
		return nil, fieldErr("bootstrap_rooms", "want an array of integers")
	}
	// Fast path: plain integers (json rejects strings, fractions, exponents
	// and out-of-range values for int64; null would silently become 0, so it
	// takes the slow path that names the bad element).
	if !bytes.Contains(raw, []byte("null")) {
		var ints []int64
		if json.Unmarshal(raw, &ints) == nil {
			rooms := make([]uint64, len(ints))
			ok := true
			for i, v := range ints {
				if v < 0 {
					ok = false
					break
				}
				rooms[i] = uint64(v)
			}
			if ok {
				return rooms, nil
			}
		}
	}
	return parseRoomsSlow(raw)
}

// parseRoomsSlow decodes a JSON array of rooms element by element, naming
// the first bad element.
func parseRoomsSlow(raw json.RawMessage) ([]uint64, error) {
	var elems []json.RawMessage
	var err error
	if err := json.Unmarshal(raw, &elems); err != nil {
		return nil, fieldErr("bootstrap_rooms", "want an array of integers: %v", err)
	}
	rooms := make([]uint64, len(elems))
	for i, e := range elems {
		if rooms[i], err = parseRoom(fmt.Sprintf("bootstrap_rooms[%d]", i), e); err != nil {
			return nil, err
		}
	}
	return rooms, nil
}

// ParseRankQueryString is ParseRankQuery over a raw (still escaped) query
// string, as the server's hot GET /route path receives it. Plain
// queries (no escapes, '+' or ';') are scanned without allocating; others go
// through url.ParseQuery. As with url.Values.Get, the first value of a
// repeated parameter wins.
func ParseRankQueryString(raw string) (Coord, bool, error) {
	if strings.ContainsAny(raw, "%+;") {
		v, _ := url.ParseQuery(raw)
		return ParseRankQuery(v.Get)
	}
	var vals [4]string
	var seen [4]bool
	for raw != "" {
		var kv string
		kv, raw, _ = strings.Cut(raw, "&")
		k, v, _ := strings.Cut(kv, "=")
		i := -1
		switch k {
		case "prefill_dp_rank":
			i = 0
		case "prefill_cp_rank":
			i = 1
		case "target_tp_rank":
			i = 2
		case "target_pp_rank":
			i = 3
		}
		if i >= 0 && !seen[i] {
			vals[i], seen[i] = v, true
		}
	}
	return ParseRankQuery(func(name string) string {
		switch name {
		case "prefill_dp_rank":
			return vals[0]
		case "prefill_cp_rank":
			return vals[1]
		case "target_tp_rank":
			return vals[2]
		}
		return vals[3]
	})
}

// RankQueryParams are GET/DELETE /route's four query parameters, in order.
var RankQueryParams = [4]string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"}

// ParseRankQuery decodes GET/DELETE /route's four query parameters
// (prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank). It
// returns all == true for the topology form (all four −1). Missing or empty
// parameters give a *FieldError with Missing set whose Field lists them all
// (the server answers SGLang's text "Missing inputs for bootstrap server."
// followed by their names); a non-integer or a negative value outside the
// all-−1 form names the parameter.
func ParseRankQuery(get func(string) string) (c Coord, all bool, err error) {
	names := RankQueryParams
	var missing []string
	for _, n := range names {
		if get(n) == "" {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return c, false, &FieldError{Field: strings.Join(missing, ", "), Msg: "missing", Missing: true}
	}
	var v [4]int
	for i, n := range names {
		s := get(n)
		x, err := strconv.Atoi(s)
		if err != nil || x < -1 || x >= MaxRanks {
			return c, false, fieldErr(n, "%q is not an integer in [-1, %d)", truncate(s), MaxRanks)
		}
		v[i] = x
	}
	if v == [4]int{-1, -1, -1, -1} {
		return c, true, nil
	}
	for i, n := range names {
		if v[i] < 0 {
			return c, false, fieldErr(n, "-1 is allowed only when all four parameters are -1 (topology query)")
		}
	}
	return Coord{DP: v[0], CP: v[1], TP: v[2], PP: v[3]}, false, nil
}
