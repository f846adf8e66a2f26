package segengine_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// Two TransferEngines on loopback, as Mooncake's transfer API is used: the
// receiver registers memory and is known by its segment name
// ("host:rpc_port", P2P: no metadata server); the sender opens that segment
// by name and writes to the receiver's memory by the receiver's own virtual
// address (Mooncake's peer_buffer_address), which the segment translates to
// a region and an offset.
func ExampleTransferEngine() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	newEngine := func() *segengine.TransferEngine {
		tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
		if err != nil {
			log.Fatal(err)
		}
		te, err := segengine.NewTransferEngine(ctx, segengine.TransferEngineConfig{Transport: tr, Logger: slog.New(slog.DiscardHandler)})
		if err != nil { // NewTransferEngine closed the transport
			log.Fatal(err)
		}
		return te // owns the transport: Close closes it
	}
	recv, send := newEngine(), newEngine()
	defer recv.Close()
	defer send.Close()

	// Memory a transport keeps pointers into is never Go heap: AllocHost.
	dst, err := transport.AllocHost("example-dst", 4096)
	if err != nil {
		log.Fatal(err)
	}
	defer dst.Close()
	if _, err := recv.RegisterMemory(dst.Memory()); err != nil {
		log.Fatal(err)
	}
	src, err := transport.AllocHost("example-src", 4096)
	if err != nil {
		log.Fatal(err)
	}
	defer src.Close()
	if _, err := send.RegisterMemory(src.Memory()); err != nil {
		log.Fatal(err)
	}
	copy(src.Bytes(), "KV bytes for the decode")

	seg, err := send.OpenSegment(ctx, recv.Name())
	if err != nil {
		log.Fatal(err)
	}
	defer seg.Close()
	// 23 bytes to byte 100 of the receiver's buffer, named by its address there.
	id, err := seg.SubmitPeerWrites(ctx, []segengine.PeerWrite{{Local: src.Addr(), PeerAddr: uint64(dst.Addr()) + 100, Length: 23}})
	if err != nil {
		log.Fatal(err)
	}
	st, err := seg.Wait(ctx, id)
	if err != nil {
		log.Fatal(err)
	}
	seg.Release(id)
	fmt.Println(st.State, st.BytesDone)
	fmt.Printf("%q\n", dst.Bytes()[100:123])
	// Output:
	// completed 23
	// "KV bytes for the decode"
}
