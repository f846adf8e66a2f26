package server

// The rank table: registrations, the topology they must agree on, and the
// PrefillServerInfo answer built from them.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
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
}

type rankEntry struct {
	info         bootstrap.PrefillRankInfo
	json         []byte
	registeredAt time.Time
	updates      int
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
	if s.topo != nil {
		if msg := s.topo.conflict(nt); msg != "" {
			if !(exists && len(s.table) == 1) {
				return false, fmt.Errorf("%w: rank %s: %s (%d ranks registered with the table's topology; deregister them with DELETE /route or restart the bootstrap server)",
					bootstrap.ErrConflict, coord, msg, len(s.table))
			}
		} else if s.topo.httpPort != nil {
			nt.httpPort = s.topo.httpPort // first writer wins, as SGLang
		}
	}
	if exists {
		old.info, old.json, old.registeredAt = info, js, time.Now()
		old.updates++
		s.log.Info("rank re-registered", "rank", coord.String(), "endpoint", info.Endpoint())
	} else {
		s.table[coord] = &rankEntry{info: info, json: js, registeredAt: time.Now()}
		s.log.Info("rank registered", "rank", coord.String(), "endpoint", info.Endpoint(),
			"registered", len(s.table), "expected", nt.total)
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
		early := "early"
		info.DecodeAllocationPolicy = &early
	}
	return info
}

// readyLocked reports whether every distinct rank has registered.
func (s *Server) readyLocked() bool { return s.topo != nil && len(s.table) == s.topo.total }

// Snapshot returns the current directory (what GET /v1/table serves).
func (s *Server) Snapshot() bootstrap.TableSnapshot {
	s.mu.RLock()
	snap := bootstrap.TableSnapshot{
		Compat: s.opts.Compat, Ready: s.readyLocked(), Registered: len(s.table),
		EntryTTLSeconds: s.opts.EntryTTL.Seconds(), DistInitAddr: s.opts.DistInitAddr,
		Ranks: make([]bootstrap.TableRank, 0, len(s.table)), Missing: []bootstrap.Coord{},
	}
	for c, e := range s.table {
		snap.Ranks = append(snap.Ranks, bootstrap.TableRank{Coord: c, PrefillRankInfo: e.info, RegisteredAt: e.registeredAt, Reregistrations: e.updates})
	}
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
