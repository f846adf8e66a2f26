package bench

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxSize is the largest size ParseSize accepts: 1 TiB.
const MaxSize = 1 << 40

// ParseSize parses a byte count up to 1 TiB: a plain integer or one with a
// binary suffix K, M, G, T (KiB, MiB, GiB, TiB; "KB"/"MB"/"GB"/"TB" and
// lower case mean the same). Errors name the text, the limit and the
// accepted forms.
func ParseSize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	u := strings.ToUpper(t)
	u = strings.TrimSuffix(strings.TrimSuffix(u, "IB"), "B")
	mult := uint64(1)
	switch {
	case strings.HasSuffix(u, "K"):
		mult, u = 1<<10, strings.TrimSuffix(u, "K")
	case strings.HasSuffix(u, "M"):
		mult, u = 1<<20, strings.TrimSuffix(u, "M")
	case strings.HasSuffix(u, "G"):
		mult, u = 1<<30, strings.TrimSuffix(u, "G")
	case strings.HasSuffix(u, "T"):
		mult, u = 1<<40, strings.TrimSuffix(u, "T")
	}
	n, err := strconv.ParseUint(u, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("size %q: want a positive whole byte count with an optional K, M, G or T suffix (binary units), e.g. 4096, 4K, 1M, 64MiB", s)
	}
	if n > MaxSize/mult {
		return 0, fmt.Errorf("size %q: the largest size is 1T (1024G, %d bytes)", s, uint64(MaxSize))
	}
	return n * mult, nil
}

// ParseSizes parses a comma-separated list of sizes (see ParseSize).
func ParseSizes(s string) ([]uint64, error) {
	var out []uint64
	for _, f := range strings.Split(s, ",") {
		if strings.TrimSpace(f) == "" {
			continue
		}
		n, err := ParseSize(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("size list %q is empty", s)
	}
	return out, nil
}

// ParseInts parses a comma-separated list of integers in [lo, hi]; what names
// the list in errors.
func ParseInts(s, what string, lo, hi int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < lo || n > hi {
			return nil, fmt.Errorf("%s %q: want integers in %d..%d separated by commas", what, f, lo, hi)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s list %q is empty", what, s)
	}
	return out, nil
}

// FormatSize prints a byte count with the largest exact binary unit
// ("4K", "1M", "64M", "1000").
func FormatSize(n uint64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dG", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return strconv.FormatUint(n, 10)
}
