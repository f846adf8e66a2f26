package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/klauspost/cpuid/v2"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Metadata record layout (one ring slot; little-endian; 64 bytes, one cache
// line; C header: struct kvx_meta_record). The producer writes bytes 0–55 with
// (or after) the KV pages and the commit word only once every byte of that
// batch landed: as the batch's ordered last write where the transport
// orders it (transport.CapOrderedLast: shm, tcp), else in a second batch
// after the first completed. A reader that sees a valid commit word sees
// the whole record and the producer's pages.
//
//	| offset | size | field        | meaning                                                   |
//	|-------:|-----:|--------------|-----------------------------------------------------------|
//	|      0 |    8 | room         | bootstrap_room of the request (0 allowed)                 |
//	|      8 |    8 | generation   | slot generation the decode gave in TRANSFER               |
//	|     16 |    4 | page_count   | pages this producer wrote to this decode rank             |
//	|     20 |    4 | producer     | producer rank (tp*(pp*cp) + pp*cp + cp, as SGLang)        |
//	|     24 |    8 | byte_count   | payload bytes this producer wrote to this decode rank     |
//	|     32 |    4 | checksum     | CRC32C (Castagnoli) of those bytes in canonical order     |
//	|     36 |    4 | flags        | bit 0: checksum is set; bit 1: sent layer by layer; others 0 |
//	|     40 |    4 | token_count  | tokens (prompt length) the producer covered; 0 = undeclared |
//	|     44 |    4 | layer_count  | layers of the producer (its [start, end)) every page of which it wrote |
//	|     48 |    8 | epoch        | segment epoch of the data path the producer wrote through |
//	|     56 |    8 | commit       | RecordCommitMagic XOR generation; written last           |
//
// The decode accepts a record only when the commit word matches the slot's
// generation AND the body names its room, the epoch under which it registered
// with that producer (REGISTER/TRANSFER), the producer rank, and the page,
// byte and (when both sides declared it) token counts it expects, and a
// layer_count equal to the producer's layers: a record from another room or
// another (fenced) data path never commits a slot, and neither does one of
// a room sent layer by layer (Sender.SendLayers) before its last layer.
// layer_count took the reserved bytes 44–47 in control protocol version 6
// (a version-5 decode refuses the record as corrupt, and REGISTER between
// the two versions is refused first).
const (
	// RecordSize is the size of one metadata record in bytes.
	RecordSize = 64
	// RecordCommitOffset is the byte offset of the commit word.
	RecordCommitOffset = 56
	// RecordTokenCountOffset is the byte offset of token_count (u32).
	RecordTokenCountOffset = 40
	// RecordLayerCountOffset is the byte offset of layer_count (u32).
	RecordLayerCountOffset = 44
	// RecordEpochOffset is the byte offset of epoch (u64).
	RecordEpochOffset = 48
	// RecordCommitMagic XOR the generation is the committed value.
	RecordCommitMagic uint64 = 0x4B5658434F4D4954 // "KVXCOMIT"
	// RecordFlagChecksum marks a record whose checksum field is set.
	RecordFlagChecksum uint32 = 1
	// RecordFlagLayerwise marks a record of a room the producer sent layer
	// range by layer range (Sender.SendLayers) rather than whole pages.
	RecordFlagLayerwise uint32 = 2
	// recordFlagsKnown are the flag bits this version defines; a record
	// with any other bit set is refused as corrupt.
	recordFlagsKnown = RecordFlagChecksum | RecordFlagLayerwise
)

// MetaRecord is one decoded metadata record; the fields are those of the
// layout table above (Commit is the commit word as loaded).
type MetaRecord struct {
	Room       uint64
	Generation uint64
	PageCount  uint32
	Producer   uint32
	ByteCount  uint64
	Checksum   uint32
	Flags      uint32
	// TokenCount is the number of tokens (prompt length) the producer's
	// pages cover, as the prefill declared it (Sender.SetTokens); 0 when it
	// declared none.
	TokenCount uint32
	// LayerCount is the number of the producer's layers (its
	// [StartLayer, EndLayer) of its KV arguments) whose every page it wrote
	// to this decode rank before the record: the decode accepts only its
	// producer's whole layer count, so a room sent layer by layer is never
	// accepted short of its last layer.
	LayerCount uint32
	// Epoch is the segment epoch of the data path the record (and the
	// producer's KV writes) went through: the epoch the decode chose when it
	// registered with the producer (RegisterMsg.Epoch).
	Epoch  uint64
	Commit uint64
}

