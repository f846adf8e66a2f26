package rdma

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/Mellanox/rdmamap"
)

// ErrNoGID: no GID of a port fits (see SelectGID).
var ErrNoGID = errors.New("no usable GID")

// Option configures Discover (and the transport's device selection).
type Option func(*discoverConfig)

type discoverConfig struct {
	root    string
	devices []string
	addrs   func(netdev string) ([]net.IP, error)
}

// WithSysfsRoot reads sysfs from dir instead of "/sys" (tests point it at a
// fake tree built with internal/fakesys). With a non-default root the
// interface addresses are not checked against the host (see WithAddrLookup).
func WithSysfsRoot(dir string) Option { return func(c *discoverConfig) { c.root = dir } }

// WithDevices keeps only the named verbs devices (e.g. "mlx5_0", "rxe0").
func WithDevices(names ...string) Option {
	return func(c *discoverConfig) { c.devices = append(c.devices, names...) }
}

// WithAddrLookup sets how GID selection learns a netdev's own IP addresses
// (default with the real /sys: net.InterfaceByName(...).Addrs()). When set,
// a RoCE GID is chosen only if its address is one of the netdev's.
func WithAddrLookup(f func(netdev string) ([]net.IP, error)) Option {
	return func(c *discoverConfig) { c.addrs = f }
}

func newConfig(opts []Option) discoverConfig {
	c := discoverConfig{root: "/sys"}
	for _, o := range opts {
		o(&c)
	}
	if c.addrs == nil && c.root == "/sys" {
		c.addrs = hostAddrs
	}
	return c
}

// hostAddrs returns the IP addresses of a host interface.
func hostAddrs(netdev string) ([]net.IP, error) {
	ifi, err := net.InterfaceByName(netdev)
	if err != nil {
		return nil, err
	}
	as, err := ifi.Addrs()
	if err != nil {
		return nil, err
	}
	var ips []net.IP
	for _, a := range as {
		if n, ok := a.(*net.IPNet); ok {
			ips = append(ips, n.IP)
		}
	}
	return ips, nil
}

var pciAddrRE = regexp.MustCompile(`^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$`)

// Discover lists the RDMA devices under <sysfs>/class/infiniband with their
// PCI address, NUMA node, netdevs, ports and populated GID tables. With the
// real /sys the device list comes from Mellanox/rdmamap. A host without an
// RDMA stack (no class/infiniband) yields an empty list and nil error; an
// unreadable entry is an error naming the path.
func Discover(opts ...Option) ([]NIC, error) {
	c := newConfig(opts)
	return discover(c)
}

