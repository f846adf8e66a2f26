package hostaddr

import (
	"context"
	"errors"
	"net/netip"
	"strings"
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
		{"v4 default route", system{routes("192.168.7.9", "fd00::2"), func() []ifaceAddr { return eth }, nil}, "0.0.0.0", "192.168.7.9", "eth1", false},
		{"v6 default route", system{routes("192.168.7.9", "fd00::2"), func() []ifaceAddr { return eth }, nil}, "::", "fd00::2", "eth0", false},
		{"v6 bind, only a v4 route", system{routes("10.1.2.3", ""), func() []ifaceAddr { return eth }, nil}, "::", "10.1.2.3", "eth0", false},
		{"no default route: first non-loopback", system{routes("", ""), func() []ifaceAddr { return eth }, nil}, "0.0.0.0", "10.1.2.3", "eth0", false},
		{"no route, v6: first global v6 (never link-local)", system{routes("", ""), func() []ifaceAddr { return eth }, nil}, "[::]", "fd00::2", "eth0", false},
		{"route source is loopback: ignored", system{routes("127.0.0.1", ""), func() []ifaceAddr { return eth }, nil}, "0.0.0.0", "10.1.2.3", "eth0", false},
		{"down interface skipped", system{routes("", ""), func() []ifaceAddr {
			return []ifaceAddr{{iface: "eth9", addr: a("10.9.9.9")}, {iface: "lo", up: true, loop: true, addr: a("127.0.0.1")}}
		}, nil}, "0.0.0.0", "127.0.0.1", "lo", true},
		{"only loopback", system{routes("", ""), func() []ifaceAddr { return eth[:2] }, nil}, "0.0.0.0", "127.0.0.1", "lo", true},
		{"only loopback, v6", system{routes("", ""), func() []ifaceAddr { return eth[:3] }, nil}, "::", "::1", "lo", true},
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

func TestResolveLocal(t *testing.T) {
	a := netip.MustParseAddr
	sys := system{
		addrs: func() []ifaceAddr {
			return []ifaceAddr{{iface: "lo", loop: true, addr: a("127.0.0.1")}, {iface: "eth0", addr: a("10.1.2.3")}, {iface: "eth0", addr: a("fd00::2")}}
		},
		lookup: func(_ context.Context, name string) ([]netip.Addr, error) {
			switch name {
			case "localhost":
				return []netip.Addr{a("::1"), a("127.0.0.1")}, nil
			case "debian":
				return []netip.Addr{a("127.0.1.1")}, nil
			case "node1":
				return []netip.Addr{a("fd00::2"), a("192.0.2.7"), a("10.1.2.3")}, nil
			case "v6only":
				return []netip.Addr{a("fd00::2")}, nil
			case "elsewhere":
				return []netip.Addr{a("192.0.2.7"), a("2001:db8::1")}, nil
			}
			return nil, errors.New("no such host")
		},
	}
	for _, tc := range []struct{ in, want, err string }{
		{in: "", want: ""},
		{in: "127.0.0.1", want: "127.0.0.1"},
		{in: "[::1]", want: "::1"},
		{in: "0.0.0.0", want: "0.0.0.0"},
		{in: "localhost", want: "127.0.0.1"}, // IPv4 first
		{in: "debian", want: "127.0.1.1"},    // Debian's /etc/hosts entry for its own name
		{in: "node1", want: "10.1.2.3"},      // the local one, IPv4 first
		{in: "v6only", want: "fd00::2"},
		{in: "elsewhere", err: "192.0.2.7, 2001:db8::1, none of which is an address of this machine"},
		{in: "nosuch", err: "does not resolve"},
	} {
		got, err := sys.resolveLocal(context.Background(), tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %q, %v; want an error with %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	// The real resolver: "localhost" is loopback on every machine.
	got, err := ResolveLocal(context.Background(), "localhost")
	if err != nil || !netip.MustParseAddr(got).IsLoopback() {
		t.Fatalf("ResolveLocal(localhost) = %q, %v", got, err)
	}
}
