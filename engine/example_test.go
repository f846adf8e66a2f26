package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// One request's KV from a prefill rank to a decode rank, both in this
// process over tcp on loopback, as a serving engine drives them: each rank
// is a Manager built from the caller's own KV buffers (here one K and one V
// buffer for each of 2 layers, pages of 4 tokens × 2 heads × 16 bytes);
// the prefill instance runs the bootstrap directory the decode resolves
// it through. The decode's Receiver names its destination pages (Init);
// the prefill's Sender, once it has them (WaitingForInput), sends its
// source pages (Send, last chunk); both report Success only after the
// decode verified the room's metadata record.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	quiet := slog.New(slog.DiscardHandler)

	// The prefill instance's bootstrap directory, on a free port.
	dir := server.New(server.Options{Host: "127.0.0.1", Logger: quiet})
	go func() { _ = dir.Start(ctx) }()
	<-dir.Ready()

	// What each rank owns, released in reverse order at the end: the
	// manager first (it deregisters the buffers), then its transport, then
	// the memory.
	var release []func()
	defer func() {
		for i := len(release) - 1; i >= 0; i-- {
			release[i]()
		}
	}()

	const pageBytes = 4 * 2 * 16 // tokens per page × heads × bytes per head
	newRank := func(role engine.Role) (*engine.Manager, []*transport.HostBuffer) {
		var bufs []*transport.HostBuffer
		args := kvargs.KVArgs{PageSize: 4, KVHeadNum: 2, GPUID: -1}
		for i := 0; i < 4; i++ { // layer 0 K, layer 1 K, layer 0 V, layer 1 V
			b, err := transport.AllocHost(fmt.Sprintf("%s-kv%d", role, i), 16*pageBytes)
			if err != nil {
				log.Fatal(err)
			}
			release = append(release, func() { b.Close() })
			bufs = append(bufs, b)
			args.KVBuffers = append(args.KVBuffers, kvargs.Buffer{Memory: b.Memory(), ItemLen: pageBytes})
		}
		tr, err := transport.OpenTransport("tcp", transport.DefaultOptions())
		if err != nil {
			log.Fatal(err)
		}
		release = append(release, func() { tr.Close() })
		cfg := engine.ManagerConfig{Role: role, KV: args, Transports: []transport.Transport{tr}, Logger: quiet}
		if role == engine.RolePrefill {
			cfg.BootstrapAddr = dir.Addr() // the prefill registers its rank there
		}
		m, err := engine.NewManager(ctx, cfg)
		if err != nil {
			log.Fatal(err)
		}
		release = append(release, func() { m.Close() })
		return m, bufs
	}
	prefill, src := newRank(engine.RolePrefill)
	decode, dst := newRank(engine.RoleDecode)

	// The prompt's KV on the prefill: pages 0 and 1 of every buffer.
	for i, b := range src {
		for j := range 2 * pageBytes {
			b.Bytes()[j] = byte(i*64 + j)
		}
	}

	const room = 42 // bootstrap_room, chosen by the router for both sides
	s, err := prefill.NewSender(room)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	r, err := decode.NewReceiver(dir.Addr(), room)
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()

	if err := r.Init([]int32{7, 3}); err != nil { // decode pages for the prompt's two pages
		log.Fatal(err)
	}
	fmt.Println("prefill:", s.Wait(ctx, engine.KVWaitingForInput))
	if err := s.Init(2, -1); err != nil { // two pages, no aux row
		log.Fatal(err)
	}
	if err := s.Send([]int32{0, 1}, true); err != nil {
		log.Fatal(err)
	}
	fmt.Println("decode:", r.Wait(ctx, engine.KVSuccess))
	fmt.Println("prefill:", s.Wait(ctx, engine.KVSuccess))
	for i := range dst {
		got, want := dst[i].Bytes(), src[i].Bytes()
		if !bytes.Equal(got[7*pageBytes:8*pageBytes], want[:pageBytes]) || !bytes.Equal(got[3*pageBytes:4*pageBytes], want[pageBytes:2*pageBytes]) {
			fmt.Println("buffer", i, "differs")
		}
	}
	fmt.Println("decode pages 7 and 3 hold prefill pages 0 and 1 in all", len(dst), "buffers")
	// Output:
	// prefill: WaitingForInput
	// decode: Success
	// prefill: Success
	// decode pages 7 and 3 hold prefill pages 0 and 1 in all 4 buffers
}
