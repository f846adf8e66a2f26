// Package hostmem says how much host memory a process can still allocate,
// so a command refuses a KV pool or a benchmark region that cannot fit at
// once, before it allocates, instead of running the host out of memory.
//
// The figure is the smaller of MemAvailable (/proc/meminfo, the kernel's
// estimate of memory available without swapping) and the headroom under the
// process's memory cgroup limit (cgroup v2 memory.max minus memory.current,
// or v1 memory.limit_in_bytes minus memory.usage_in_bytes) when one is set.
// GPU (device) memory is not counted here.
package hostmem

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// SkipEnv, set to 1, turns Check off (a deliberately overcommitted host, a
// pool that is never all touched).
const SkipEnv = "KVXFER_SKIP_MEMORY_CHECK"

// Limits is what the host offers (bytes).
type Limits struct {
	// MemAvailable is /proc/meminfo's MemAvailable, bytes.
	MemAvailable uint64
	// CgroupMax is the memory cgroup's limit, bytes (0: none set);
	// CgroupFile names the file it was read from.
	CgroupMax  uint64
	CgroupFile string
	// CgroupUsed is the cgroup's current usage, bytes.
	CgroupUsed uint64
}

// Available is what can still be allocated: MemAvailable, or the cgroup's
// headroom when that is smaller.
func (l Limits) Available() uint64 {
	a := l.MemAvailable
	if l.CgroupMax > 0 {
		head := uint64(0)
		if l.CgroupMax > l.CgroupUsed {
			head = l.CgroupMax - l.CgroupUsed
		}
		a = min(a, head)
	}
	return a
}

// String describes the limits for an error message, e.g. "21.3 GiB
// available (MemAvailable in /proc/meminfo); cgroup limit 8.0 GiB
// (/sys/fs/cgroup/memory.max), 1.2 GiB of it in use".
func (l Limits) String() string {
	s := Human(l.MemAvailable) + " available (MemAvailable in /proc/meminfo)"
	if l.CgroupMax > 0 {
		s += fmt.Sprintf("; cgroup limit %s (%s), %s of it in use", Human(l.CgroupMax), l.CgroupFile, Human(l.CgroupUsed))
	}
	return s
}

// Read reads the limits of this process from /proc and /sys/fs/cgroup.
func Read() (Limits, error) { return ReadFrom("/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup") }

// ReadFrom reads the limits from the given meminfo file, /proc/self/cgroup
// file and cgroup mount root (tests pass a fake tree). A missing or
// unlimited cgroup is no limit; an unreadable meminfo is an error.
func ReadFrom(meminfo, selfCgroup, cgroupRoot string) (Limits, error) {
	var l Limits
	b, err := os.ReadFile(meminfo)
	if err != nil {
		return l, fmt.Errorf("hostmem: %w", err)
	}
	avail, ok := parseMeminfo(b, "MemAvailable")
	if !ok {
		return l, fmt.Errorf("hostmem: %s has no MemAvailable line (a kernel older than 3.14?)", meminfo)
	}
	l.MemAvailable = avail
	v2, v1 := cgroupPaths(selfCgroup)
	try := []struct{ max, used string }{
		{filepath.Join(cgroupRoot, v2, "memory.max"), filepath.Join(cgroupRoot, v2, "memory.current")},
		{filepath.Join(cgroupRoot, "memory.max"), filepath.Join(cgroupRoot, "memory.current")},
		{filepath.Join(cgroupRoot, "memory", v1, "memory.limit_in_bytes"), filepath.Join(cgroupRoot, "memory", v1, "memory.usage_in_bytes")},
		{filepath.Join(cgroupRoot, "memory", "memory.limit_in_bytes"), filepath.Join(cgroupRoot, "memory", "memory.usage_in_bytes")},
	}
	for _, c := range try {
		max, ok := readLimit(c.max)
		if !ok {
			continue
		}
		if max > 0 {
			l.CgroupMax, l.CgroupFile = max, c.max
			l.CgroupUsed, _ = readLimit(c.used)
		}
		break
	}
	return l, nil
}

// parseMeminfo returns key's value in bytes from /proc/meminfo text
// ("MemAvailable:   24229624 kB").
func parseMeminfo(b []byte, key string) (uint64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != key {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return 0, false
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		if len(f) > 1 && strings.EqualFold(f[1], "kB") {
			n *= 1024
		}
		return n, true
	}
	return 0, false
}

// cgroupPaths returns this process's cgroup v2 path ("0::PATH") and v1
// memory controller path ("N:memory:PATH") from /proc/self/cgroup.
func cgroupPaths(selfCgroup string) (v2, v1 string) {
	b, err := os.ReadFile(selfCgroup)
	if err != nil {
		return "/", "/"
	}
	v2, v1 = "/", "/"
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "":
			v2 = parts[2]
		case strings.Contains(","+parts[1]+",", ",memory,"):
			v1 = parts[2]
		}
	}
	return v2, v1
}

// readLimit reads a cgroup memory file: ok false when it is absent or
// unreadable; 0 for "max" or a v1 "unlimited" value (>= 2^62).
func readLimit(path string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, true
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, false
	}
	if n >= 1<<62 {
		return 0, true
	}
	return n, true
}

// ErrTooLarge is what a TooLargeError matches with errors.Is.
var ErrTooLarge = errors.New("not enough host memory")

// TooLargeError is Check's refusal: What needs Need bytes, more than
// Limits.Available.
type TooLargeError struct {
	// What names the memory and the flags that size it.
	What string
	// Need is the bytes asked for.
	Need uint64
	// Limits is what the host has.
	Limits Limits
	// Hint says what to do.
	Hint string
}

// Error names what, the bytes needed (human and exact), what the host has,
// the hint and SkipEnv.
func (e *TooLargeError) Error() string {
	return fmt.Sprintf("%s needs %s (%d bytes) of host memory, more than this host has: %s; %s (or set %s=1 to allocate anyway)",
		e.What, Human(e.Need), e.Need, e.Limits, e.Hint, SkipEnv)
}

// Is matches ErrTooLarge.
func (e *TooLargeError) Is(target error) bool { return target == ErrTooLarge }

// Check returns nil when need bytes fit in what this host can still
// allocate (Read), and otherwise a *TooLargeError that names what (e.g.
// "--pool-mb 100000: the KV pool"), the bytes needed, what the host has and
// what to do (hint, e.g. "use a smaller --pool-mb"). It is off when SkipEnv
// is 1, and when the limits cannot be read (not Linux): the allocation then
// fails or succeeds on its own.
func Check(what string, need uint64, hint string) error {
	if os.Getenv(SkipEnv) == "1" {
		return nil
	}
	l, err := Read()
	if err != nil {
		return nil
	}
	return l.Check(what, need, hint)
}

// Check is Check against the limits l.
func (l Limits) Check(what string, need uint64, hint string) error {
	if need <= l.Available() {
		return nil
	}
	return &TooLargeError{What: what, Need: need, Limits: l, Hint: hint}
}

// Human prints a byte count in binary units with one decimal ("97.7 GiB",
// "512.0 MiB", "900 B").
func Human(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
