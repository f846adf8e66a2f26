package rdma

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/fakesys"
)

func TestDiscoverFakeSysfs(t *testing.T) {
	fs := fakesys.New(t)
	fs.AddDevice(fakesys.Device{Name: "mlx5_1", PCIAddr: "0000:9a:00.0", NUMANode: 1, NetDevs: []string{"ens2"},
		Ports: []fakesys.Port{{Num: 1, GIDs: []fakesys.GID{
			{Index: 0, Value: "fe80::1", Type: "IB/RoCE v1", NetDev: "ens2"},
			{Index: 3, Value: "::ffff:10.1.0.2", Type: "RoCE v2", NetDev: "ens2"}}}}})
	fs.AddDevice(fakesys.Device{Name: "rxe0", NetDevs: []string{"dummy0"},
		Ports: []fakesys.Port{{Num: 1, TableLen: 4, GIDs: []fakesys.GID{{Index: 1, Value: "::ffff:10.11.12.1", Type: "RoCE v2", NetDev: "dummy0"}}}}})
	fs.AddDevice(fakesys.Device{Name: "mlx5_0", PCIAddr: "0000:17:00.0", NUMANode: 0, NetDevs: []string{"ens1"},
		Ports: []fakesys.Port{{Num: 1, State: "1: DOWN"}}})
	nics, err := Discover(WithSysfsRoot(fs.Root))
	if err != nil {
		t.Fatal(err)
	}
	if len(nics) != 3 || nics[0].Name != "mlx5_0" || nics[1].Name != "mlx5_1" || nics[2].Name != "rxe0" {
		t.Fatalf("nics = %+v", nics)
	}
	m1 := nics[1]
	if m1.PCIAddr != "0000:9a:00.0" || m1.NUMANode != 1 || len(m1.NetDevs) != 1 || m1.NetDevs[0] != "ens2" {
		t.Fatalf("mlx5_1 = %+v", m1)
	}
	p, ok := m1.Port(1)
	if !ok || !p.Active() || p.LinkLayer != "Ethernet" || p.GIDTableLen != 16 || len(p.GIDs) != 2 ||
		p.GIDs[1] != (GID{Index: 3, Value: "::ffff:10.1.0.2", Type: "RoCE v2", NetDev: "ens2"}) {
		t.Fatalf("mlx5_1 port 1 = %+v", p)
	}
	if nics[2].PCIAddr != "" || nics[2].NUMANode != -1 || nics[2].NetDevs[0] != "dummy0" {
		t.Fatalf("rxe0 = %+v", nics[2])
	}
	if p0, _ := nics[0].Port(1); p0.Active() {
		t.Fatal("DOWN port reported active")
	}
	only, err := Discover(WithSysfsRoot(fs.Root), WithDevices("rxe0"))
	if err != nil || len(only) != 1 || only[0].Name != "rxe0" {
		t.Fatalf("WithDevices = %+v, %v", only, err)
	}
	none, err := Discover(WithSysfsRoot(t.TempDir()))
	if err != nil || len(none) != 0 {
		t.Fatalf("empty sysfs = %+v, %v", none, err)
	}
}

