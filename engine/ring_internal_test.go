package engine

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
)

func TestRecordRoundTrip(t *testing.T) {
	r := MetaRecord{Room: 0, Generation: 5, PageCount: 3, Producer: 2, ByteCount: 1 << 33, Checksum: 0xdeadbeef, Flags: RecordFlagChecksum,
		TokenCount: 45, LayerCount: 61, Epoch: 1<<40 + 3}
	b := make([]byte, RecordSize)
	r.EncodeBody(b)
	got, err := DecodeRecord(b)
	if err != nil || got.Committed() {
		t.Fatalf("uncommitted record: %+v %v", got, err)
	}
	r.EncodeCommit(b)
	got, err = DecodeRecord(b)
	r.Commit = RecordCommitMagic ^ 5
	if err != nil || !got.Committed() || got != r {
		t.Fatalf("got %+v %v, want %+v", got, err, r)
	}
	if b[RecordTokenCountOffset] != 45 || b[RecordLayerCountOffset] != 61 || b[RecordEpochOffset] != 3 || b[RecordEpochOffset+5] != 1 {
		t.Fatalf("token_count/layer_count/epoch not at their documented offsets: % x", b)
	}
	r.Flags |= RecordFlagLayerwise
	r.EncodeBody(b)
	if got, err := DecodeRecord(b); err != nil || got.Flags != RecordFlagChecksum|RecordFlagLayerwise || !got.HasChecksum() {
		t.Fatalf("layer-wise flag: %+v %v", got, err)
	}
	b[36] |= 4
	if _, err := DecodeRecord(b); err == nil || !strings.Contains(err.Error(), "unknown bits 0x4") {
		t.Fatalf("unknown flag bit accepted: %v", err)
	}
	if _, err := DecodeRecord(b[:63]); err == nil {
		t.Fatal("short record accepted")
	}
}

func TestMetaRing(t *testing.T) {
	r, err := NewMetaRing(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s0, g0, _ := r.Acquire()
	s1, _, _ := r.Acquire()
	if _, _, err := r.Acquire(); err == nil {
		t.Fatal("third slot of a 2-slot ring")
	}
	rec := MetaRecord{Room: 9, Generation: g0}
	b := r.mem.Bytes()[r.Offset(s0):]
	rec.EncodeBody(b)
	rec.EncodeCommit(b)
	got, err := r.Read(s0)
	if err != nil || !got.Committed() || got.Room != 9 {
		t.Fatalf("read %+v %v", got, err)
	}
	r.Release(s0)
	s2, g2, _ := r.Acquire()
	got, _ = r.Read(s2)
	if s2 != s0 || g2 == g0 || got.Committed() {
		t.Fatalf("reacquired slot %d gen %d (old %d) committed %v: a stale record must not look committed", s2, g2, g0, got.Committed())
	}
	_ = s1
	if _, err := r.Read(5); err == nil {
		t.Fatal("read outside the ring")
	}
}

func FuzzDecodeRecord(f *testing.F) {
	b := make([]byte, RecordSize)
	r := MetaRecord{Room: 3, Generation: 1, PageCount: 2}
	r.EncodeBody(b)
	r.EncodeCommit(b)
	f.Add(b)
	lw := make([]byte, RecordSize)
	r = MetaRecord{Room: 1 << 62, Generation: 9, PageCount: 256, Producer: 3, ByteCount: 1 << 30, Flags: RecordFlagLayerwise | RecordFlagChecksum, TokenCount: 4096, LayerCount: 80, Epoch: 7}
	r.EncodeBody(lw)
	r.EncodeCommit(lw)
	f.Add(lw)
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, err := DecodeRecord(b)
		if err != nil {
			return
		}
		out := make([]byte, RecordSize)
		rec.EncodeBody(out)
		if !bytes.Equal(out[:RecordCommitOffset], b[:RecordCommitOffset]) {
			t.Fatalf("record body does not re-encode")
		}
		if rec.Committed() != (rec.Commit == RecordCommitMagic^rec.Generation) {
			t.Fatal("Committed disagrees with the commit word")
		}
		if rec.Flags&^recordFlagsKnown != 0 {
			t.Fatalf("flags %#x with unknown bits decoded", rec.Flags)
		}
		if rec.LayerCount != binary.LittleEndian.Uint32(b[RecordLayerCountOffset:]) {
			t.Fatal("layer_count not read from its offset")
		}
	})
}
