// Package hostaddr picks the address a listener bound to a wildcard host
// (0.0.0.0 or ::) advertises to its peers: the address of the interface
// that holds the default route, else the first non-loopback address, and
// loopback only when the host has nothing else (issue 13: a prefill bound to
// 0.0.0.0 used to register rank_ip 127.0.0.1, which no decode on another
// host can reach). ResolveLocal turns a host name ("localhost", this
// machine's name) into the address of this machine a listener binds.
package hostaddr

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
)

// IsWildcard reports whether host binds every interface: "0.0.0.0", "::"
// or "[::]" (and their other spellings, e.g. "0:0::0").
func IsWildcard(host string) bool {
	h := strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	a, err := netip.ParseAddr(h)
	return err == nil && a.Unmap().IsUnspecified()
}

// Choice is the address Pick chose and why.
type Choice struct {
	// Host is the IP address to advertise (IPv6 unbracketed).
	Host string
	// Iface is the interface holding it ("" when not known).
	Iface string
	// How says how it was chosen: "default route", "first non-loopback
	// address" or "loopback: no other address".
	How string
	// Loopback is true when only a loopback address was left: peers on
	// other hosts cannot reach it (callers warn).
	Loopback bool
}

// system is what Pick reads from the host; tests replace it.
type system struct {
	// routeSource returns the source address the kernel uses toward a
	// public destination of the network ("udp4" or "udp6"): the address on
	// the default route's interface.
	routeSource func(network string) (netip.Addr, bool)
	// addrs lists the interfaces' addresses in interface-index order.
	addrs func() []ifaceAddr
	// lookup resolves a host name (net.DefaultResolver.LookupNetIP).
	lookup func(ctx context.Context, name string) ([]netip.Addr, error)
}

type ifaceAddr struct {
	iface string
	up    bool
	loop  bool
	addr  netip.Addr
}

var host = system{routeSource: routeSource, addrs: interfaceAddrs, lookup: func(ctx context.Context, name string) ([]netip.Addr, error) {
	return net.DefaultResolver.LookupNetIP(ctx, "ip", name)
}}

// ResolveLocal returns the address a listener given the host name name
// binds: the first address name resolves to that belongs to this machine,
// IPv4 before IPv6 (loopback addresses belong to every machine: "localhost"
// is 127.0.0.1, Debian's own name 127.0.1.1). An IP address, a wildcard or
// "" is returned unchanged (brackets removed). Errors say what to change:
// a name that does not resolve, or one whose addresses (listed) are all
// another machine's. ZeroMQ and the transports bind addresses, not names
// (binding "localhost" fails with "no such device"), hence this step.
func ResolveLocal(ctx context.Context, name string) (string, error) {
	return host.resolveLocal(ctx, name)
}

func (s system) resolveLocal(ctx context.Context, name string) (string, error) {
	h := strings.TrimSuffix(strings.TrimPrefix(name, "["), "]")
	if h == "" {
		return "", nil
	}
	if a, err := netip.ParseAddr(h); err == nil {
		return a.String(), nil
	}
	ips, err := s.lookup(ctx, h)
	if err != nil {
		return "", fmt.Errorf("host name %q does not resolve (%v); use an IP address of this machine, or fix /etc/hosts or DNS", h, err)
	}
	mine := map[netip.Addr]bool{}
	for _, x := range s.addrs() {
		mine[x.addr] = true
	}
	var seen []string
	for _, want6 := range []bool{false, true} {
		for _, a := range ips {
			a = a.Unmap()
			if a.Is6() != want6 {
				continue
			}
			if a.IsLoopback() || mine[a] {
				return a.String(), nil
			}
			seen = append(seen, a.String())
		}
	}
	return "", fmt.Errorf("host name %q resolves to %s, none of which is an address of this machine; give this machine's own name or address (see `ip -brief addr`)", h, strings.Join(seen, ", "))
}

