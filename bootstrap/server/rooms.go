package server

// The room → dp-rank registry (SGLang's /register_dp_rank and
// /query_dp_ranks) and its expiry.

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/labstack/echo/v4"
)

type roomEntry struct {
	dp int
	at time.Time
}

// handleRegisterDPRank serves POST /register_dp_rank: it records room →
// prefill DP rank. With a topology registered, a dp_rank ≥ dp_size is a 400.
// Before any rank has registered the entry is accepted, as SGLang accepts
// it (spec §2.2), but kept only while it fits: when the topology becomes
// known (or its dp_size changes) entries with dp_rank ≥ dp_size are dropped
// and counted (op="rooms_dropped"), and /query_dp_ranks never answers one.
func (s *Server) handleRegisterDPRank(c echo.Context) error {
	if !s.authorized(c) {
		return text(c, http.StatusUnauthorized, "Unauthorized")
	}
	body, err := s.readBody(c)
	if err != nil {
		return badRequest(c, err)
	}
	room, dp, err := bootstrap.ParseRegisterDPRank(body)
	if err != nil {
		return badRequest(c, err)
	}
	// The check and the insert happen under s.mu (read) so that a topology
	// registered meanwhile cannot miss this entry when it drops out-of-range
	// ones (apply holds s.mu for writing while it drops).
	s.mu.RLock()
	dpSize := 0
	if s.topo != nil {
		dpSize = s.topo.dpSize
	}
	if dpSize > 0 && dp >= dpSize {
		s.mu.RUnlock()
		return badRequest(c, bootstrap.NewFieldError("dp_rank", "%d must be < the registered dp_size %d", dp, dpSize))
	}
	s.roomMu.Lock()
	if _, ok := s.rooms[room]; !ok && len(s.rooms) >= s.opts.MaxRooms {
		n := len(s.rooms)
		s.roomMu.Unlock()
		s.mu.RUnlock()
		return text(c, http.StatusTooManyRequests, fmt.Sprintf(
			"room→dp-rank registry full (%d live entries, limit %d); entries expire after %s — retry later, or raise the limit / lower the TTL",
			n, s.opts.MaxRooms, s.opts.EntryTTL))
	}
	s.rooms[room] = roomEntry{dp: dp, at: time.Now()}
	n := len(s.rooms)
	s.roomMu.Unlock()
	s.mu.RUnlock()
	s.m.roomsSize.Set(float64(n))
	s.m.dpRegs.Inc()
	return text(c, http.StatusOK, "OK")
}

// handleQueryDPRanks serves POST /query_dp_ranks: a JSON object mapping
// each known, unexpired room (decimal string) to its DP rank; unknown rooms
// are omitted, as in SGLang. A dp_rank not below the registered dp_size is
// never answered.
func (s *Server) handleQueryDPRanks(c echo.Context) error {
	body, err := s.readBody(c)
	if err != nil {
		return badRequest(c, err)
	}
	rooms, err := bootstrap.ParseQueryDPRanks(body)
	if err != nil {
		return badRequest(c, err)
	}
	s.m.dpQueries.Inc()
	s.m.dpRooms.Add(float64(len(rooms)))
	out := make([]byte, 0, 16+len(rooms)*28)
	out = append(out, '{')
	seen := make(map[uint64]struct{}, len(rooms))
	cutoff := time.Now().Add(-s.opts.EntryTTL)
	// Belt and braces: never answer a dp_rank the topology does not have
	// (entries out of range are dropped when the topology becomes known).
	dpSize := math.MaxInt
	s.mu.RLock()
	if s.topo != nil {
		dpSize = s.topo.dpSize
	}
	s.mu.RUnlock()
	s.roomMu.Lock()
	for _, r := range rooms {
		e, ok := s.rooms[r]
		if !ok || e.at.Before(cutoff) || e.dp >= dpSize {
			continue
		}
		if _, dup := seen[r]; dup {
			continue
		}
		seen[r] = struct{}{}
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, '"')
		out = strconv.AppendUint(out, r, 10)
		out = append(out, '"', ':')
		out = strconv.AppendInt(out, int64(e.dp), 10)
	}
	s.roomMu.Unlock()
	out = append(out, '}')
	return c.Blob(http.StatusOK, ctJSON, out)
}

// sweepRooms deletes expired room entries every EntryTTL/2 until ctx ends.
func (s *Server) sweepRooms(ctx context.Context) {
	every := s.opts.EntryTTL / 2
	if every < 10*time.Millisecond {
		every = 10 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.expireRooms(now)
		}
	}
}

func (s *Server) expireRooms(now time.Time) {
	cutoff := now.Add(-s.opts.EntryTTL)
	s.roomMu.Lock()
	for r, e := range s.rooms {
		if e.at.Before(cutoff) {
			delete(s.rooms, r)
		}
	}
	n := len(s.rooms)
	s.roomMu.Unlock()
	s.m.roomsSize.Set(float64(n))
}
