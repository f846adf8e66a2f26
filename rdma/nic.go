// Package rdma is the RDMA transport for the engine, built on ibverbs: NIC
// discovery (Mellanox/rdmamap + sysfs), RoCE v2 GID selection, GPU<->NIC
// affinity, the QP handshake over the engine's control channel, multi-NIC
// striping and completion tracking.
package rdma

// NIC is one RDMA device as discovered from sysfs (plain data, no handles).
type NIC struct {
	// Name is the verbs device name, e.g. "mlx5_0" or "rxe0".
	Name string `json:"name"`
	// PCIAddr is the normalised PCI address ("0000:17:00.0"), empty for
	// software devices such as rxe.
	PCIAddr string `json:"pci_addr,omitempty"`
	// NUMANode is the device's NUMA node, -1 when unknown.
	NUMANode int `json:"numa_node"`
	// NetDevs are the Ethernet interfaces bound to the device's ports.
	NetDevs []string `json:"netdevs,omitempty"`
	// Ports are the device's ports with their GIDs.
	Ports []Port `json:"ports,omitempty"`
}

// Port is one port of a NIC.
type Port struct {
	// Num is the 1-based port number.
	Num int `json:"num"`
	// State is the sysfs state text, e.g. "4: ACTIVE".
	State string `json:"state"`
	// LinkLayer is "Ethernet" (RoCE) or "InfiniBand".
	LinkLayer string `json:"link_layer"`
	// GIDTableLen is the number of GID table entries (populated or not); an
	// explicit GID index must be below it.
	GIDTableLen int `json:"gid_table_len"`
	// GIDs are the populated (non-zero) GID table entries, by index.
	GIDs []GID `json:"gids,omitempty"`
}

// GID is one GID table entry of a port.
type GID struct {
	// Index is the GID table index.
	Index int `json:"index"`
	// Value is the GID in IPv6 text form.
	Value string `json:"value"`
	// Type is the sysfs type text: "RoCE v2", "IB/RoCE v1".
	Type string `json:"type"`
	// NetDev is the interface the GID belongs to, when known.
	NetDev string `json:"netdev,omitempty"`
}
