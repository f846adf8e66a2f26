package rdma

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/ibverbs"
)

// TestRegDeviceFallback checks regDevice's choice between a dma-buf MR and a
// plain (peer-memory) MR with the CUDA export and both verbs calls replaced:
// no GPU or NIC is needed.
func TestRegDeviceFallback(t *testing.T) {
	exportErr := errors.New("cuMemGetHandleForAddressRange: not supported")
	dmaMR, plainMR := &ibverbs.MR{}, &ibverbs.MR{}
	const base = uintptr(0x7f00_0000_0000)
	type calls struct {
		export, dmaReg, plainReg int
		dmaOffset, dmaIOVA       uint64
		plainAddr                uintptr
		closedFD                 bool
	}
	cases := []struct {
		name      string
		off, n    uint64
		exportErr error
		dmaErr    error
		plainErr  error
		wantMR    *ibverbs.MR
		want      calls
		wantErrIs []error
	}{
		{name: "dma-buf works", off: 0, n: 1 << 20,
			wantMR: dmaMR, want: calls{export: 1, dmaReg: 1, dmaOffset: 0, dmaIOVA: uint64(base), closedFD: true}},
		{name: "unaligned chunk keeps the in-buffer offset", off: 4096*3 + 100, n: 5000,
			wantMR: dmaMR, want: calls{export: 1, dmaReg: 1, dmaOffset: 100, dmaIOVA: uint64(base) + 4096*3 + 100, closedFD: true}},
		{name: "export fails, peer memory works", off: 64, n: 4096, exportErr: exportErr,
			wantMR: plainMR, want: calls{export: 1, plainReg: 1, plainAddr: base + 64}},
		{name: "dma-buf MR fails, peer memory works", off: 0, n: 4096, dmaErr: syscall.EOPNOTSUPP,
			wantMR: plainMR, want: calls{export: 1, dmaReg: 1, plainReg: 1, dmaIOVA: uint64(base), plainAddr: base, closedFD: true}},
		{name: "both fail after export", off: 8, n: 4096, dmaErr: syscall.EOPNOTSUPP, plainErr: syscall.EFAULT,
			want:      calls{export: 1, dmaReg: 1, plainReg: 1, dmaOffset: 8, dmaIOVA: uint64(base) + 8, plainAddr: base + 8, closedFD: true},
			wantErrIs: []error{transport.ErrUnsupportedMemory, syscall.EOPNOTSUPP, syscall.EFAULT}},
		{name: "export and peer memory fail", off: 0, n: 4096, exportErr: exportErr, plainErr: syscall.EINVAL,
			want:      calls{export: 1, plainReg: 1, plainAddr: base},
			wantErrIs: []error{transport.ErrUnsupportedMemory, exportErr, syscall.EINVAL}},
	}
	saved := [3]any{dmaBufRange, regDmaBufMR, regMR}
	defer func() {
		dmaBufRange = saved[0].(func(uintptr, uint64) (int, uint64, error))
		regDmaBufMR = saved[1].(func(*ibverbs.PD, uint64, uint64, uint64, int, ibverbs.Access) (*ibverbs.MR, error))
		regMR = saved[2].(func(*ibverbs.PD, uintptr, uint64, ibverbs.Access) (*ibverbs.MR, error))
	}()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got calls
			fd := -1
			dmaBufRange = func(ptr uintptr, size uint64) (int, uint64, error) {
				got.export++
				if tc.exportErr != nil {
					return -1, 0, tc.exportErr
				}
				// A real fd, so the test sees regDevice close it.
				r, w, err := os.Pipe()
				if err != nil {
					t.Fatal(err)
				}
				w.Close()
				f, err := syscall.Dup(int(r.Fd()))
				r.Close()
				if err != nil {
					t.Fatal(err)
				}
				fd = f
				return f, uint64(ptr) % 4096, nil
			}
			regDmaBufMR = func(_ *ibverbs.PD, offset, length, iova uint64, f int, _ ibverbs.Access) (*ibverbs.MR, error) {
				got.dmaReg++
				got.dmaOffset, got.dmaIOVA = offset, iova
				if f != fd || length != tc.n {
					t.Errorf("ibv_reg_dmabuf_mr(fd %d, len %d); want fd %d, len %d", f, length, fd, tc.n)
				}
				if tc.dmaErr != nil {
					return nil, tc.dmaErr
				}
				return dmaMR, nil
			}
			regMR = func(_ *ibverbs.PD, addr uintptr, length uint64, _ ibverbs.Access) (*ibverbs.MR, error) {
				got.plainReg++
				got.plainAddr = addr
				if length != tc.n {
					t.Errorf("ibv_reg_mr length %d; want %d", length, tc.n)
				}
				if tc.plainErr != nil {
					return nil, tc.plainErr
				}
				return plainMR, nil
			}
			m := transport.Memory{Addr: base, Length: 1 << 30, Kind: transport.MemoryCUDA, Device: 3, FD: -1}
			mr, err := regDevice(nil, "mlx5_7", m, tc.off, tc.n)
			if fd >= 0 {
				_, ferr := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
				got.closedFD = errors.Is(ferr, syscall.EBADF)
				if !got.closedFD {
					syscall.Close(fd)
				}
			}
			if got != tc.want {
				t.Errorf("calls %+v; want %+v", got, tc.want)
			}
			if tc.wantErrIs == nil {
				if err != nil || mr != tc.wantMR {
					t.Fatalf("regDevice = %p, %v; want %p", mr, err, tc.wantMR)
				}
				return
			}
			if mr != nil || err == nil {
				t.Fatalf("regDevice = %p, %v; want an error", mr, err)
			}
			for _, target := range tc.wantErrIs {
				if !errors.Is(err, target) {
					t.Errorf("error %q does not wrap %v", err, target)
				}
			}
			msg := err.Error()
			for _, want := range []string{"mlx5_7", "cuda:3", "+4096", "dma-buf MR failed", "plain MR (peer memory) failed", "nvidia-peermem", "dma-buf support"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error %q does not mention %q", msg, want)
				}
			}
			// RegisterMemory's hint must not be appended a second time.
			if h := regHint(err, transport.MemoryCUDA); h.Error() != msg {
				t.Errorf("regHint changed a device registration error: %q", h)
			}
		})
	}
}