func discover(c discoverConfig) ([]NIC, error) {
	ibDir := filepath.Join(c.root, "class/infiniband")
	var names []string
	if c.root == "/sys" {
		names = rdmamap.GetRdmaDeviceList()
	} else {
		ents, err := os.ReadDir(ibDir)
		if err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("rdma: discover: %w", err)
		}
		for _, e := range ents {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	var out []NIC
	for _, name := range names {
		if len(c.devices) > 0 && !contains(c.devices, name) {
			continue
		}
		n, err := readNIC(c.root, name)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func readString(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func readNIC(root, name string) (NIC, error) {
	dir := filepath.Join(root, "class/infiniband", name)
	n := NIC{Name: name, NUMANode: -1}
	if target, err := filepath.EvalSymlinks(filepath.Join(dir, "device")); err == nil {
		if base := filepath.Base(target); pciAddrRE.MatchString(base) {
			n.PCIAddr = strings.ToLower(base)
		}
		if v, err := strconv.Atoi(readString(filepath.Join(target, "numa_node"))); err == nil {
			n.NUMANode = v
		}
		if ents, err := os.ReadDir(filepath.Join(target, "net")); err == nil {
			for _, e := range ents {
				n.NetDevs = appendUnique(n.NetDevs, e.Name())
			}
		}
	}
	ports, err := os.ReadDir(filepath.Join(dir, "ports"))
	if err != nil {
		return NIC{}, fmt.Errorf("rdma: discover %s: %w", name, err)
	}
	for _, pe := range ports {
		num, err := strconv.Atoi(pe.Name())
		if err != nil {
			continue
		}
		pdir := filepath.Join(dir, "ports", pe.Name())
		p := Port{Num: num, State: readString(filepath.Join(pdir, "state")), LinkLayer: readString(filepath.Join(pdir, "link_layer"))}
		gids, err := os.ReadDir(filepath.Join(pdir, "gids"))
		if err != nil {
			return NIC{}, fmt.Errorf("rdma: discover %s port %d: %w", name, num, err)
		}
		p.GIDTableLen = len(gids)
		for _, ge := range gids {
			idx, err := strconv.Atoi(ge.Name())
			if err != nil {
				continue
			}
			v := readString(filepath.Join(pdir, "gids", ge.Name()))
			ip := net.ParseIP(v)
			if ip == nil || ip.IsUnspecified() {
				continue
			}
			g := GID{Index: idx, Value: gidText(ip),
				Type:   readString(filepath.Join(pdir, "gid_attrs/types", ge.Name())),
				NetDev: readString(filepath.Join(pdir, "gid_attrs/ndevs", ge.Name()))}
			if g.NetDev != "" {
				n.NetDevs = appendUnique(n.NetDevs, g.NetDev)
			}
			p.GIDs = append(p.GIDs, g)
		}
		sort.Slice(p.GIDs, func(i, j int) bool { return p.GIDs[i].Index < p.GIDs[j].Index })
		n.Ports = append(n.Ports, p)
	}
	sort.Slice(n.Ports, func(i, j int) bool { return n.Ports[i].Num < n.Ports[j].Num })
	return n, nil
}

func gidText(ip net.IP) string {
	if v4 := ip.To4(); v4 != nil {
		return "::ffff:" + v4.String()
	}
	return ip.String()
}

func appendUnique(list []string, s string) []string {
	if contains(list, s) {
		return list
	}
	return append(list, s)
}

// Active reports whether the port's state is ACTIVE ("4: ACTIVE").
func (p Port) Active() bool { return strings.HasSuffix(p.State, "ACTIVE") }

// Port returns the port with number num.
func (n NIC) Port(num int) (Port, bool) {
	for _, p := range n.Ports {
		if p.Num == num {
			return p, true
		}
	}
	return Port{}, false
}

// SelectGID picks the GID a QP on port of nic uses as its source address.
//
//   - index >= 0 is an explicit override: it must be below the port's GID
//     table length and name a populated entry.
//   - On an Ethernet (RoCE) port it returns the lowest-index RoCE v2 GID whose
//     address is a routable IPv4 (as ::ffff:a.b.c.d) or IPv6 address of the
//     NIC's own netdev, IPv4 first; link-local (fe80::/10) GIDs are never
//     chosen, since they do not route between hosts. When addrs is non-nil the
//     address must be one of addrs(gid.NetDev).
//   - On an InfiniBand port it returns GID index 0 (the port GID; LIDs route).
//
// Errors wrap ErrNoGID and list what the port has.
func SelectGID(nic NIC, port int, index int, addrs func(netdev string) ([]net.IP, error)) (GID, error) {
	p, ok := nic.Port(port)
	if !ok {
		return GID{}, fmt.Errorf("rdma: %s has no port %d: %w", nic.Name, port, ErrNoGID)
	}
	if index >= 0 {
		if index >= p.GIDTableLen {
			return GID{}, fmt.Errorf("rdma: GID index %d out of range for %s port %d (table has %d entries, 0..%d): %w",
				index, nic.Name, port, p.GIDTableLen, p.GIDTableLen-1, ErrNoGID)
		}
		for _, g := range p.GIDs {
			if g.Index == index {
				return g, nil
			}
		}
		return GID{}, fmt.Errorf("rdma: GID index %d of %s port %d is empty: %w", index, nic.Name, port, ErrNoGID)
	}
	if p.LinkLayer == "InfiniBand" {
		for _, g := range p.GIDs {
			if g.Index == 0 {
				return g, nil
			}
		}
	}
	var best *GID
	bestRank := 99
	var seen []string
	for i := range p.GIDs {
		g := &p.GIDs[i]
		ip := net.ParseIP(g.Value)
		seen = append(seen, fmt.Sprintf("%d=%s(%s)", g.Index, g.Value, g.Type))
		if g.Type != "RoCE v2" || ip == nil || ip.IsLinkLocalUnicast() || ip.IsLoopback() || ip.IsUnspecified() || ip.IsMulticast() {
			continue
		}
		if addrs != nil && g.NetDev != "" {
			own, err := addrs(g.NetDev)
			if err != nil || !containsIP(own, ip) {
				continue
			}
		}
		rank := 1
		if ip.To4() != nil {
			rank = 0
		}
		if rank < bestRank {
			best, bestRank = g, rank
		}
	}
	if best == nil {
		return GID{}, fmt.Errorf("rdma: %s port %d has no RoCE v2 GID for a routable IPv4/IPv6 address of its netdev (GIDs: %s); "+
			"assign an address to %s or pass an explicit GID index: %w",
			nic.Name, port, strings.Join(seen, ", "), strings.Join(nic.NetDevs, "/"), ErrNoGID)
	}
	return *best, nil
}

func containsIP(list []net.IP, ip net.IP) bool {
	for _, x := range list {
		if x.Equal(ip) {
			return true
		}
	}
	return false
}
