package workload

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"
)

// The KV test pattern: every head row (HeadBytes bytes of one head of one
// token in one layer buffer) holds little-endian 64-bit words
//
//	word w = patternSeed(room, layer, kv, token, head) + w × 0x9E3779B97F4A7C15
//
// where token is the token's position in the request (logical page × page
// size + slot) and head the model-wide KV head, so a producer with any TP/PP
// split fills, and a consumer with any other split verifies, the same bytes
// independently of the physical page indices. A row whose length is not a
// multiple of 8 ends with the low bytes of the next word.

// ErrPatternMismatch is wrapped by VerifyPattern's, VerifyPatternLayers'
// and VerifyAux's error when a byte differs from the test pattern (not when
// the check itself could not read the buffers): the bytes that landed are
// not the pattern, because the producer did not write it (a prefill not
// filling its pages) or the transfer lost or misplaced them.
var ErrPatternMismatch = errors.New("differs from the pattern")

// patternSeed mixes the coordinates of a head row (SplitMix64 finaliser).
func patternSeed(room uint64, layer, kv, token, head int) uint64 {
	x := room ^ uint64(layer)<<48 ^ uint64(kv)<<47 ^ uint64(token)<<16 ^ uint64(head)
	x += 0x9E3779B97F4A7C15
	x = (x ^ x>>30) * 0xBF58476D1CE4E5B9
	x = (x ^ x>>27) * 0x94D049BB133111EB
	return x ^ x>>31
}

const patternStep = 0x9E3779B97F4A7C15

// words views b as native (little-endian on every supported CPU) uint64s when
// it is 8-byte aligned and a whole number of words.
func words(b []byte) []uint64 {
	if len(b) == 0 || len(b)%8 != 0 || uintptr(unsafe.Pointer(&b[0]))%8 != 0 || !littleEndian {
		return nil
	}
	return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8)
}

var littleEndian = func() bool { x := uint16(1); return *(*byte)(unsafe.Pointer(&x)) == 1 }()

func fillRow(b []byte, seed uint64) {
	if w := words(b); w != nil {
		v := seed
		for i := range w {
			w[i] = v
			v += patternStep
		}
		return
	}
	n := len(b) &^ 7
	v := seed
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], v)
		v += patternStep
	}
	for i := n; i < len(b); i++ {
		b[i] = byte(v >> (8 * uint(i-n)))
	}
}

func checkRow(b []byte, seed uint64) int {
	if w := words(b); w != nil {
		v := seed
		ok := true
		for i := range w {
			ok = ok && w[i] == v
			v += patternStep
		}
		if ok {
			return -1
		}
	}
	n := len(b) &^ 7
	v := seed
	for i := 0; i < n; i += 8 {
		if got := binary.LittleEndian.Uint64(b[i:]); got != v {
			for k := 0; k < 8; k++ {
				if byte(got>>(8*k)) != byte(v>>(8*k)) {
					return i + k
				}
			}
		}
		v += patternStep
	}
	for i := n; i < len(b); i++ {
		if b[i] != byte(v>>(8*uint(i-n))) {
			return i
		}
	}
	return -1
}

// forRows calls f for every head row the buffers hold for the request's pages
// (pages[k] is the request's logical page firstPage+k). Device buffers are
// staged item by item through a host copy (ReadAt, then WriteAt when write is
// set); errors come only from those copies.
func forRows(b *KVBuffers, pages []int32, firstPage int, write bool, f func(row []byte, layer, kv, token, head int) bool) error {
	return forRowsOf(b, pages, firstPage, b.layout.StartLayer, b.layout.EndLayer-1, write, f)
}

// forRowsOf is forRows over the buffers of model layers lo…hi only.
func forRowsOf(b *KVBuffers, pages []int32, firstPage, lo, hi int, write bool, f func(row []byte, layer, kv, token, head int) bool) error {
	l := b.layout
	hb, tb, il := l.HeadBytes(), l.TokenBytes(), l.ItemLen()
	var item []byte
	if b.dev >= 0 {
		item = make([]byte, il)
	}
	for i := 0; i < l.NumBuffers(); i++ {
		layer, kv := l.BufferLayer(i)
		if layer < lo || layer > hi {
			continue
		}
		host := b.Bytes(i)
		for k, pg := range pages {
			poff := uint64(pg) * il
			mem, base := host, poff
			if host == nil {
				if err := b.ReadAt(i, item, poff); err != nil {
					return err
				}
				mem, base = item, 0
			}
			stop := false
		rows:
			for t := 0; t < l.PageSize; t++ {
				toff := base + uint64(t)*tb
				for h := 0; h < l.HeadsPerRank; h++ {
					o := toff + uint64(h)*hb
					if !f(mem[o:o+hb], layer, kv, (firstPage+k)*l.PageSize+t, l.GlobalHead(h)) {
						stop = true
						break rows
					}
				}
			}
			if host == nil && write {
				if err := b.WriteAt(i, item, poff); err != nil {
					return err
				}
			}
			if stop {
				return nil
			}
		}
	}
	return nil
}

