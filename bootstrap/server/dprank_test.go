package server

import (
	"strings"
	"testing"
	"time"
)

// TestDPRankBeforeTopology: a room registered before any rank (accepted, as
// SGLang does) with a dp_rank the topology then lacks is dropped when the
// topology becomes known and never answered; in-range early rooms survive.
func TestDPRankBeforeTopology(t *testing.T) {
	s, c := startServer(t, Options{EntryTTL: time.Hour})
	ctx := ctxT(t)
	base := "http://" + s.Addr()
	for _, b := range []string{`{"bootstrap_room":5,"dp_rank":3}`, `{"bootstrap_room":6,"dp_rank":1}`, `{"bootstrap_room":7,"dp_rank":2}`} {
		if code, _, msg := raw(t, "POST", base+"/register_dp_rank", b); code != 200 || msg != "OK" {
			t.Fatalf("register_dp_rank %s before topology: %d %q, want 200 OK", b, code, msg)
		}
	}
	if code, _, msg := raw(t, "POST", base+"/query_dp_ranks", `{"bootstrap_rooms":[5,6,7]}`); code != 200 || msg != `{"5":3,"6":1,"7":2}` {
		t.Fatalf("query before topology: %d %q", code, msg)
	}
	r := reg(1, 0, 6000)
	r.AttnDPSize = 2
	r.LoadBalanceMethod = "round_robin"
	for dp := range 2 {
		r.AttnDPRank = dp
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if code, _, msg := raw(t, "POST", base+"/query_dp_ranks", `{"bootstrap_rooms":[5,6,7]}`); code != 200 || msg != `{"6":1}` {
		t.Fatalf("query after dp_size 2 registered: %d %q, want {\"6\":1}", code, msg)
	}
	if snap := s.Snapshot(); snap.DPRooms != 1 {
		t.Fatalf("%d rooms kept, want 1 (out-of-range ones dropped)", snap.DPRooms)
	}
	if _, _, m := raw(t, "GET", base+"/metrics", ""); !strings.Contains(m, `kvxfer_bootstrap_dp_rank_requests_total{op="rooms_dropped"} 2`) {
		t.Fatalf("metrics lack rooms_dropped 2:\n%s", grepLines(m, "dp_rank_requests"))
	}
	// Now the topology is known: an out-of-range rank is refused outright.
	if code, _, msg := raw(t, "POST", base+"/register_dp_rank", `{"bootstrap_room":8,"dp_rank":2}`); code != 400 || !strings.Contains(msg, "dp_rank") {
		t.Fatalf("register_dp_rank out of range: %d %q", code, msg)
	}
}

// TestDPRankQueryFiltersOutOfRange: an entry that is out of range of the
// table's dp_size (put in behind the handler's back) is never answered.
func TestDPRankQueryFiltersOutOfRange(t *testing.T) {
	s, c := startServer(t, Options{EntryTTL: time.Hour})
	ctx := ctxT(t)
	r := reg(1, 0, 6000)
	r.AttnDPSize = 2
	r.LoadBalanceMethod = "round_robin"
	if err := c.Register(ctx, r); err != nil {
		t.Fatal(err)
	}
	s.roomMu.Lock()
	s.rooms[9] = roomEntry{dp: 5, at: time.Now()}
	s.rooms[10] = roomEntry{dp: 1, at: time.Now()}
	s.roomMu.Unlock()
	got, err := c.QueryDPRanks(ctx, []uint64{9, 10})
	if err != nil || len(got) != 1 || got[10] != 1 {
		t.Fatalf("query: %v %v, want only room 10 → 1", got, err)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
