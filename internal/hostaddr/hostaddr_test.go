package hostaddr

import (
	"net/netip"
	"testing"
)

func TestIsWildcard(t *testing.T) {
	for h, want := range map[string]bool{
		"0.0.0.0": true, "::": true, "[::]": true, "0:0::0": true, "::ffff:0.0.0.0": true,
		"": false, "127.0.0.1": false, "::1": false, "host": false, "[fd00::2]": false,
	} {
		if got := IsWildcard(h); got != want {
			t.Errorf("IsWildcard(%q) = %v, want %v", h, got, want)
		}
	}
}

func TestPick(t *testing.T) {
	a := netip.MustParseAddr
	eth := []ifaceAddr{
		{iface: "lo", up: true, loop: true, addr: a("127.0.0.1")},
		{iface: "lo", up: true, loop: true, addr: a("::1")},
		{iface: "eth0", up: true, addr: a("fe80::1")},
		{iface: "eth0", up: true, addr: a("10.1.2.3")},
		{iface: "eth0", up: true, addr: a("fd00::2")},
		{iface: "eth1", up: true, addr: a("192.168.7.9")},
	}
	routes := func(v4, v6 string) func(string) (netip.Addr, bool) {
		return func(n string) (netip.Addr, bool) {
			s := v4
			if n == "udp6" {
				s = v6
			}
			if s == "" {
				return netip.Addr{}, false
			}
			return a(s), true
		}
	}
	cases := []struct {
		name     string
		sys      system
		bind     string
		want     string
		iface    string
		loopback bool
	}{
		{"v4 default route", system{routes("192.168.7.9", "fd00::2"), func() []ifaceAddr { return eth }}, "0.0.0.0", "192.168.7.9", "eth1", false},
		{"v6 default route", system{routes("192.168.7.9", "fd00::2"), func() []ifaceAddr { return eth }}, "::", "fd00::2", "eth0", false},
		{"v6 bind, only a v4 route", system{routes("10.1.2.3", ""), func() []ifaceAddr { return eth }}, "::", "10.1.2.3", "eth0", false},
		{"no default route: first non-loopback", system{routes("", ""), func() []ifaceAddr { return eth }}, "0.0.0.0", "10.1.2.3", "eth0", false},
		{"no route, v6: first global v6 (never link-local)", system{routes("", ""), func() []ifaceAddr { return eth }}, "[::]", "fd00::2", "eth0", false},
		{"route source is loopback: ignored", system{routes("127.0.0.1", ""), func() []ifaceAddr { return eth }}, "0.0.0.0", "10.1.2.3", "eth0", false},
		{"down interface skipped", system{routes("", ""), func() []ifaceAddr {
			return []ifaceAddr{{iface: "eth9", addr: a("10.9.9.9")}, {iface: "lo", up: true, loop: true, addr: a("127.0.0.1")}}
		}}, "0.0.0.0", "127.0.0.1", "lo", true},
		{"only loopback", system{routes("", ""), func() []ifaceAddr { return eth[:2] }}, "0.0.0.0", "127.0.0.1", "lo", true},
		{"only loopback, v6", system{routes("", ""), func() []ifaceAddr { return eth[:3] }}, "::", "::1", "lo", true},
	}
	for _, tc := range cases {
		c := tc.sys.pick(tc.bind)
		if c.Host != tc.want || c.Iface != tc.iface || c.Loopback != tc.loopback || c.How == "" {
			t.Errorf("%s: pick(%q) = %+v, want host %s on %s (loopback %v)", tc.name, tc.bind, c, tc.want, tc.iface, tc.loopback)
		}
	}
}

// TestPickHere: on this host, a choice is made and it is loopback only when
// the host has no other usable address.
func TestPickHere(t *testing.T) {
	c := Pick("0.0.0.0")
	other := false
	for _, x := range interfaceAddrs() {
		if x.up && !x.loop && usable(x.addr) && x.addr.Is4() {
			other = true
		}
	}
	if c.Loopback == other {
		t.Fatalf("Pick(0.0.0.0) = %+v, but a non-loopback IPv4 address exists: %v", c, other)
	}
	t.Logf("Pick(0.0.0.0) = %+v; Pick(::) = %+v", c, Pick("::"))
}