// FillPattern writes the test pattern of request room into the buffers'
// pages (every layer buffer, every token slot of every page, every head this
// rank holds), as if the prefill had computed the KV; pages[k] holds the
// request's logical page firstPage+k (firstPage > 0 when the decode already
// holds a prefix). Device buffers are written through host copies; their
// errors are returned (host buffers never fail).
func FillPattern(b *KVBuffers, room uint64, pages []int32, firstPage int) error {
	err := forRows(b, pages, firstPage, true, func(row []byte, layer, kv, token, head int) bool {
		fillRow(row, patternSeed(room, layer, kv, token, head))
		return true
	})
	if err != nil {
		return fmt.Errorf("workload: fill the test pattern for room %d: %w", room, err)
	}
	return nil
}

// FillPatternLayers is FillPattern for the buffers of model layers
// firstLayer…lastLayer only: what a prefill's forward pass has written once
// it finished those layers (layer-wise sending writes each layer as it is
// computed). Layers outside the rank's are skipped.
func FillPatternLayers(b *KVBuffers, room uint64, pages []int32, firstPage, firstLayer, lastLayer int) error {
	err := forRowsOf(b, pages, firstPage, firstLayer, lastLayer, true, func(row []byte, layer, kv, token, head int) bool {
		fillRow(row, patternSeed(room, layer, kv, token, head))
		return true
	})
	if err != nil {
		return fmt.Errorf("workload: fill the test pattern of layers %d…%d for room %d: %w", firstLayer, lastLayer, room, err)
	}
	return nil
}

// VerifyPatternLayers is VerifyPattern for the buffers of model layers
// firstLayer…lastLayer only.
func VerifyPatternLayers(b *KVBuffers, room uint64, pages []int32, firstPage, firstLayer, lastLayer int) error {
	var err error
	cerr := forRowsOf(b, pages, firstPage, firstLayer, lastLayer, false, func(row []byte, layer, kv, token, head int) bool {
		if off := checkRow(row, patternSeed(room, layer, kv, token, head)); off >= 0 {
			err = fmt.Errorf("workload: KV verification failed for room %d: layer %d %s, token %d (page %d), head %d, byte %d %w", room, layer, kvName(b.layout, kv), token, pages[token/b.layout.PageSize-firstPage], head, off, ErrPatternMismatch)
			return false
		}
		return true
	})
	if cerr != nil {
		return fmt.Errorf("workload: verify room %d: %w", room, cerr)
	}
	return err
}

// VerifyPattern checks every byte of the request's pages (pages[k] = logical
// page firstPage+k) against the test pattern of room; the error names the
// first wrong row (layer, K/V, token, head, byte offset). Device buffers are
// read through host copies; a failed copy is returned as an error too.
func VerifyPattern(b *KVBuffers, room uint64, pages []int32, firstPage int) error {
	return VerifyPatternLayers(b, room, pages, firstPage, b.layout.StartLayer, b.layout.EndLayer-1)
}

// auxSeed is the pattern seed of aux buffer i's row for room (layer -1 keeps
// it apart from every KV row).
func auxSeed(room uint64, i int) uint64 { return patternSeed(room, 0xFFFF, 1, 0xFFFF, i) }

// FillAux writes room's test pattern into row `row` of every aux buffer, as
// the prefill writes a request's first output token, logprobs and room.
func FillAux(b *KVBuffers, room uint64, row int) error {
	if row < 0 || row >= b.rows {
		return fmt.Errorf("workload: aux row %d not in [0, %d)", row, b.rows)
	}
	for i := range b.auxBufs {
		fillRow(b.AuxRow(i, row), auxSeed(room, i))
	}
	return nil
}

// VerifyAux checks row `row` of every aux buffer against room's pattern; the
// error names the aux buffer and the first wrong byte.
func VerifyAux(b *KVBuffers, room uint64, row int) error {
	if row < 0 || row >= b.rows {
		return fmt.Errorf("workload: aux row %d not in [0, %d)", row, b.rows)
	}
	for i, a := range b.aux {
		if off := checkRow(b.AuxRow(i, row), auxSeed(room, i)); off >= 0 {
			return fmt.Errorf("workload: aux verification failed for room %d: buffer %s row %d, byte %d %w", room, a.Name, row, off, ErrPatternMismatch)
		}
	}
	return nil
}
