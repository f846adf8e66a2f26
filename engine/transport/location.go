package transport

import (
	"fmt"
	"strconv"
	"strings"
)

// ParseLocation parses a memory location as the CLI's --device and the C
// ABI's kv_location / kvx_register_memory spell it: "" , "host" or "cpu" for
// host memory (device 0), "cuda:N" for CUDA device ordinal N ≥ 0 (PyTorch's
// spelling). Case does not matter. The error names the input and the
// accepted forms.
func ParseLocation(s string) (kind MemoryKind, device int, err error) {
	l := strings.ToLower(strings.TrimSpace(s))
	switch l {
	case "", "host", "cpu":
		return MemoryHost, 0, nil
	}
	if n, ok := strings.CutPrefix(l, "cuda:"); ok {
		d, err := strconv.Atoi(n)
		if err == nil && d >= 0 {
			return MemoryCUDA, d, nil
		}
		return 0, 0, fmt.Errorf("location %q: device ordinal %q is not a non-negative integer (want cuda:N, e.g. cuda:0)", s, n)
	}
	return 0, 0, fmt.Errorf("location %q: want host (or cpu) or cuda:N (N a CUDA device ordinal, e.g. cuda:0)", s)
}
