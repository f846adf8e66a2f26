package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bench/gpustaging"
	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/cuda/gpucheck"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// gpuCheckRow is one line of the `kvxfer gpucheck` table.
type gpuCheckRow struct {
	Check string `json:"check"`
	OK    bool   `json:"ok"`
	// Unsupported marks a check this host or transport cannot do by design
	// (transport.ErrUnsupportedMemory, or cuda.ErrNotSupported such as NVRTC
	// not installed); it is reported as n/a, not failed.
	Unsupported bool    `json:"unsupported,omitempty"`
	GBps        float64 `json:"gbps,omitempty"`
	Detail      string  `json:"detail"`
}

func init() {
	var sizeMiB, stagingMiB int
	var require, jsonOut bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "gpucheck",
		Short: "GPU self-check: devices, GPU-visible metadata ring proof, device-memory transfers over tcp/shm, staging bandwidth",
		Long: `Check this host's GPU path end to end and print a table:
  - CUDA libraries and devices (name, PCI bus id, memory);
  - the GPU proof: a CUDA kernel (NVRTC, then built-in PTX) reads a metadata
    ring slot through the ring's device pointer and checks its bootstrap_room;
  - device-memory KV transfers through the tcp and shm transports on loopback
    (device -> device, bytes verified), next to host -> host for reference;
  - device<->host staging through a pinned bounce buffer vs a plain
    cudaMemcpy of the same size.
Without a GPU it prints "no GPU" with the reason and exits 0, unless
--require (or KVXFER_REQUIRE_GPU=1) is given.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if os.Getenv("KVXFER_REQUIRE_GPU") != "" {
				require = true
			}
			if sizeMiB <= 0 || sizeMiB > 16<<10 {
				return fmt.Errorf("--size-mib %d: want 1..16384", sizeMiB)
			}
			if stagingMiB < 4 || stagingMiB%4 != 0 {
				return fmt.Errorf("--staging-mib %d: want a positive multiple of 4", stagingMiB)
			}
			rows, err := runGPUCheck(cmd.ErrOrStderr(), uint64(sizeMiB)<<20, uint64(stagingMiB)<<20, timeout)
			if err != nil {
				if errors.Is(err, cuda.ErrNotSupported) && !require {
					fmt.Fprintf(cmd.OutOrStdout(), "no GPU (%v)\n", err)
					return nil
				}
				return err
			}
			if jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(rows); err != nil {
					return err
				}
			} else {
				printGPUCheck(cmd.OutOrStdout(), rows)
			}
			for _, r := range rows {
				if !r.OK && !r.Unsupported {
					return fmt.Errorf("gpucheck: %s failed: %s", r.Check, r.Detail)
				}
			}
			return nil
		},
	}
	cmd.Flags().IntVar(&sizeMiB, "size-mib", 64, "bytes per transfer check, in MiB")
	cmd.Flags().IntVar(&stagingMiB, "staging-mib", 256, "bytes per staging measurement, in MiB (multiple of the 4 MiB chunk)")
	cmd.Flags().BoolVar(&require, "require", false, "fail when no GPU is usable (env KVXFER_REQUIRE_GPU)")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON instead of a table")
	cmd.Flags().DurationVar(&timeout, "timeout", 60*time.Second, "deadline for each transfer check")
	rootCmd.AddCommand(cmd)
}

func printGPUCheck(w io.Writer, rows []gpuCheckRow) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tRESULT\tGB/s\tDETAIL")
	for _, r := range rows {
		res, rate := "ok", "-"
		if r.Unsupported {
			res = "n/a"
		} else if !r.OK {
			res = "FAIL"
		}
		if r.GBps > 0 {
			rate = fmt.Sprintf("%.2f", r.GBps)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.Check, res, rate, r.Detail)
	}
	tw.Flush()
}

// runGPUCheck returns an error wrapping cuda.ErrNotSupported when there is
// no usable GPU; otherwise every check becomes a row (failures included).
func runGPUCheck(log io.Writer, size, stagingSize uint64, timeout time.Duration) ([]gpuCheckRow, error) {
	if err := cuda.Available(); err != nil {
		return nil, err
	}
	var rows []gpuCheckRow
	add := func(check string, gbps float64, err error, detail string) {
		if err != nil {
			detail = err.Error()
		}
		rows = append(rows, gpuCheckRow{Check: check, OK: err == nil, Unsupported: errors.Is(err, transport.ErrUnsupportedMemory) || errors.Is(err, cuda.ErrNotSupported), GBps: gbps, Detail: detail})
		fmt.Fprintf(log, "gpucheck: %-28s ok=%v %s\n", check, err == nil, detail)
	}
	n, _ := cuda.DeviceCount()
	rt, drv := cuda.Versions()
	rtPath, drvPath, _ := cuda.Libraries()
	add("cuda", 0, nil, fmt.Sprintf("%d device(s); runtime %d (%s), driver %d (%s)", n, rt, rtPath, drv, drvPath))
	for i := 0; i < n; i++ {
		p, err := cuda.Device(i)
		add(fmt.Sprintf("device %d", i), 0, err, fmt.Sprintf("%s, pci %s, %d GiB, sm_%d%d, dma-buf %v", p.Name, p.PCIBusID, p.TotalMemory>>30, p.ComputeMajor, p.ComputeMinor, p.DmaBuf))
	}

	ring, err := engine.NewMetaRing(64, engine.CUDARingMemory(0))
	if err != nil {
		add("ring in mapped memory", 0, err, "")
	} else {
		defer ring.Close()
		base := ring.RingMem().DevicePtr()
		if base == 0 {
			add("ring in mapped memory", 0, errors.New("ring has no device pointer on a CUDA host"), "")
		}
		for _, mode := range []gpucheck.ProofMode{gpucheck.ProofNVRTC, gpucheck.ProofBuiltinPTX} {
			slot, gen, err := ring.Acquire()
			if err != nil {
				add("ring proof ("+string(mode)+")", 0, err, "")
				continue
			}
			room := uint64(0x5eed_0000_0000) + uint64(slot)*7919
			rec := engine.MetaRecord{Room: room, Generation: gen, PageCount: 1}
			b := ring.RingMem().Bytes()[ring.Offset(slot):]
			rec.EncodeBody(b)
			rec.EncodeCommit(b)
			got, used, err := gpucheck.CheckRoom(0, cuda.DevicePtr(base+uintptr(ring.Offset(slot))), room, mode)
			add("ring proof ("+string(mode)+")", 0, err, fmt.Sprintf("kernel read bootstrap_room %#x at slot %d via %s", got, slot, used))
			ring.Release(slot)
		}
	}

	for _, tc := range []struct {
		transport string
		kind      transport.MemoryKind
	}{
		{"tcp", transport.MemoryHost}, {"tcp", transport.MemoryCUDA},
		{"shm", transport.MemoryHost}, {"shm", transport.MemoryCUDA},
	} {
		name := fmt.Sprintf("%s %s->%s %dMiB", tc.transport, tc.kind, tc.kind, size>>20)
		gbps, err := transferCheck(tc.transport, tc.kind, size, timeout)
		add(name, gbps, err, "bytes verified")
	}

	r, err := gpustaging.MeasureStaging(0, stagingSize, 4<<20, 5)
	detail := func(plain, staged float64) string {
		if plain <= 0 {
			return ""
		}
		return fmt.Sprintf("staged/plain = %.2f (%d MiB, 4 MiB chunks, 5 reps)", staged/plain, stagingSize>>20)
	}
	add("staging DtoH plain pageable", r.PlainDtoHPageable, err, "one cudaMemcpy into pageable memory")
	add("staging DtoH plain pinned", r.PlainDtoHPinned, err, "one cudaMemcpy into pinned memory")
	add("staging DtoH pinned bounce", r.StagedDtoH, err, detail(r.PlainDtoHPageable, r.StagedDtoH))
	add("staging HtoD plain pageable", r.PlainHtoDPageable, err, "one cudaMemcpy from pageable memory")
	add("staging HtoD pinned bounce", r.StagedHtoD, err, detail(r.PlainHtoDPageable, r.StagedHtoD))
	return rows, nil
}

// kvBuffer is host (AllocHost) or device (cudaMalloc) memory for a transfer check.
type kvBuffer struct {
	mem   transport.Memory
	host  *transport.HostBuffer
	dptr  cuda.DevicePtr
	bytes uint64
}

func newKVBuffer(name string, kind transport.MemoryKind, size uint64) (*kvBuffer, error) {
	if kind == transport.MemoryCUDA {
		d, err := cuda.Malloc(0, size)
		if err != nil {
			return nil, err
		}
		return &kvBuffer{mem: transport.Memory{Addr: uintptr(d), Length: size, Kind: transport.MemoryCUDA, Device: 0, FD: -1}, dptr: d, bytes: size}, nil
	}
	h, err := transport.AllocHost(name, int64(size))
	if err != nil {
		return nil, err
	}
	return &kvBuffer{mem: h.Memory(), host: h, bytes: size}, nil
}

func (b *kvBuffer) write(p []byte) error {
	if b.host != nil {
		copy(b.host.Bytes(), p)
		return nil
	}
	return cuda.CopyToDevice(0, b.dptr, p)
}

func (b *kvBuffer) read(p []byte) error {
	if b.host != nil {
		copy(p, b.host.Bytes())
		return nil
	}
	return cuda.CopyFromDevice(0, p, b.dptr)
}

func (b *kvBuffer) Close() {
	if b.host != nil {
		b.host.Close()
	} else {
		cuda.Free(0, b.dptr)
	}
}

// transferCheck moves size bytes from a sender's buffer to a receiver's
// buffer of the given kind through the named transport on loopback, in
// 1 MiB requests, and verifies every byte. It returns the payload rate of
// the timed batch in GB/s.
func transferCheck(name string, kind transport.MemoryKind, size uint64, timeout time.Duration) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	src, err := newKVBuffer("gpucheck-src", kind, size)
	if err != nil {
		return 0, err
	}
	defer src.Close()
	dst, err := newKVBuffer("gpucheck-dst", kind, size)
	if err != nil {
		return 0, err
	}
	defer dst.Close()
	pattern := make([]byte, size)
	for i := uint64(0); i < size; i += 8 {
		binary.LittleEndian.PutUint64(pattern[i:], i*0x9e3779b97f4a7c15)
	}
	if err := src.write(pattern); err != nil {
		return 0, err
	}
	sender, err := openEnvTransport(name)
	if err != nil {
		return 0, err
	}
	defer sender.Close()
	receiver, err := openEnvTransport(name)
	if err != nil {
		return 0, err
	}
	defer receiver.Close()
	if _, err := sender.RegisterMemory(src.mem); err != nil {
		return 0, fmt.Errorf("sender: %w", err)
	}
	desc, err := receiver.RegisterMemory(dst.mem)
	if err != nil {
		return 0, fmt.Errorf("receiver: %w", err)
	}
	ep, err := receiver.Endpoint(ctx, "gpucheck")
	if err != nil {
		return 0, err
	}
	seg, err := sender.OpenSegment(ctx, transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{desc}})
	if err != nil {
		return 0, err
	}
	defer seg.Close()
	if acc, ok := receiver.(transport.Acceptor); ok && sender.Capabilities().Has(transport.CapHandshake) {
		if err := acc.Accept(ctx, "gpucheck", seg.HandshakeReply()); err != nil {
			return 0, err
		}
	}
	const req = 1 << 20
	var batch transport.TransferBatch
	for off := uint64(0); off < size; off += req {
		n := min(req, size-off)
		batch.Requests = append(batch.Requests, transport.WriteRequest{Local: src.mem.Addr + uintptr(off), Remote: desc.ID, RemoteOffset: off, Length: n})
	}
	start := time.Now()
	id, err := seg.Submit(ctx, &batch)
	if err != nil {
		return 0, err
	}
	st, err := seg.Wait(ctx, id)
	elapsed := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("wait: %w", err)
	}
	if st.State != transport.BatchCompleted {
		return 0, fmt.Errorf("batch %v: %v", st.State, st.Err)
	}
	seg.Release(id)
	got := make([]byte, size)
	if err := dst.read(got); err != nil {
		return 0, err
	}
	if !bytes.Equal(got, pattern) {
		i := 0
		for i < len(got) && got[i] == pattern[i] {
			i++
		}
		return 0, fmt.Errorf("receiver byte %d = %#x, want %#x", i, got[i], pattern[i])
	}
	return float64(size) / elapsed.Seconds() / 1e9, nil
}