// Committed reports whether the commit word matches the generation.
func (r MetaRecord) Committed() bool { return r.Commit == RecordCommitMagic^r.Generation }

// HasChecksum reports whether the checksum field is set.
func (r MetaRecord) HasChecksum() bool { return r.Flags&RecordFlagChecksum != 0 }

// EncodeBody writes bytes 0–55 of the record into b (len ≥ RecordSize); the
// commit word is left alone (see EncodeCommit).
func (r MetaRecord) EncodeBody(b []byte) {
	_ = b[RecordSize-1]
	binary.LittleEndian.PutUint64(b[0:], r.Room)
	binary.LittleEndian.PutUint64(b[8:], r.Generation)
	binary.LittleEndian.PutUint32(b[16:], r.PageCount)
	binary.LittleEndian.PutUint32(b[20:], r.Producer)
	binary.LittleEndian.PutUint64(b[24:], r.ByteCount)
	binary.LittleEndian.PutUint32(b[32:], r.Checksum)
	binary.LittleEndian.PutUint32(b[36:], r.Flags)
	binary.LittleEndian.PutUint32(b[RecordTokenCountOffset:], r.TokenCount)
	binary.LittleEndian.PutUint32(b[RecordLayerCountOffset:], r.LayerCount)
	binary.LittleEndian.PutUint64(b[RecordEpochOffset:], r.Epoch)
}

// EncodeCommit writes the commit word for the record's generation into
// b[RecordCommitOffset:].
func (r MetaRecord) EncodeCommit(b []byte) {
	binary.LittleEndian.PutUint64(b[RecordCommitOffset:], RecordCommitMagic^r.Generation)
}

// DecodeRecord parses a record from b. It fails only when b is shorter than
// RecordSize or a flag bit this version does not define is set (a corrupt
// slot, or a producer of a newer protocol); a record that is not committed
// decodes fine (check Committed).
func DecodeRecord(b []byte) (MetaRecord, error) {
	if len(b) < RecordSize {
		return MetaRecord{}, fmt.Errorf("engine: metadata record: %d bytes, want %d", len(b), RecordSize)
	}
	if f := binary.LittleEndian.Uint32(b[36:]); f&^recordFlagsKnown != 0 {
		return MetaRecord{}, fmt.Errorf("engine: metadata record: flags %#x set unknown bits %#x (corrupt slot, or a producer of another protocol version)", f, f&^recordFlagsKnown)
	}
	return MetaRecord{
		Room:       binary.LittleEndian.Uint64(b[0:]),
		Generation: binary.LittleEndian.Uint64(b[8:]),
		PageCount:  binary.LittleEndian.Uint32(b[16:]),
		Producer:   binary.LittleEndian.Uint32(b[20:]),
		ByteCount:  binary.LittleEndian.Uint64(b[24:]),
		Checksum:   binary.LittleEndian.Uint32(b[32:]),
		Flags:      binary.LittleEndian.Uint32(b[36:]),
		TokenCount: binary.LittleEndian.Uint32(b[RecordTokenCountOffset:]),
		LayerCount: binary.LittleEndian.Uint32(b[RecordLayerCountOffset:]),
		Epoch:      binary.LittleEndian.Uint64(b[RecordEpochOffset:]),
		Commit:     binary.LittleEndian.Uint64(b[56:]),
	}, nil
}

