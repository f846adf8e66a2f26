package metadata

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
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
	segs := []engine.SegmentDescriptor{
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
