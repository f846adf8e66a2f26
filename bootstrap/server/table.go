package server

// The rank table: registrations, the topology they must agree on, and the
// PrefillServerInfo answer built from them.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/labstack/echo/v4"
)

// topology holds the first-writer-wins scalars of the table (spec §2.2).
type topology struct {
	tpSize, cpSize, dpSize, ppSize int
	pageSize                       int
	kvCacheDtype                   *string
	follow                         bool
	dsaSplit                       bool
	httpPort                       *int
	total                          int
	// policy is the decode allocation policy ("early" when none was
	// given) and layout the canonical DSpark layout (nil: none): every rank
	// must register the same (newest SGLang answers 400 otherwise).
	policy string
	layout json.RawMessage
}

type rankEntry struct {
	info         bootstrap.PrefillRankInfo
	json         []byte
	registeredAt time.Time
	updates      int
	// hb is the heartbeat interval the rank declared (0: none). lastSeen
	// is its last registration or check-in (Unix ns), updated under the
	// read lock by check-ins; staleLogged is whether the sweep has logged
	// it stale (so it logs each transition once).
	hb          time.Duration
	lastSeen    atomic.Int64
	staleLogged atomic.Bool
}

// silentFor returns how long the entry has been silent and whether that
// makes it stale at now.
func (e *rankEntry) silentFor(now time.Time) (time.Duration, bool) {
	if e.hb <= 0 {
		return 0, false
	}
	d := now.Sub(time.Unix(0, e.lastSeen.Load()))
	return d, d > bootstrap.StaleAfter(e.hb)
}

// Register adds or replaces one rank in the table directly (the handler's
// logic without HTTP). It returns an error wrapping ErrConflict when the
// rank's topology disagrees with the table's.
func (s *Server) Register(r bootstrap.RegisterRequest) error {
	_, err := s.apply(r)
	return err
}

func (s *Server) register(c echo.Context, r bootstrap.RegisterRequest) error {
	replaced, err := s.apply(r)
	if errors.Is(err, bootstrap.ErrReplaced) {
		s.m.regSuperseded.Inc()
		s.log.Warn("registration from a replaced instance refused", "remote", c.RealIP(), "err", err)
		return text(c, http.StatusPreconditionFailed, err.Error())
	}
	if errors.Is(err, bootstrap.ErrBadRequest) {
		s.m.regInconsistent.Inc()
		s.log.Warn("registration refused: allocation policy or DSpark layout", "remote", c.RealIP(), "err", err)
		return text(c, http.StatusBadRequest, err.Error())
	}
	if err != nil {
		s.m.regConflict.Inc()
		s.log.Warn("registration conflicts with topology", "remote", c.RealIP(), "err", err)
		return text(c, http.StatusConflict, err.Error())
	}
	if replaced {
		s.m.regReplaced.Inc()
	} else {
		s.m.regOK.Inc()
	}
	return text(c, http.StatusOK, "OK")
}

// superseded reports whether a registration `nu` must be refused because
// the entry `cur` names another instance with a higher epoch (its
// successor). Registrations without an instance id (SGLang's) replace
// unconditionally, as in SGLang.
func superseded(cur, nu bootstrap.PrefillRankInfo) bool {
	return cur.InstanceID != "" && nu.InstanceID != "" && cur.InstanceID != nu.InstanceID && cur.Epoch > nu.Epoch
}

func newTopology(r bootstrap.RegisterRequest) *topology {
	t := &topology{
		tpSize: r.AttnTPSize, cpSize: r.AttnCPSize, dpSize: r.DPSize(), ppSize: r.PPSize,
		pageSize: r.PageSize, kvCacheDtype: r.KVCacheDtype, follow: r.FollowBootstrapRoom(),
		dsaSplit: r.EnableDSACacheLayerSplit, httpPort: r.PrefillHTTPPort,
		policy: r.AllocationPolicy(), layout: r.DSV41SpecLayout,
	}
	t.total = t.tpSize * t.cpSize * t.dpSize * t.ppSize
	return t
}

func strOrNull(p *string) string {
	if p == nil {
		return "null"
	}
	return strconv.Quote(*p)
}

