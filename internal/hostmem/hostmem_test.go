package hostmem

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, path, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

const meminfo = "MemTotal:       24683584 kB\nMemFree:        23386868 kB\nMemAvailable:   1048576 kB\nBuffers:           27376 kB\n"

// TestReadFrom: MemAvailable in bytes; the cgroup limit of cgroup v2 (the
// process's own path, then the root) or v1, "max" and v1's near-2^63
// "unlimited" meaning none.
func TestReadFrom(t *testing.T) {
	cases := []struct {
		name      string
		selfCg    string
		files     map[string]string
		wantMax   uint64
		wantUsed  uint64
		wantAvail uint64
		wantFile  string
	}{
		{name: "no cgroup files", selfCg: "0::/\n", wantAvail: 1 << 30},
		{name: "v2 root max", selfCg: "0::/\n", files: map[string]string{"memory.max": "max\n", "memory.current": "5\n"}, wantAvail: 1 << 30},
		{name: "v2 own path", selfCg: "0::/job/a\n", files: map[string]string{"job/a/memory.max": "536870912\n", "job/a/memory.current": "134217728\n"},
			wantMax: 512 << 20, wantUsed: 128 << 20, wantAvail: 384 << 20, wantFile: "job/a/memory.max"},
		{name: "v2 limit above MemAvailable", selfCg: "0::/\n", files: map[string]string{"memory.max": "4294967296\n", "memory.current": "0\n"},
			wantMax: 4 << 30, wantAvail: 1 << 30, wantFile: "memory.max"},
		{name: "v1 unlimited", selfCg: "4:memory:/x\n0::/\n", files: map[string]string{"memory/x/memory.limit_in_bytes": "9223372036854771712\n"}, wantAvail: 1 << 30},
		{name: "v1 limited", selfCg: "4:memory:/x\n0::/\n", files: map[string]string{"memory/x/memory.limit_in_bytes": "268435456\n", "memory/x/memory.usage_in_bytes": "300000000\n"},
			wantMax: 256 << 20, wantUsed: 300000000, wantAvail: 0, wantFile: "memory/x/memory.limit_in_bytes"},
		{name: "v1 cpu,memory controller list", selfCg: "4:cpu,memory:/y\n", files: map[string]string{"memory/y/memory.limit_in_bytes": "1024\n"},
			wantMax: 1024, wantAvail: 1024, wantFile: "memory/y/memory.limit_in_bytes"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			write(t, filepath.Join(dir, "meminfo"), meminfo)
			write(t, filepath.Join(dir, "cgroup"), c.selfCg)
			root := filepath.Join(dir, "sys")
			for p, v := range c.files {
				write(t, filepath.Join(root, p), v)
			}
			l, err := ReadFrom(filepath.Join(dir, "meminfo"), filepath.Join(dir, "cgroup"), root)
			if err != nil {
				t.Fatal(err)
			}
			if l.MemAvailable != 1<<30 || l.CgroupMax != c.wantMax || l.CgroupUsed != c.wantUsed || l.Available() != c.wantAvail {
				t.Fatalf("%+v (available %d), want max %d used %d available %d", l, l.Available(), c.wantMax, c.wantUsed, c.wantAvail)
			}
			if c.wantFile != "" && l.CgroupFile != filepath.Join(root, c.wantFile) {
				t.Fatalf("cgroup file %q, want %q", l.CgroupFile, filepath.Join(root, c.wantFile))
			}
		})
	}
}

func TestReadFromBadMeminfo(t *testing.T) {
	dir := t.TempDir()
	write(t, filepath.Join(dir, "meminfo"), "MemTotal: 1 kB\n")
	if _, err := ReadFrom(filepath.Join(dir, "meminfo"), filepath.Join(dir, "none"), dir); err == nil || !strings.Contains(err.Error(), "MemAvailable") {
		t.Fatalf("err %v, want one naming MemAvailable", err)
	}
	if _, err := ReadFrom(filepath.Join(dir, "missing"), "", dir); err == nil {
		t.Fatal("missing meminfo: no error")
	}
}

// TestCheck: what fits passes; what does not names what, the bytes needed
// (both forms), what the host has (and the cgroup), the hint and the way
// out.
func TestCheck(t *testing.T) {
	l := Limits{MemAvailable: 1 << 30}
	if err := l.Check("x", 1<<30, "hint"); err != nil {
		t.Fatal(err)
	}
	err := l.Check("--pool-mb 100000: the KV pool", 100000<<20, "use a smaller --pool-mb")
	for _, want := range []string{"--pool-mb 100000: the KV pool", "97.7 GiB", "104857600000 bytes", "1.0 GiB available (MemAvailable in /proc/meminfo)", "use a smaller --pool-mb", SkipEnv + "=1"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("err %v, want it to contain %q", err, want)
		}
	}
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("err %v does not wrap ErrTooLarge", err)
	}
	l = Limits{MemAvailable: 8 << 30, CgroupMax: 2 << 30, CgroupUsed: 1 << 30, CgroupFile: "/sys/fs/cgroup/memory.max"}
	err = l.Check("region", 3<<30, "h")
	if err == nil || !strings.Contains(err.Error(), "cgroup limit 2.0 GiB (/sys/fs/cgroup/memory.max), 1.0 GiB of it in use") {
		t.Fatalf("err %v, want the cgroup named", err)
	}
}

func TestHuman(t *testing.T) {
	for n, want := range map[uint64]string{0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 100000 << 20: "97.7 GiB", 1 << 40: "1.0 TiB"} {
		if got := Human(n); got != want {
			t.Errorf("Human(%d) = %q, want %q", n, got, want)
		}
	}
}
