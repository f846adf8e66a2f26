package ibverbs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestGIDText(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"::ffff:10.11.12.1", "::ffff:10.11.12.1"},
		{"fe80:0000:0000:0000:327e:a2ff:fe7e:4a76", "fe80::327e:a2ff:fe7e:4a76"},
		{"2001:db8::1", "2001:db8::1"},
	} {
		g, err := ParseGID(tc.in)
		if err != nil || g.String() != tc.want {
			t.Errorf("ParseGID(%q) = %v, %v; want %s", tc.in, g, err, tc.want)
		}
	}
	if _, err := ParseGID("not-a-gid"); err == nil {
		t.Error("ParseGID accepted garbage")
	}
	if !(GID{}).IsZero() {
		t.Error("zero GID not zero")
	}
}

func TestMTUAndTypes(t *testing.T) {
	for m, want := range map[MTU]int{MTU256: 256, MTU1024: 1024, MTU4096: 4096, 0: 0, 9: 0} {
		if m.Bytes() != want {
			t.Errorf("MTU(%d).Bytes() = %d, want %d", m, m.Bytes(), want)
		}
	}
	for in, want := range map[string]GIDType{"RoCE v2\n": GIDTypeRoCEv2, "IB/RoCE v1": GIDTypeIB, "": GIDTypeUnknown} {
		if got := ParseGIDType(in); got != want {
			t.Errorf("ParseGIDType(%q) = %v", in, got)
		}
	}
	root := t.TempDir()
	dir := filepath.Join(root, "class/infiniband/mlx5_0/ports/1/gid_attrs/types")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "3"), []byte("RoCE v2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if ty, err := SysfsGIDType(root, "mlx5_0", 1, 3); err != nil || ty != GIDTypeRoCEv2 {
		t.Errorf("SysfsGIDType = %v, %v", ty, err)
	}
	if _, err := SysfsGIDType(root, "mlx5_0", 1, 4); err == nil {
		t.Error("missing GID type read without error")
	}
}

func TestWCErr(t *testing.T) {
	ok := WC{Status: WCSuccess}
	if ok.Err() != nil {
		t.Fatal("success WC has an error")
	}
	bad := WC{WRID: 9, Status: WCRemAccessErr, QPNum: 17}
	if err := bad.Err(); err == nil || err.Error() != "ibverbs: completion error on QP 17, wr_id 9: remote access error (status 10, vendor_err 0x0)" {
		t.Fatalf("WCError text = %v", err)
	}
}

// TestErrorForms: an errno failure reads as strerror and matches the errno;
// ibv_poll_cq's negative return is not an errno and never reads as one.
func TestErrorForms(t *testing.T) {
	e := &Error{Op: "ibv_reg_mr", Errno: syscall.ENOMEM}
	if !errors.Is(e, syscall.ENOMEM) || !errors.Is(e, ErrOutOfMemory) || !strings.Contains(e.Error(), "errno 12") {
		t.Fatalf("errno form: %v", e)
	}
	p := &Error{Op: "ibv_poll_cq", Ret: -2}
	if msg := p.Error(); !strings.Contains(msg, "returned -2") || strings.Contains(msg, "errno") && !strings.Contains(msg, "not an errno") {
		t.Fatalf("poll form: %q", msg)
	}
	if errors.Is(p, syscall.Errno(2)) || errors.Unwrap(p) != nil {
		t.Fatalf("poll failure unwraps to an errno: %v", errors.Unwrap(p))
	}
}

// TestCheckSendWR: PostSend refuses an RDMA READ it cannot run with a
// *WRError wrapping EINVAL that names the WR, before posting anything;
// other WRs pass the check.
func TestCheckSendWR(t *testing.T) {
	for _, c := range []struct {
		wr   SendWR
		want string // "" = accepted
	}{
		{SendWR{Opcode: OpRDMARead, Flags: SendSignaled}, ""},
		{SendWR{Opcode: OpRDMARead, Flags: SendInline}, "inline"},
		{SendWR{Opcode: OpRDMARead, Flags: SendSolicited | SendSignaled}, "solicited"},
		{SendWR{Opcode: OpRDMAWrite, Flags: SendInline}, ""},
		{SendWR{Opcode: OpSend, Flags: SendSolicited}, ""},
	} {
		err := checkSendWR(3, &c.wr)
		if c.want == "" {
			if err != nil {
				t.Errorf("%+v: %v, want accepted", c.wr, err)
			}
			continue
		}
		var we *WRError
		if !errors.As(err, &we) || we.Index != 3 || !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want a *WRError for WR 3 wrapping EINVAL about %q", c.wr, err, c.want)
		}
	}
	q := &QP{}
	if n, err := q.PostSend([]SendWR{{Opcode: OpRDMAWrite}, {Opcode: OpRDMARead, Flags: SendInline}}); n != 0 || !errors.As(err, new(*WRError)) {
		t.Errorf("PostSend of a chain with a bad READ: %d accepted, %v; want 0 and a *WRError", n, err)
	}
}
