package engine

import (
	"fmt"
	"hash/crc32"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// The checksum walk. A decode that asks for a checksum compares the CRC32C
// in a producer's metadata record with one it computes over the bytes it
// received; both sides must visit the same bytes in the same order, so the
// walk exists once, here, and each side only says which end of each buffer
// pair it reads. Order: page by page (in the order of the page list),
// buffer pair by buffer pair (PairBuffers order), the whole item when the
// pair moves whole pages, else token row by token row, the sliced bytes of
// each row; then (crcExtras) the aux row of every aux buffer, then every
// state slot of every state buffer.

// pairEnd selects the producer's (src) or the consumer's (dst) side of a
// BufferPair.
type pairEnd bool

const (
	srcEnd pairEnd = false
	dstEnd pairEnd = true
)

// crcPages extends crc over pages of the given side's KV buffers bufs.
// pageSize is tokens per page; scratch is reused for device memory reads.
func crcPages(crc uint32, bufs []kvargs.Buffer, pairs []kvargs.BufferPair, end pairEnd, pages []int32, pageSize int, scratch *[]byte) (uint32, error) {
	var err error
	for _, pg := range pages {
		for _, pr := range pairs {
			idx, item, token, sliceOff := pr.Src, pr.SrcItem, pr.SrcToken, pr.Slice.SrcOffset
			if end == dstEnd {
				idx, item, token, sliceOff = pr.Dst, pr.DstItem, pr.DstToken, pr.Slice.DstOffset
			}
			mem := bufs[idx].Memory
			off := uint64(pg) * item
			if pr.Full {
				if crc, err = crcMem(crc, mem, off, item, scratch); err != nil {
					return 0, err
				}
				continue
			}
			for t := 0; t < pageSize; t++ {
				if crc, err = crcMem(crc, mem, off+uint64(t)*token+sliceOff, pr.Slice.Length, scratch); err != nil {
					return 0, err
				}
			}
		}
	}
	return crc, nil
}

// crcExtras extends crc over row aux of every aux buffer (none when aux < 0)
// and then slots state of every state buffer, of this side's kv.
func crcExtras(crc uint32, kv kvargs.KVArgs, aux int, state []int32, scratch *[]byte) (uint32, error) {
	var err error
	if aux >= 0 {
		for _, b := range kv.AuxBuffers {
			if crc, err = crcMem(crc, b.Memory, uint64(aux)*b.ItemLen, b.ItemLen, scratch); err != nil {
				return 0, err
			}
		}
	}
	for _, b := range kv.StateBuffers {
		for _, x := range state {
			if crc, err = crcMem(crc, b.Memory, uint64(x)*b.ItemLen, b.ItemLen, scratch); err != nil {
				return 0, err
			}
		}
	}
	return crc, nil
}

// crcMem extends crc (CRC32C) over the n bytes at byte offset off of mem; a
// device range is copied to the host through *scratch first.
func crcMem(crc uint32, mem transport.Memory, off, n uint64, scratch *[]byte) (uint32, error) {
	if mem.Kind == transport.MemoryHost {
		return crc32.Update(crc, castagnoli, mem.Bytes()[off:off+n]), nil
	}
	b, err := readMem(mem, off, n, scratch)
	if err != nil {
		return crc, err
	}
	return crc32.Update(crc, castagnoli, b), nil
}

// readMem returns the n bytes at byte offset off of mem: the memory itself
// for a host range, a copy in *scratch for a device range (cudaMemcpy).
func readMem(mem transport.Memory, off, n uint64, scratch *[]byte) ([]byte, error) {
	if off > mem.Length || n > mem.Length-off {
		return nil, fmt.Errorf("engine: read [%d, %d) outside a %d-byte buffer", off, off+n, mem.Length)
	}
	if mem.Kind == transport.MemoryHost {
		return mem.Bytes()[off : off+n], nil
	}
	if uint64(cap(*scratch)) < n {
		*scratch = make([]byte, n)
	}
	b := (*scratch)[:n]
	if n == 0 {
		return b, nil
	}
	if err := cuda.CopyFromDevice(mem.Device, b, cuda.DevicePtr(mem.Addr)+cuda.DevicePtr(off)); err != nil {
		return nil, fmt.Errorf("engine: read [%d, %d) from cuda:%d: %w", off, off+n, mem.Device, err)
	}
	return b, nil
}
