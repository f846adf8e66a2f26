//go:build cgo

package main

// The transports compiled into libkvxfer.so; each registers itself with the
// engine registry from init. "auto" picks the highest priority whose probe
// passes on this host (rdma 300 > shm 200 > tcp 100). The rdma transport
// links libibverbs (rdma-core), so the library needs libibverbs.so.1 at run
// time; on hosts without an RDMA device its probe fails and auto skips it.
import (
	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	_ "github.com/kvxfer/kvxfer/rdma"
)
