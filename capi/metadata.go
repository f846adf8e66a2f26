//go:build cgo

package main

import (
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// peerAddressRegion is KVX_REGION_PEER_ADDRESS: a kvx_write_request whose
// remote_region is this value addresses the peer by virtual address.
const peerAddressRegion = engine.RegionID(0xFFFFFFFF)

// openMetadata turns kvx_engine_config.metadata_server (or KVXFER_METADATA)
// into a segment directory: nil for P2P ("", "P2PHANDSHAKE"), else the
// backend the URL names. The close function is nil when there is nothing
// to close.
func openMetadata(url string, timeout time.Duration) (engine.SegmentDirectory, func() error, error) {
	switch strings.TrimSpace(url) {
	case "", "P2PHANDSHAKE", "p2p", "P2P":
		return nil, nil, nil
	}
	return nil, nil, fail(stNotSupported, "kvx_engine_create: metadata_server %q: this build supports P2P only (\"\" or \"P2PHANDSHAKE\")", url)
}
