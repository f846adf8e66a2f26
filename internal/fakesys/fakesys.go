// Package fakesys builds a fake sysfs tree under a test's temp dir for RDMA
// and topology tests: class/infiniband/<dev>/ports/<n>/{state,link_layer,
// gids/<i>,gid_attrs/types/<i>,gid_attrs/ndevs/<i>}, class/net/<netdev>, and
// PCI devices under devices/pci0000:00/<addr> with numa_node, linked from
// class/infiniband/<dev>/device and class/net/<netdev>/device. The layout
// follows the Linux ABI documents sysfs-class-infiniband and sysfs-class-net.
package fakesys

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
)

// Builder writes a fake sysfs tree rooted at Root.
type Builder struct {
	// Root is the directory to pass as the sysfs root ("/sys" on a host).
	Root  string
	t     testing.TB
	addrs map[string][]net.IP
}

// New returns a builder rooted at t.TempDir().
func New(t testing.TB) *Builder {
	t.Helper()
	return &Builder{Root: t.TempDir(), t: t, addrs: map[string][]net.IP{}}
}

// GID is one GID table entry to write.
type GID struct {
	Index  int
	Value  string // IPv6 text; "::ffff:10.0.0.1" for an IPv4-mapped GID
	Type   string // "RoCE v2" or "IB/RoCE v1"
	NetDev string
}

// Port is one port to write.
type Port struct {
	Num       int    // 1-based
	State     string // default "4: ACTIVE"
	LinkLayer string // default "Ethernet"
	TableLen  int    // GID table entries (unpopulated ones are zero GIDs); default 16
	GIDs      []GID
}

// Device is one RDMA device to write.
type Device struct {
	Name     string
	PCIAddr  string // "" for a software device (no device link)
	NUMANode int    // written to numa_node when PCIAddr is set
	NetDevs  []string
	Ports    []Port
}

func (b *Builder) write(rel, content string) {
	b.t.Helper()
	p := filepath.Join(b.Root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		b.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content+"\n"), 0o644); err != nil {
		b.t.Fatal(err)
	}
}

func (b *Builder) link(target, rel string) {
	b.t.Helper()
	p := filepath.Join(b.Root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		b.t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(b.Root, target), p); err != nil {
		b.t.Fatal(err)
	}
}

// AddDevice writes d (and its netdevs under class/net).
func (b *Builder) AddDevice(d Device) *Builder {
	b.t.Helper()
	ib := "class/infiniband/" + d.Name
	b.write(ib+"/node_type", "1: CA")
	pci := ""
	if d.PCIAddr != "" {
		pci = "devices/pci0000:00/" + d.PCIAddr
		b.write(pci+"/numa_node", fmt.Sprint(d.NUMANode))
		b.write(pci+"/vendor", "0x15b3")
		b.link(pci, ib+"/device")
	}
	for _, nd := range d.NetDevs {
		b.write("class/net/"+nd+"/operstate", "up")
		b.write("class/net/"+nd+"/mtu", "1500")
		if pci != "" {
			b.write(pci+"/net/"+nd+"/ifindex", "2")
			b.link(pci, "class/net/"+nd+"/device")
		}
	}
	for _, p := range d.Ports {
		if p.State == "" {
			p.State = "4: ACTIVE"
		}
		if p.LinkLayer == "" {
			p.LinkLayer = "Ethernet"
		}
		if p.TableLen == 0 {
			p.TableLen = 16
		}
		pd := fmt.Sprintf("%s/ports/%d", ib, p.Num)
		b.write(pd+"/state", p.State)
		b.write(pd+"/link_layer", p.LinkLayer)
		for i := 0; i < p.TableLen; i++ {
			b.write(fmt.Sprintf("%s/gids/%d", pd, i), "0000:0000:0000:0000:0000:0000:0000:0000")
		}
		for _, g := range p.GIDs {
			ip := net.ParseIP(g.Value)
			if ip == nil {
				b.t.Fatalf("fakesys: bad GID %q", g.Value)
			}
			ip = ip.To16()
			txt := ""
			for i := 0; i < 16; i += 2 {
				if i > 0 {
					txt += ":"
				}
				txt += fmt.Sprintf("%02x%02x", ip[i], ip[i+1])
			}
			b.write(fmt.Sprintf("%s/gids/%d", pd, g.Index), txt)
			b.write(fmt.Sprintf("%s/gid_attrs/types/%d", pd, g.Index), g.Type)
			b.write(fmt.Sprintf("%s/gid_attrs/ndevs/%d", pd, g.Index), g.NetDev)
		}
	}
	return b
}

// SetAddrs records the IP addresses a netdev owns, served by Addrs.
func (b *Builder) SetAddrs(netdev string, ips ...string) *Builder {
	for _, s := range ips {
		b.addrs[netdev] = append(b.addrs[netdev], net.ParseIP(s))
	}
	return b
}

// Addrs is an address lookup over the addresses set with SetAddrs (for
// rdma.WithAddrLookup); an unknown netdev is an error.
func (b *Builder) Addrs(netdev string) ([]net.IP, error) {
	ips, ok := b.addrs[netdev]
	if !ok {
		return nil, fmt.Errorf("fakesys: no such interface %q", netdev)
	}
	return ips, nil
}