// conflict names the first topology field on which a and b differ.
func (a *topology) conflict(b *topology) string {
	type f struct {
		name   string
		av, bv string
	}
	for _, x := range []f{
		{"dp_size (attn_dp_size or system_dp_size)", strconv.Itoa(a.dpSize), strconv.Itoa(b.dpSize)},
		{"attn_cp_size", strconv.Itoa(a.cpSize), strconv.Itoa(b.cpSize)},
		{"attn_tp_size", strconv.Itoa(a.tpSize), strconv.Itoa(b.tpSize)},
		{"pp_size", strconv.Itoa(a.ppSize), strconv.Itoa(b.ppSize)},
		{"page_size", strconv.Itoa(a.pageSize), strconv.Itoa(b.pageSize)},
		{"kv_cache_dtype", strOrNull(a.kvCacheDtype), strOrNull(b.kvCacheDtype)},
		{"load_balance_method (follow_bootstrap_room)", strconv.FormatBool(a.follow), strconv.FormatBool(b.follow)},
		{"enable_dsa_cache_layer_split", strconv.FormatBool(a.dsaSplit), strconv.FormatBool(b.dsaSplit)},
	} {
		if x.av != x.bv {
			return fmt.Sprintf("%s: registration says %s, table says %s", x.name, x.bv, x.av)
		}
	}
	return ""
}

// layoutText shows a canonical layout in an error message (at most 200
// bytes).
func layoutText(l json.RawMessage) string {
	if l == nil {
		return "null"
	}
	if len(l) > 200 {
		return string(l[:200]) + "…"
	}
	return string(l)
}

// inconsistent names how b's decode allocation policy or DSpark layout
// disagrees with a's, the table's (newest SGLang's two 400 answers), or "".
func (a *topology) inconsistent(b *topology, n int) string {
	if !bytes.Equal(a.layout, b.layout) {
		return fmt.Sprintf("dsv41_spec_layout differs from that of the %d registered rank(s) in %s: registration says %s, the table says %s "+
			"(SGLang: \"DeepSeek-V4.1 DSpark PD layout differs across prefill ranks\"); every prefill rank must run the same DSpark configuration",
			n, strings.Join(bootstrap.DiffSpecLayouts(a.layout, b.layout), ", "), layoutText(b.layout), layoutText(a.layout))
	}
	if a.policy != b.policy {
		return fmt.Sprintf("decode_allocation_policy: registration says %q, the %d registered rank(s) say %q (SGLang: \"Inconsistent prefill allocation policies\"); "+
			"give every prefill rank the same --disaggregation-decode-allocation-policy (kvxfer prefill --decode-allocation-policy)", b.policy, n, a.policy)
	}
	return ""
}

// compatRefusal says why the server's key set cannot carry t's policy or
// layout to decodes, or "".
func (s *Server) compatRefusal(t *topology) string {
	if s.opts.Compat != bootstrap.CompatSGLang0094505 {
		return ""
	}
	what := ""
	switch {
	case t.policy != bootstrap.PolicyEarly:
		what = fmt.Sprintf("decode_allocation_policy %q", t.policy)
	case t.layout != nil:
		what = "a dsv41_spec_layout"
	default:
		return ""
	}
	return fmt.Sprintf("this directory answers SGLang 0094505's PrefillServerInfo key set (--compat %s), which cannot carry %s to decodes; "+
		"run the directory with --compat %s (decodes must then be SGLang versions that know the key), or register the ranks with the defaults",
		bootstrap.CompatSGLang0094505, what, bootstrap.CompatSGLangNewest)
}

