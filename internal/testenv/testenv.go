// Package testenv holds what the module's tests need from their
// environment, so that each gate and fixture exists once: gates that skip a
// test with the reason when a tool or device is missing (and fail instead
// where the environment promises it: KVXFER_REQUIRE_GPU on the GPU
// machine, KVXFER_REQUIRE_RDMA inside `make test-rdma`), and small loopback
// fixtures. It is imported by _test.go files only.
package testenv

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
)

// SilentListener accepts TCP connections on a free loopback port and never
// answers (a hung peer, or something that is not a kvxfer peer); it and
// its connections are closed when the test ends.
func SilentListener(tb testing.TB) net.Listener {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	return ln
}

// DeadPort returns a loopback TCP port that refuses connections and that no
// other socket can take while the test runs: it stays bound, never
// listening, until the test ends. A port freed by closing a listener goes
// back to the pool: on a loaded machine running tests in parallel another
// process's listener took it within the test (seen: EVENT_CONNECTED to a
// "dead" prefill whose new owner never answered, reported silent, not
// unreachable).
func DeadPort(tb testing.TB) int {
	tb.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		tb.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		tb.Fatal(err)
	}
	return sa.(*syscall.SockaddrInet4).Port
}

// Skip skips tb with the reason (format and args), unless the environment
// variable requireVar is set (not empty): there the environment promises
// what the test needs (KVXFER_REQUIRE_GPU on the GPU machine,
// KVXFER_REQUIRE_RDMA inside `make test-rdma`), so a skip would hide a
// broken probe, and it fails instead.
func Skip(tb testing.TB, requireVar, format string, args ...any) {
	tb.Helper()
	msg := fmt.Sprintf(format, args...)
	if v := os.Getenv(requireVar); v != "" {
		tb.Fatalf("%s=%q promises it, but: %s", requireVar, v, msg)
	}
	tb.Skipf("%s (set %s=1 to fail instead)", msg, requireVar)
}

// Require is the gate of a test that needs a device or library: nil err
// returns; an err wrapping missing (cuda.ErrNotSupported,
// transport.ErrUnavailable: the environment lacks it) skips with err and
// hint, as Skip does (failing where requireVar is set); any other err (the
// probe itself failed) is fatal.
func Require(tb testing.TB, requireVar string, err, missing error, hint string) {
	tb.Helper()
	switch {
	case err == nil:
	case errors.Is(err, missing) && hint != "":
		Skip(tb, requireVar, "%v (%s)", err, hint)
	case errors.Is(err, missing):
		Skip(tb, requireVar, "%v", err)
	default:
		tb.Fatalf("probe failed (an error not wrapping %q): %v", missing, err)
	}
}

// RequireTool returns the path of the named program, skipping tb when it is
// not installed (a tool, not a promised device: never a failure); why says
// what needs it.
func RequireTool(tb testing.TB, name, why string) string {
	tb.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		tb.Skipf("%s needs %s: %v", why, name, err)
	}
	return p
}

// FakeCUDA is a fake CUDA runtime and driver built from cuda/testdata
// (device memory is host memory there, and the driver runs the proof
// kernel's logic on the CPU), for tests of the CUDA paths on machines
// without a GPU. NVRTC names a library that does not exist.
type FakeCUDA struct {
	Runtime, Driver, NVRTC string
}

// BuildFakeCUDA compiles cuda/testdata's fake_cudart.c (with the -D flags
// rtDefines) and fake_cuda.c (drvDefines) with gcc into a temporary
// directory of tb. It skips when gcc is not installed (a tool, not a GPU
// gate: the lent GPU machine has none) and fails when a build fails.
func BuildFakeCUDA(tb testing.TB, rtDefines, drvDefines []string) FakeCUDA {
	tb.Helper()
	gcc := RequireTool(tb, "gcc", "the fake CUDA libraries")
	_, file, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "..", "..", "cuda", "testdata")
	dir := tb.TempDir()
	f := FakeCUDA{Runtime: filepath.Join(dir, "libcudart.so.13"), Driver: filepath.Join(dir, "libcuda.so.1"), NVRTC: filepath.Join(dir, "no-libnvrtc.so")}
	for _, b := range []struct {
		src, out string
		defines  []string
	}{{"fake_cudart.c", f.Runtime, rtDefines}, {"fake_cuda.c", f.Driver, drvDefines}} {
		args := append([]string{"-shared", "-fPIC", "-o", b.out, filepath.Join(src, b.src)}, b.defines...)
		if out, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
			tb.Fatalf("gcc %v: %v\n%s", args, err, out)
		}
	}
	return f
}

// Env is the environment that makes a kvxfer process (cmd/, capi/) load
// the fake libraries: KVXFER_CUDART, KVXFER_LIBCUDA and KVXFER_NVRTC.
func (f FakeCUDA) Env() []string {
	return []string{"KVXFER_CUDART=" + f.Runtime, "KVXFER_LIBCUDA=" + f.Driver, "KVXFER_NVRTC=" + f.NVRTC}
}

// Load makes this process use the fake libraries (cuda.Close, then
// cuda.Load with their paths) until tb ends, when they are unloaded. It
// skips without cgo (cuda.ErrNoCgo). (testenv imports cuda, so the cuda
// package's own tests use it from package cuda_test.)
func (f FakeCUDA) Load(tb testing.TB) {
	tb.Helper()
	cuda.Close()
	if err := cuda.Load(cuda.WithLibraryPath(f.Runtime), cuda.WithDriverPath(f.Driver), cuda.WithNVRTCPath(f.NVRTC)); err != nil {
		if errors.Is(err, cuda.ErrNoCgo) {
			tb.Skip(err)
		}
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cuda.Close() })
}

// InFakeCUDAProcess runs check with the fake CUDA libraries loaded from a
// process started with their environment (FakeCUDA.Env), for code that
// picks its CUDA path when the process starts (the tcp transport's device
// copier). Called from test testName, it runs the test binary again with
// only that test and childVar=1 set and fails when the child does not
// pass; in the child it loads the libraries the environment names and
// runs check. It skips when gcc is not installed (BuildFakeCUDA).
func InFakeCUDAProcess(t *testing.T, childVar, testName string, check func(t *testing.T)) {
	t.Helper()
	if os.Getenv(childVar) == "" {
		fake := BuildFakeCUDA(t, nil, nil)
		cmd := exec.Command(os.Args[0], "-test.run=^"+testName+"$", "-test.count=1", "-test.v")
		cmd.Env = append(append(os.Environ(), fake.Env()...), childVar+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: "+testName) {
			t.Fatalf("the test with the fake CUDA libraries: %v\n%s", err, out)
		}
		return
	}
	cuda.Close()
	if err := cuda.Load(); err != nil {
		t.Fatalf("load the fake CUDA libraries named by the environment: %v", err)
	}
	t.Cleanup(func() { cuda.Close() })
	check(t)
}

// RequireGPU loads the real CUDA libraries for tb (unloaded when it ends):
// the gate of a test that needs a GPU, skipping without one unless
// KVXFER_REQUIRE_GPU is set (Require).
func RequireGPU(tb testing.TB) {
	tb.Helper()
	cuda.Close() // drop any fake library a previous test loaded
	err := cuda.Load()
	Require(tb, "KVXFER_REQUIRE_GPU", err, cuda.ErrNotSupported, "no usable GPU")
	tb.Cleanup(func() { cuda.Close() })
}