// RingMemory is the memory behind a metadata ring. The default is host memory
// from AllocHost; the CUDA package supplies mapped pinned host memory so a GPU
// kernel can poll the commit words (DevicePtr is then the device alias).
type RingMemory interface {
	// Bytes is the ring's memory as seen by the CPU.
	Bytes() []byte
	// DevicePtr is the ring's address for a GPU (0 when not GPU-visible).
	DevicePtr() uintptr
	// Memory describes the ring for Transport.RegisterMemory.
	Memory() transport.Memory
	// Close frees the memory; idempotent.
	Close() error
}

// RingAllocator allocates size bytes of ring memory.
type RingAllocator func(size int) (RingMemory, error)

type hostRing struct{ *transport.HostBuffer }

func (hostRing) DevicePtr() uintptr { return 0 }

// HostRingMemory is the default RingAllocator: AllocHost memory, not GPU-visible.
func HostRingMemory(size int) (RingMemory, error) {
	b, err := transport.AllocHost("meta-ring", int64(size))
	if err != nil {
		return nil, err
	}
	return hostRing{b}, nil
}

// MetaRing is the decode's metadata ring: Slots records of RecordSize bytes.
// Slots are handed to requests with Acquire (which bumps the slot's
// generation and clears its commit word) and returned with Release.
type MetaRing struct {
	mem   RingMemory
	slots int
	mu    sync.Mutex
	free  []int
	gen   []uint64
	// waiters are AcquireWait callers queued for a slot, first come first
	// served: Release hands its slot to the oldest (channel of capacity 1).
	waiters []chan int
}

// NewMetaRing allocates a ring of slots records through alloc
// (HostRingMemory when nil).
func NewMetaRing(slots int, alloc RingAllocator) (*MetaRing, error) {
	if slots <= 0 || slots > 1<<20 {
		return nil, fmt.Errorf("engine: metadata ring: %d slots, want 1..%d", slots, 1<<20)
	}
	if alloc == nil {
		alloc = HostRingMemory
	}
	mem, err := alloc(slots * RecordSize)
	if err != nil {
		return nil, fmt.Errorf("engine: metadata ring: %w", err)
	}
	if len(mem.Bytes()) < slots*RecordSize {
		mem.Close()
		return nil, fmt.Errorf("engine: metadata ring: allocator gave %d bytes, want %d", len(mem.Bytes()), slots*RecordSize)
	}
	r := &MetaRing{mem: mem, slots: slots, gen: make([]uint64, slots)}
	for i := slots - 1; i >= 0; i-- {
		r.free = append(r.free, i)
	}
	return r, nil
}

// Memory describes the ring for Transport.RegisterMemory.
func (r *MetaRing) Memory() transport.Memory { return r.mem.Memory() }

// Slots is the ring size in records.
func (r *MetaRing) Slots() int { return r.slots }

// InUse is the number of slots acquired and not yet released.
func (r *MetaRing) InUse() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.slots - len(r.free)
}

// RingMem returns the ring's memory (for a GPU consumer).
func (r *MetaRing) RingMem() RingMemory { return r.mem }

// ErrRingFull is returned by Acquire when every metadata ring slot is in use.
var ErrRingFull = errors.New("engine: metadata ring full")

// Acquire takes a free slot, bumps its generation (never 0) and clears its
// record; it returns the slot and generation. Errors (wrapping ErrRingFull)
// when every slot is in use or AcquireWait callers are queued for one.
func (r *MetaRing) Acquire() (slot int, gen uint64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.free) == 0 || len(r.waiters) > 0 {
		return 0, 0, fmt.Errorf("%w: all %d slots in use (raise --ring-slots or finish requests)", ErrRingFull, r.slots)
	}
	slot = r.free[len(r.free)-1]
	r.free = r.free[:len(r.free)-1]
	return slot, r.claimLocked(slot), nil
}