// Pick chooses the address to advertise for a listener bound to the wildcard
// bind: "0.0.0.0" looks at IPv4 addresses only, "::" at IPv6 first and then
// IPv4 (a dual-stack listener accepts both). Link-local addresses are never
// chosen (they need a zone peers do not know).
func Pick(bind string) Choice { return host.pick(bind) }

func (s system) pick(bind string) Choice {
	h := strings.TrimSuffix(strings.TrimPrefix(bind, "["), "]")
	families := []string{"udp4"}
	if a, err := netip.ParseAddr(h); err == nil && a.Is6() && !a.Is4In6() {
		families = []string{"udp6", "udp4"}
	}
	all := s.addrs()
	ifaceOf := func(a netip.Addr) string {
		for _, x := range all {
			if x.addr == a {
				return x.iface
			}
		}
		return ""
	}
	for _, fam := range families {
		if a, ok := s.routeSource(fam); ok && usable(a) {
			return Choice{Host: a.String(), Iface: ifaceOf(a), How: "default route"}
		}
	}
	for _, fam := range families {
		for _, x := range all {
			if x.up && !x.loop && usable(x.addr) && is6(fam) == x.addr.Is6() {
				return Choice{Host: x.addr.String(), Iface: x.iface, How: "first non-loopback address"}
			}
		}
	}
	lo := "127.0.0.1"
	if is6(families[0]) {
		lo = "::1"
	}
	return Choice{Host: lo, Iface: ifaceOf(netip.MustParseAddr(lo)), How: "loopback: no other address", Loopback: true}
}

func is6(network string) bool { return network == "udp6" }

// usable reports whether peers can be told to connect to a.
func usable(a netip.Addr) bool {
	return a.IsValid() && !a.IsUnspecified() && !a.IsLoopback() && !a.IsLinkLocalUnicast() && !a.IsMulticast()
}

// routeSource asks the kernel which source address it would use toward a
// public address (a UDP "connect" sends nothing): the address on the
// interface of the default route, policy routing included.
func routeSource(network string) (netip.Addr, bool) {
	dst := "8.8.8.8:53"
	if network == "udp6" {
		dst = "[2001:4860:4860::8888]:53"
	}
	c, err := net.Dial(network, dst)
	if err != nil {
		return netip.Addr{}, false // no route of this family
	}
	defer c.Close()
	ua, ok := c.LocalAddr().(*net.UDPAddr)
	if !ok {
		return netip.Addr{}, false
	}
	a, ok := netip.AddrFromSlice(ua.IP)
	return a.Unmap(), ok
}

func interfaceAddrs() []ifaceAddr {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil
	}
	var out []ifaceAddr
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			ipn, ok := a.(*net.IPNet)
			if !ok {
				continue
			}
			ip, ok := netip.AddrFromSlice(ipn.IP)
			if !ok {
				continue
			}
			out = append(out, ifaceAddr{iface: ifc.Name, up: ifc.Flags&net.FlagUp != 0, loop: ifc.Flags&net.FlagLoopback != 0, addr: ip.Unmap()})
		}
	}
	return out
}

// Advertise is the one advertise rule of every kvxfer listener (the KV
// manager's control socket, the TransferEngine's segment RPC listener):
// advertise if set, else a non-wildcard bindHost as is, else the address
// Pick chooses, logged (a warning when only loopback is left).
// what names the listener in the log line.
func Advertise(advertise, bindHost, what string, log *slog.Logger) string {
	if h := strings.Trim(advertise, "[]"); h != "" {
		return h
	}
	if !IsWildcard(bindHost) {
		return bindHost
	}
	c := Pick(bindHost)
	if c.Loopback {
		log.Warn(what+" bound to a wildcard advertises loopback: this host has no other address, so peers on other hosts cannot reach it (set the advertise host)",
			"bind", bindHost, "advertised", c.Host)
	} else {
		log.Info(what+" bound to a wildcard advertises the address chosen for it (set the advertise host to choose another)",
			"bind", bindHost, "advertised", c.Host, "interface", c.Iface, "how", c.How)
	}
	return c.Host
}