// apply validates r against the table and stores it. A re-registration of
// the same coordinates replaces the endpoint (a restarted rank with a new
// port) and does not change the count. A rank that is alone in the table may
// change the topology (the whole instance restarted with a new config).
func (s *Server) apply(r bootstrap.RegisterRequest) (replaced bool, err error) {
	nt := newTopology(r)
	coord := bootstrap.Coord{DP: r.DPRank(), CP: r.AttnCPRank, TP: r.AttnTPRank, PP: r.PPRank}
	info := bootstrap.PrefillRankInfo{RankIP: r.RankIP, RankPort: r.RankPort, InstanceID: r.InstanceID, Epoch: r.Epoch}
	js, err := json.Marshal(info)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old, exists := s.table[coord]
	if exists && superseded(old.info, info) {
		return false, fmt.Errorf("%w: rank %s is registered by instance %s (epoch %d) at %s, newer than this instance %s (epoch %d): this rank was replaced; stop it rather than take the coordinates back",
			bootstrap.ErrReplaced, coord, old.info.InstanceID, old.info.Epoch, old.info.Endpoint(), info.InstanceID, info.Epoch)
	}
	if msg := s.compatRefusal(nt); msg != "" {
		return false, fmt.Errorf("%w: rank %s: %s", bootstrap.ErrBadRequest, coord, msg)
	}
	alone := exists && len(s.table) == 1 // the whole instance restarted with a new config
	if s.topo != nil && len(s.table) > 0 && !alone {
		if msg := s.topo.inconsistent(nt, len(s.table)); msg != "" {
			return false, fmt.Errorf("%w: rank %s: %s", bootstrap.ErrBadRequest, coord, msg)
		}
	}
	if s.topo != nil {
		if msg := s.topo.conflict(nt); msg != "" {
			if !alone {
				return false, fmt.Errorf("%w: rank %s: %s (%d ranks registered with the table's topology; deregister them with DELETE /route or restart the bootstrap server)",
					bootstrap.ErrConflict, coord, msg, len(s.table))
			}
		} else if s.topo.httpPort != nil {
			nt.httpPort = s.topo.httpPort // first writer wins, as SGLang
		}
	}
	now := time.Now()
	ent := old
	if exists {
		old.info, old.json, old.registeredAt = info, js, now
		old.updates++
		s.log.Info("rank re-registered", "rank", coord.String(), "endpoint", info.Endpoint())
	} else {
		ent = &rankEntry{info: info, json: js, registeredAt: now}
		s.table[coord] = ent
		s.log.Info("rank registered", "rank", coord.String(), "endpoint", info.Endpoint(),
			"registered", len(s.table), "expected", nt.total)
	}
	ent.hb = time.Duration(r.HeartbeatMS) * time.Millisecond
	ent.lastSeen.Store(now.UnixNano())
	if ent.staleLogged.Swap(false) {
		s.log.Info("stale prefill rank registered again", "rank", coord.String(), "endpoint", info.Endpoint(), "instance", info.InstanceID)
	}
	if s.topo == nil || s.topo.dpSize != nt.dpSize {
		s.dropRoomsOutOfRangeLocked(nt.dpSize)
	}
	s.topo = nt
	s.rebuildInfoLocked()
	return exists, nil
}

// dropRoomsOutOfRangeLocked deletes the room→dp-rank entries whose dp_rank
// is not below dpSize: they were registered before the topology was known
// (accepted, as SGLang does) or under an earlier one, and name a DP rank
// that does not exist. Each drop is counted in
// kvxfer_bootstrap_dp_rank_requests_total{op="rooms_dropped"} and the total
// logged. The caller holds s.mu (write); s.roomMu is taken here (lock order
// s.mu, then s.roomMu).
func (s *Server) dropRoomsOutOfRangeLocked(dpSize int) {
	s.roomMu.Lock()
	dropped := 0
	for r, e := range s.rooms {
		if e.dp >= dpSize {
			delete(s.rooms, r)
			dropped++
		}
	}
	n := len(s.rooms)
	s.roomMu.Unlock()
	if dropped > 0 {
		s.m.dpDropped.Add(float64(dropped))
		s.m.roomsSize.Set(float64(n))
		s.log.Warn("dropped room→dp-rank entries with a dp_rank outside the registered topology",
			"dropped", dropped, "dp_size", dpSize, "remaining", n)
	}
}

// rebuildInfoLocked re-encodes the topology answer and updates the gauges.
func (s *Server) rebuildInfoLocked() {
	s.m.tableSize.Set(float64(len(s.table)))
	if s.topo == nil {
		s.infoJSON = nil
		s.m.expected.Set(0)
		return
	}
	s.m.expected.Set(float64(s.topo.total))
	info := s.topo.serverInfo(s.opts.Compat)
	b, err := json.Marshal(info)
	if err != nil { // cannot happen: plain types only
		s.log.Error("encode bootstrap.PrefillServerInfo", "err", err)
	}
	s.infoJSON = b
}

func (t *topology) serverInfo(compat string) bootstrap.PrefillServerInfo {
	ps := t.pageSize
	info := bootstrap.PrefillServerInfo{
		AttnTPSize: t.tpSize, AttnCPSize: t.cpSize, DPSize: t.dpSize, PPSize: t.ppSize,
		PageSize: &ps, KVCacheDtype: t.kvCacheDtype, FollowBootstrapRoom: t.follow,
		EnableDSACacheLayerSplit: t.dsaSplit, PrefillHTTPPort: t.httpPort,
	}
	if compat == bootstrap.CompatSGLangNewest {
		p := t.policy
		info.DecodeAllocationPolicy = &p
		info.DSV41SpecLayout = t.layout // omitted when nil, as SGLang pops a null one
	}
	return info
}

