package agent

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestMetadataRoundTrip(t *testing.T) {
	m := Metadata{Name: "prefill-0", Instance: 0xdeadbeef12345678, Control: "127.0.0.1:5001", Segment: "[::1]:5002", Transport: "tcp"}
	got, err := DecodeMetadata(m.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if got != m {
		t.Fatalf("round trip: got %+v, want %+v", got, m)
	}
}

func TestDecodeMetadataErrors(t *testing.T) {
	good := Metadata{Name: "a", Instance: 1, Control: "h:1", Segment: "h:2", Transport: "tcp"}.Encode()
	mod := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	cases := []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, "shorter than the 20-byte header"},
		{"pickle", []byte("\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x04name\x94\x94\x94."), "magic"},
		{"version", mod(func(b []byte) []byte { b[8] = 9; return b }), "version 9"},
		{"reserved", mod(func(b []byte) []byte { b[10] = 1; return b }), "reserved"},
		{"truncated", good[:len(good)-1], "bytes, only"},
		{"trailing", append(append([]byte(nil), good...), 0), "after the last field"},
		{"empty name", Metadata{Instance: 1, Control: "h:1", Segment: "h:2", Transport: "tcp"}.Encode(), "name is 0 bytes"},
		{"long name", Metadata{Name: strings.Repeat("n", MaxNameBytes+1), Control: "h:1", Segment: "h:2", Transport: "tcp"}.Encode(), "name is 257 bytes"},
		{"bad control", Metadata{Name: "a", Control: "nohostport", Segment: "h:2", Transport: "tcp"}.Encode(), "control address"},
		{"bad utf8", Metadata{Name: "\xff", Control: "h:1", Segment: "h:2", Transport: "tcp"}.Encode(), "not UTF-8"},
		{"huge", bytes.Repeat([]byte{1}, MaxMetadataBytes+1), "longer than"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeMetadata(c.in)
			if !errors.Is(err, ErrBadMetadata) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("DecodeMetadata: %v, want ErrBadMetadata mentioning %q", err, c.want)
			}
		})
	}
}

// FuzzDecodeMetadata: metadata comes from another process over whatever
// side channel the serving engine uses; no input may panic, and what
// decodes re-encodes to the same bytes.
func FuzzDecodeMetadata(f *testing.F) {
	f.Add(Metadata{Name: "a", Instance: 7, Control: "127.0.0.1:1", Segment: "127.0.0.1:2", Transport: "tcp"}.Encode())
	f.Add([]byte("KVXAGENT"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMetadata(b)
		if err != nil {
			if !errors.Is(err, ErrBadMetadata) {
				t.Fatalf("error does not wrap ErrBadMetadata: %v", err)
			}
			return
		}
		if !bytes.Equal(m.Encode(), b) {
			t.Fatalf("decoded %+v re-encodes differently", m)
		}
	})
}
