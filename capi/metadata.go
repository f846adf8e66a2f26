//go:build cgo

package main

import (
	"context"
	"errors"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/metadata"
)

// peerAddressRegion is KVX_REGION_PEER_ADDRESS: a kvx_write_request whose
// remote_region is this value addresses the peer by virtual address.
const peerAddressRegion = transport.RegionID(0xFFFFFFFF)

// openMetadata turns kvx_engine_config.metadata_server (or KVXFER_METADATA)
// into a segment directory: nil for P2P ("", "P2PHANDSHAKE"), an HTTP
// metadata server for "http://host:port/metadata" (Mooncake's HTTP mode),
// else an etcd store (lease TTL metadata.DefaultTTL), with its close
// function. An unreachable server is KVX_ERR_METADATA, a malformed URL (or
// a server that is not a metadata server) KVX_ERR_INVALID_ARGUMENT.
func openMetadata(url string, timeout time.Duration) (transport.SegmentDirectory, func() error, error) {
	if metadata.IsP2P(url) {
		return nil, nil, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var (
		s interface {
			transport.SegmentDirectory
			Close() error
		}
		err error
	)
	if metadata.IsHTTP(url) {
		s, err = metadata.OpenHTTP(ctx, url, metadata.HTTPOptions{Timeout: timeout})
	} else {
		s, err = metadata.Open(ctx, url, metadata.Options{Timeout: timeout})
	}
	if err != nil {
		code := stInvalidArgument
		if errors.Is(err, transport.ErrMetadataUnavailable) {
			code = stMetadata
		}
		return nil, nil, failWrap(code, err, "kvx_engine_create: metadata_server %q", url)
	}
	return s, s.Close, nil
}