func TestSelectGID(t *testing.T) {
	gids := func(g ...fakesys.GID) []fakesys.Port { return []fakesys.Port{{Num: 1, TableLen: 8, GIDs: g}} }
	ll := fakesys.GID{Index: 0, Value: "fe80::b8ce:f6ff:fe12:3456", Type: "RoCE v2", NetDev: "eth0"}
	llv1 := fakesys.GID{Index: 1, Value: "fe80::b8ce:f6ff:fe12:3456", Type: "IB/RoCE v1", NetDev: "eth0"}
	v4v1 := fakesys.GID{Index: 2, Value: "::ffff:192.168.1.5", Type: "IB/RoCE v1", NetDev: "eth0"}
	v4 := fakesys.GID{Index: 3, Value: "::ffff:192.168.1.5", Type: "RoCE v2", NetDev: "eth0"}
	v6 := fakesys.GID{Index: 5, Value: "2001:db8::5", Type: "RoCE v2", NetDev: "eth0"}
	foreign := fakesys.GID{Index: 6, Value: "::ffff:172.16.0.9", Type: "RoCE v2", NetDev: "eth0"}
	for _, tc := range []struct {
		name    string
		ports   []fakesys.Port
		ll      string
		index   int
		want    int // GID index, -1 = error
		errText string
	}{
		{name: "link-local only", ports: gids(ll, llv1), index: -1, want: -1, errText: "no RoCE v2 GID for a routable"},
		{name: "IPv4-mapped", ports: gids(ll, llv1, v4v1, v4), index: -1, want: 3},
		{name: "IPv6 only", ports: gids(ll, v6), index: -1, want: 5},
		{name: "IPv4 preferred over IPv6", ports: gids(ll, v4, v6), index: -1, want: 3},
		{name: "address not on netdev skipped", ports: gids(foreign, v6), index: -1, want: 5},
		{name: "override", ports: gids(ll, v4), index: 0, want: 0},
		{name: "override out of range", ports: gids(ll, v4), index: 8, want: -1, errText: "out of range for nic port 1 (table has 8 entries, 0..7)"},
		{name: "override empty", ports: gids(ll, v4), index: 7, want: -1, errText: "index 7 of nic port 1 is empty"},
		{name: "InfiniBand port", ports: []fakesys.Port{{Num: 1, LinkLayer: "InfiniBand", GIDs: []fakesys.GID{{Index: 0, Value: "fe80::2", Type: "IB/RoCE v1"}}}}, index: -1, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := fakesys.New(t)
			fs.AddDevice(fakesys.Device{Name: "nic", PCIAddr: "0000:01:00.0", NetDevs: []string{"eth0"}, Ports: tc.ports})
			fs.SetAddrs("eth0", "192.168.1.5", "2001:db8::5", "fe80::b8ce:f6ff:fe12:3456")
			nics, err := Discover(WithSysfsRoot(fs.Root))
			if err != nil || len(nics) != 1 {
				t.Fatalf("discover: %v %v", nics, err)
			}
			g, err := SelectGID(nics[0], 1, tc.index, fs.Addrs)
			if tc.want < 0 {
				if !errors.Is(err, ErrNoGID) || !strings.Contains(err.Error(), tc.errText) {
					t.Fatalf("err = %v; want ErrNoGID containing %q", err, tc.errText)
				}
				return
			}
			if err != nil || g.Index != tc.want {
				t.Fatalf("SelectGID = %+v, %v; want index %d", g, err, tc.want)
			}
		})
	}
}

func TestSelectGIDMultipleNICs(t *testing.T) {
	fs := fakesys.New(t)
	for i, ip := range []string{"10.0.0.1", "10.0.1.1"} {
		nd := []string{"ens1", "ens2"}[i]
		fs.AddDevice(fakesys.Device{Name: []string{"mlx5_0", "mlx5_1"}[i], PCIAddr: []string{"0000:17:00.0", "0000:9a:00.0"}[i],
			NUMANode: i, NetDevs: []string{nd}, Ports: []fakesys.Port{{Num: 1, GIDs: []fakesys.GID{
				{Index: 0, Value: "fe80::" + []string{"1", "2"}[i], Type: "RoCE v2", NetDev: nd},
				{Index: 3, Value: "::ffff:" + ip, Type: "RoCE v2", NetDev: nd}}}}})
		fs.SetAddrs(nd, ip)
	}
	nics, err := Discover(WithSysfsRoot(fs.Root))
	if err != nil || len(nics) != 2 {
		t.Fatal(nics, err)
	}
	for i, want := range []string{"::ffff:10.0.0.1", "::ffff:10.0.1.1"} {
		g, err := SelectGID(nics[i], 1, -1, fs.Addrs)
		if err != nil || g.Value != want || g.NetDev != nics[i].NetDevs[0] {
			t.Fatalf("%s: %+v, %v", nics[i].Name, g, err)
		}
	}
	if _, err := SelectGID(nics[0], 2, -1, nil); !errors.Is(err, ErrNoGID) {
		t.Fatalf("missing port: %v", err)
	}
}