// AcquireWait is Acquire that waits, first come first served, for a slot
// to be released while every slot is in use (backpressure: a decode with
// more rooms in flight than ring slots queues the extra rooms instead of
// failing them, issue 18 case 6). It returns ctx's error, wrapped with the
// ring size and ErrRingFull, when ctx ends first.
func (r *MetaRing) AcquireWait(ctx context.Context) (slot int, gen uint64, err error) {
	r.mu.Lock()
	if len(r.free) > 0 && len(r.waiters) == 0 {
		slot = r.free[len(r.free)-1]
		r.free = r.free[:len(r.free)-1]
		gen = r.claimLocked(slot)
		r.mu.Unlock()
		return slot, gen, nil
	}
	ch := make(chan int, 1)
	r.waiters = append(r.waiters, ch)
	r.mu.Unlock()
	select {
	case slot = <-ch:
		r.mu.Lock()
		defer r.mu.Unlock()
		return slot, r.claimLocked(slot), nil
	case <-ctx.Done():
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := slices.Index(r.waiters, ch); i >= 0 {
		r.waiters = slices.Delete(r.waiters, i, i+1)
	} else { // a Release handed us a slot as ctx ended: pass it on
		r.releaseLocked(<-ch)
	}
	return 0, 0, fmt.Errorf("%w (all %d slots held by other rooms): %w", ErrRingFull, r.slots, context.Cause(ctx))
}

// Waiting returns how many AcquireWait callers are queued for a slot.
func (r *MetaRing) Waiting() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.waiters)
}

// claimLocked bumps slot's generation and clears its record (r.mu held).
func (r *MetaRing) claimLocked(slot int) uint64 {
	r.gen[slot]++
	b := r.slotBytes(slot)
	atomic.StoreUint64(r.commitWord(slot), 0)
	clear(b[:RecordCommitOffset])
	return r.gen[slot]
}

// Release returns a slot; its commit word is cleared so a late writer's record
// cannot be mistaken for a later request's. The oldest AcquireWait caller, if
// any, gets it.
func (r *MetaRing) Release(slot int) {
	if slot < 0 || slot >= r.slots {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	atomic.StoreUint64(r.commitWord(slot), 0)
	r.releaseLocked(slot)
}

func (r *MetaRing) releaseLocked(slot int) {
	if len(r.waiters) > 0 {
		ch := r.waiters[0]
		r.waiters = r.waiters[1:]
		ch <- slot
		return
	}
	r.free = append(r.free, slot)
}

func (r *MetaRing) slotBytes(slot int) []byte {
	return r.mem.Bytes()[slot*RecordSize : (slot+1)*RecordSize]
}

func (r *MetaRing) commitWord(slot int) *uint64 {
	return (*uint64)(unsafe.Pointer(&r.mem.Bytes()[slot*RecordSize+RecordCommitOffset]))
}

// Read returns the record in slot. The commit word is loaded atomically first
// and the body after it, so a committed record read here is complete.
func (r *MetaRing) Read(slot int) (MetaRecord, error) {
	if slot < 0 || slot >= r.slots {
		return MetaRecord{}, fmt.Errorf("engine: metadata ring: slot %d not in [0, %d)", slot, r.slots)
	}
	commit := atomic.LoadUint64(r.commitWord(slot))
	var cp [RecordSize]byte
	copy(cp[:], r.slotBytes(slot))
	rec, err := DecodeRecord(cp[:])
	rec.Commit = commit
	return rec, err
}

// Offset returns slot's byte offset inside the ring region.
func (r *MetaRing) Offset(slot int) uint64 { return uint64(slot) * RecordSize }

// Close frees the ring memory; deregister it first.
func (r *MetaRing) Close() error { return r.mem.Close() }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32CTable returns the CRC32C (Castagnoli) table the metadata record's
// checksum uses: crc = crc32.Update(crc, CRC32CTable(), b).
func CRC32CTable() *crc32.Table { return castagnoli }

// CRC32CPath says how CRC32C is computed on this CPU: "hardware (SSE4.2
// CRC32)", "hardware (ARMv8 CRC32)" or "software (slicing-by-8)", decided by
// klauspost/cpuid. hash/crc32 picks the same instructions.
func CRC32CPath() string {
	switch {
	case cpuid.CPU.Supports(cpuid.SSE42):
		return "hardware (SSE4.2 CRC32)"
	case cpuid.CPU.Supports(cpuid.CRC32):
		return "hardware (ARMv8 CRC32)"
	}
	return "software (slicing-by-8)"
}