// readyLocked reports whether every distinct rank has registered.
func (s *Server) readyLocked() bool { return s.topo != nil && len(s.table) == s.topo.total }

// tableRank is e's TableRank at now (stale or not).
func tableRank(c bootstrap.Coord, e *rankEntry, now time.Time) bootstrap.TableRank {
	tr := bootstrap.TableRank{Coord: c, PrefillRankInfo: e.info, RegisteredAt: e.registeredAt, Reregistrations: e.updates,
		HeartbeatMS: int(e.hb / time.Millisecond)}
	if _, stale := e.silentFor(now); stale {
		at := time.Unix(0, e.lastSeen.Load())
		tr.Stale, tr.SilentSince = true, &at
	}
	return tr
}

// Snapshot returns the current directory (what GET /v1/table serves).
func (s *Server) Snapshot() bootstrap.TableSnapshot {
	now := time.Now()
	s.mu.RLock()
	snap := bootstrap.TableSnapshot{
		Compat: s.opts.Compat, Registered: len(s.table),
		EntryTTLSeconds: s.opts.EntryTTL.Seconds(), DistInitAddr: s.opts.DistInitAddr,
		Ranks: make([]bootstrap.TableRank, 0, len(s.table)), Missing: []bootstrap.Coord{},
	}
	for c, e := range s.table {
		tr := tableRank(c, e, now)
		if tr.Stale {
			snap.Stale++
		}
		snap.Ranks = append(snap.Ranks, tr)
	}
	snap.Ready = s.readyLocked() && snap.Stale == 0
	if s.topo != nil {
		snap.Expected = s.topo.total
		info := s.topo.serverInfo(s.opts.Compat)
		snap.Topology = &info
		t := s.topo
	outer:
		for dp := 0; dp < t.dpSize; dp++ {
			for cp := 0; cp < t.cpSize; cp++ {
				for tp := 0; tp < t.tpSize; tp++ {
					for pp := 0; pp < t.ppSize; pp++ {
						c := bootstrap.Coord{DP: dp, CP: cp, TP: tp, PP: pp}
						if _, ok := s.table[c]; !ok {
							snap.Missing = append(snap.Missing, c)
							if len(snap.Missing) >= 1024 {
								break outer
							}
						}
					}
				}
			}
		}
	}
	s.mu.RUnlock()
	s.roomMu.Lock()
	snap.DPRooms = len(s.rooms)
	s.roomMu.Unlock()
	slices.SortFunc(snap.Ranks, func(a, b bootstrap.TableRank) int {
		for _, d := range [4]int{a.DP - b.DP, a.CP - b.CP, a.TP - b.TP, a.PP - b.PP} {
			if d != 0 {
				return d
			}
		}
		return 0
	})
	return snap
}

// staleCount returns the number of stale ranks at now.
func (s *Server) staleCount(now time.Time) int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for _, e := range s.table {
		if _, stale := e.silentFor(now); stale {
			n++
		}
	}
	return n
}

// livenessEvery is how often Start's liveness sweep looks for ranks that
// went stale (to log each once; the table computes staleness itself).
const livenessEvery = 500 * time.Millisecond

// watchLiveness logs every rank that goes stale, once, until done closes; its
// recovery is logged by the check-in or registration that ends it.
func (s *Server) watchLiveness(done <-chan struct{}) {
	t := time.NewTicker(livenessEvery)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case now := <-t.C:
			s.logStale(now)
		}
	}
}

func (s *Server) logStale(now time.Time) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for c, e := range s.table {
		silent, stale := e.silentFor(now)
		if stale && !e.staleLogged.Swap(true) {
			s.log.Warn("prefill rank silent beyond its heartbeat bound: dead, hung or cut off from the directory; GET /v1/table reports it stale (GET /route still answers it)",
				"rank", c.String(), "endpoint", e.info.Endpoint(), "instance", e.info.InstanceID,
				"silent", silent.Round(time.Millisecond), "heartbeat", e.hb, "bound", bootstrap.StaleAfter(e.hb))
		}
	}
}
