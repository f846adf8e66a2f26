package metadata

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/transport"
)

func TestParseURL(t *testing.T) {
	for _, c := range []struct {
		in   string
		want URL
		err  string
	}{
		{in: "etcd://127.0.0.1:2379", want: URL{Endpoints: []string{"127.0.0.1:2379"}, Prefix: "/kvxfer"}},
		{in: "etcd://a:1,b:2,[::1]:3/fleet/x/", want: URL{Endpoints: []string{"a:1", "b:2", "[::1]:3"}, Prefix: "/fleet/x"}},
		{in: " etcd://h:2379/p ", want: URL{Endpoints: []string{"h:2379"}, Prefix: "/p"}},
		{in: "http://h:2379", err: `scheme "http"`},
		{in: "redis://h:6379", err: `scheme "redis"`},
		{in: "P2PHANDSHAKE", err: "P2P needs no metadata server"},
		{in: "etcd://", err: "no etcd endpoint"},
		{in: "etcd:///p", err: "no etcd endpoint"},
		{in: "etcd://h", err: "not host:port"},
		{in: "etcd://h:0", err: "port 1..65535"},
		{in: "etcd://h:99999", err: "port 1..65535"},
		{in: "etcd://h:1,", err: "not host:port"},
		{in: "etcd://h:1/a//b", err: "empty path segment"},
	} {
		u, err := ParseURL(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("ParseURL(%q) err = %v, want it to mention %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(u, c.want) {
			t.Errorf("ParseURL(%q) = %+v, %v; want %+v", c.in, u, err, c.want)
		}
		if again, err := ParseURL(u.String()); err != nil || !reflect.DeepEqual(again, u) {
			t.Errorf("String() %q does not parse back: %+v %v", u.String(), again, err)
		}
	}
	for _, p := range []string{"", "P2PHANDSHAKE", "p2p"} {
		if !IsP2P(p) {
			t.Errorf("IsP2P(%q) = false", p)
		}
	}
	if IsP2P("etcd://h:1") {
		t.Error("IsP2P(etcd://…) = true")
	}
}

func TestBuildFleetReport(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	page := 16
	rec := InstanceRecord{Addr: "10.0.0.1:8998", Host: "h", PID: 1, Updated: now.Add(-2 * time.Second), HeartbeatSeconds: 10,
		Table: bootstrap.TableSnapshot{Ready: false, Registered: 3, Expected: 4,
			Topology: &bootstrap.PrefillServerInfo{AttnTPSize: 4, AttnCPSize: 1, DPSize: 1, PPSize: 1, PageSize: &page},
			Missing:  []bootstrap.Coord{{TP: 3}},
			Ranks: []bootstrap.TableRank{
				{Coord: bootstrap.Coord{TP: 0}, PrefillRankInfo: bootstrap.PrefillRankInfo{RankIP: "10.0.0.1", RankPort: 100, Epoch: 5}},
				{Coord: bootstrap.Coord{TP: 1}, PrefillRankInfo: bootstrap.PrefillRankInfo{RankIP: "10.0.0.1", RankPort: 101, Epoch: 6}},
				{Coord: bootstrap.Coord{TP: 2}, PrefillRankInfo: bootstrap.PrefillRankInfo{RankIP: "10.0.0.1", RankPort: 102}},
			}}}
	old := rec
	old.Addr, old.Updated, old.Table = "10.0.0.2:8998", now.Add(-time.Minute), bootstrap.TableSnapshot{Ready: true}
	segs := []transport.SegmentDescriptor{
		{Name: "10.0.0.1:100", Epoch: 5, Kind: "prefill"},
		{Name: "10.0.0.1:101", Epoch: 9, Kind: "prefill"}, // restarted
		{Name: "10.0.0.9:7", Epoch: 1, Kind: "decode"},
		{Name: "e", Epoch: 1, Kind: "engine"},
	}
	rep := BuildFleetReport("etcd://x:1/kvxfer", []InstanceRecord{rec, old}, segs, 1, now)
	if len(rep.Instances) != 2 || rep.Segments["prefill"] != 2 || rep.Segments["decode"] != 1 || rep.BadRecords != 1 {
		t.Fatalf("report %+v", rep)
	}
	got := []string{}
	for _, r := range rep.Instances[0].Ranks {
		got = append(got, r.Segment)
	}
	if want := []string{"live", "restarted", "absent"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("rank segments %v, want %v", got, want)
	}
	if len(rep.Instances[0].Stale) != 2 || len(rep.Instances[1].Stale) != 1 || rep.Stale != 3 {
		t.Fatalf("stale findings: %v / %v (total %d)", rep.Instances[0].Stale, rep.Instances[1].Stale, rep.Stale)
	}
	txt := FormatFleet(rep)
	for _, want := range []string{"NOT READY", "3/4 ranks", "missing ranks: dp_rank=0", "segment restarted", "STALE: record not rewritten", "2 prefill", "1 engine"} {
		if !strings.Contains(txt, want) {
			t.Errorf("text report lacks %q:\n%s", want, txt)
		}
	}

	// Issue 26 item 10: a directory whose every rank is registered and
	// published, but one rank went silent (killed; its lease not expired
	// yet), is not "ready" above its own STALE line.
	silent := now.Add(-9 * time.Second)
	dead := InstanceRecord{Addr: "10.0.0.3:8998", Host: "h", PID: 2, Updated: now, HeartbeatSeconds: 10,
		Table: bootstrap.TableSnapshot{Ready: true, Registered: 2, Expected: 2,
			Topology: &bootstrap.PrefillServerInfo{AttnTPSize: 2, AttnCPSize: 1, DPSize: 1, PPSize: 1},
			Ranks: []bootstrap.TableRank{
				{Coord: bootstrap.Coord{TP: 0}, PrefillRankInfo: bootstrap.PrefillRankInfo{RankIP: "10.0.0.3", RankPort: 100, Epoch: 5}, HeartbeatMS: 2000},
				{Coord: bootstrap.Coord{TP: 1}, PrefillRankInfo: bootstrap.PrefillRankInfo{RankIP: "10.0.0.3", RankPort: 101, Epoch: 6}, HeartbeatMS: 2000,
					Stale: true, SilentSince: &silent},
			}}}
	segs = []transport.SegmentDescriptor{{Name: "10.0.0.3:100", Epoch: 5, Kind: "prefill"}, {Name: "10.0.0.3:101", Epoch: 6, Kind: "prefill"}}
	rep = BuildFleetReport("etcd://x:1/kvxfer", []InstanceRecord{dead}, segs, 0, now)
	in := rep.Instances[0]
	if in.Ready || rep.Stale != 1 || in.Ranks[0].Heartbeat != "live" || in.Ranks[1].Heartbeat != "stale" || in.Ranks[1].Segment != "live" {
		t.Fatalf("instance with a silent rank: %+v (stale %d)", in, rep.Stale)
	}
	txt = FormatFleet(rep)
	for _, want := range []string{"NOT READY  2/2 ranks registered, 1 stale", "heartbeat stale", "STALE: rank dp_rank=0 cp_rank=0 tp_rank=1 pp_rank=0 at 10.0.0.3:101: the directory last heard from it at", "9.0 s ago", "checks in every 2s"} {
		if !strings.Contains(txt, want) {
			t.Errorf("text report lacks %q:\n%s", want, txt)
		}
	}
	if strings.Contains(txt, "  ready  ") {
		t.Errorf("text report says ready:\n%s", txt)
	}
}

func TestDecodeInstanceRecord(t *testing.T) {
	for _, in := range []string{"", "{", `{"v":2,"addr":"a"}`, `{"v":1,"addr":""}`, `{"v":1,"addr":"a","table":{"registered":-1}}`} {
		if _, err := DecodeInstanceRecord([]byte(in)); !errors.Is(err, ErrBadRecord) {
			t.Errorf("DecodeInstanceRecord(%q) err = %v, want ErrBadRecord", in, err)
		}
	}
	if _, err := DecodeInstanceRecord([]byte(`{"v":1,"addr":"a:1","table":{"ready":true}}`)); err != nil {
		t.Fatal(err)
	}
}

// FuzzDecodeInstanceRecord: records come from etcd (outside input).
func FuzzDecodeInstanceRecord(f *testing.F) {
	f.Add([]byte(`{"v":1,"addr":"a:1","table":{"ready":true,"ranks":[{"dp":0,"cp":0,"tp":0,"pp":0,"rank_ip":"h","rank_port":1}]}}`))
	f.Add([]byte(`{"v":1}`))
	f.Add([]byte(`{"v":1,"addr":"a:1","table":{"ready":false,"stale":1,"registered":1,"expected":1,"topology":{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"decode_allocation_policy":"prefill_complete","dsv41_spec_layout":{"block_size":1}},` +
		`"ranks":[{"dp":0,"cp":0,"tp":0,"pp":0,"rank_ip":"h","rank_port":1,"heartbeat_ms":2000,"stale":true,"silent_since":"2026-01-01T00:00:00Z"}]}}`))
	f.Add([]byte(`{"v":1,"addr":"a:1","table":{"stale":-1,"ranks":[{"heartbeat_ms":-5,"stale":true}]}}`))
	f.Add([]byte(`{"v":1,"addr":"a:1","table":{"ranks":[{"heartbeat_ms":9223372036854775807,"stale":true,"silent_since":"0001-01-01T00:00:00Z"}]}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeInstanceRecord(b)
		if err != nil {
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("error does not wrap ErrBadRecord: %v", err)
			}
			return
		}
		// Whatever decodes can be reported without panicking.
		_ = FormatFleet(BuildFleetReport("etcd://h:1", []InstanceRecord{r}, nil, 0, time.Now()))
	})
}
