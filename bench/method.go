package bench

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/klauspost/cpuid/v2"
	"golang.org/x/sys/unix"
)

// Method records how and where a run was made: enough to reproduce it and to
// judge its numbers.
type Method struct {
	Date     string `json:"date"`
	Hostname string `json:"hostname"`
	// CPU fields come from klauspost/cpuid.
	CPUModel      string   `json:"cpu_model"`
	CPUVendor     string   `json:"cpu_vendor"`
	PhysicalCores int      `json:"physical_cores"`
	LogicalCores  int      `json:"logical_cores"`
	CPUFeatures   []string `json:"cpu_features"`
	L1DBytes      int      `json:"l1d_bytes"`
	L2Bytes       int      `json:"l2_bytes"`
	L3Bytes       int      `json:"l3_bytes"`
	GOMAXPROCS    int      `json:"gomaxprocs"`
	// LoadAvg is /proc/loadavg's 1, 5 and 15 minute averages at the start
	// and LoadAvgEnd at the end of the run: other work on the machine moves
	// every figure (LoadWarning).
	LoadAvg    string `json:"load_avg,omitempty"`
	LoadAvgEnd string `json:"load_avg_end,omitempty"`
	// CPUs is the CPUs this process may run on (runtime.NumCPU), what
	// LoadWarning compares the load with.
	CPUs int `json:"cpus,omitempty"`
	// Kernel is uname's release and version.
	Kernel    string `json:"kernel"`
	GoVersion string `json:"go_version"`
	// Revision is the VCS revision the binary was built from (with "+dirty"
	// when the tree had changes), or, when the build recorded none, git's
	// HEAD in the working directory.
	Revision string `json:"revision,omitempty"`
	// Modules maps the engine's key dependencies to their versions.
	Modules map[string]string `json:"modules,omitempty"`
	// PeerVersions maps each peer tool to its version line.
	PeerVersions map[string]string `json:"peer_versions,omitempty"`
	// CommandLine is the exact command that produced the report.
	CommandLine string `json:"command_line"`
	// Config is the resolved matrix and knobs.
	Config Config `json:"config"`
	// Notes explain choices (units, what latency means, how peers ran).
	Notes []string `json:"notes"`
}

// CollectMethod fills a Method for cfg.
func CollectMethod(cfg Config) Method {
	m := Method{
		Date:          time.Now().UTC().Format(time.RFC3339),
		CPUModel:      cpuid.CPU.BrandName,
		CPUVendor:     cpuid.CPU.VendorString,
		PhysicalCores: cpuid.CPU.PhysicalCores,
		LogicalCores:  cpuid.CPU.LogicalCores,
		CPUFeatures:   cpuid.CPU.FeatureSet(),
		L1DBytes:      cpuid.CPU.Cache.L1D,
		L2Bytes:       cpuid.CPU.Cache.L2,
		L3Bytes:       cpuid.CPU.Cache.L3,
		GOMAXPROCS:    runtime.GOMAXPROCS(0),
		CPUs:          runtime.NumCPU(),
		GoVersion:     runtime.Version(),
		CommandLine:   strings.Join(os.Args, " "),
		Config:        cfg,
		Modules:       map[string]string{},
		PeerVersions:  map[string]string{},
		Notes: []string{
			"GB/s = 1e9 bytes/s of payload; ucx_perftest MB/s (2^20 bytes/s) and iperf3 bits/s are converted",
			"each repetition: untimed source refill, timed region (submit/wait with `inflight` batches outstanding), untimed byte-for-byte verification of the whole region",
			"latency is per batch: Submit to Wait returning, including queueing behind other in-flight batches",
			"memcpy baseline: one goroutine copying the same block size over the same buffers as the case, one memcpy repetition of the same duration right after each transport repetition; the x memcpy ratio is the median of the per-repetition ratios",
			"peers run on loopback with the same block sizes, right after kvxfer's cases at that size (block-major order); each ratio is kvxfer's best configuration at that block size over the peer",
		},
	}
	m.Hostname, _ = os.Hostname()
	m.LoadAvg = ReadLoadAvg()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Version[:])
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		var rev, dirty string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = "+dirty"
				}
			}
		}
		if rev != "" {
			m.Revision = rev + dirty
		}
		for _, d := range bi.Deps {
			switch d.Path {
			case "golang.org/x/sys", "github.com/klauspost/cpuid/v2", "gonum.org/v1/plot", "github.com/pebbe/zmq4":
				m.Modules[d.Path] = d.Version
			}
		}
	}
	if m.Revision == "" {
		// Built with -buildvcs=false: ask git about the working directory.
		if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
			m.Revision = strings.TrimSpace(string(out)) + " (git in the working directory)"
		}
	}
	return m
}

// ReadLoadAvg returns /proc/loadavg's 1, 5 and 15 minute load averages
// ("1.92 2.21 2.99"), or "" where there is none.
func ReadLoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// LoadWarning says, when the 1-minute load average at the start or the end
// of the run exceeded the machine's CPUs, that other work competed for them
// and the figures are noisy ("" otherwise, or when either is unknown).
func (m Method) LoadWarning() string {
	load, at, cpus := m.loadExcess()
	if at == "" {
		return ""
	}
	return fmt.Sprintf("load average %.2f at the %s of the run exceeds the %d CPUs: other work competed for them, so figures and ratios are noisy; rerun on a quiet machine", load, at, cpus)
}

// loadExcess returns the highest 1-minute load average of the run's start
// and end and which it was, when it exceeds the CPUs (at "" otherwise).
func (m Method) loadExcess() (load float64, at string, cpus int) {
	cpus = m.CPUs
	if cpus <= 0 {
		cpus = m.LogicalCores
	}
	if cpus <= 0 {
		return 0, "", 0
	}
	for _, l := range []struct{ v, when string }{{m.LoadAvg, "start"}, {m.LoadAvgEnd, "end"}} {
		f := strings.Fields(l.v)
		if len(f) == 0 {
			continue
		}
		if x, err := strconv.ParseFloat(f[0], 64); err == nil && x > load {
			load, at = x, l.when
		}
	}
	if load <= float64(cpus) {
		return load, "", cpus
	}
	return load, at, cpus
}

// toolVersion returns the first non-empty line of `tool args...` (stdout and
// stderr), or "" when the tool is not installed.
func toolVersion(tool string, args ...string) string {
	if _, err := exec.LookPath(tool); err != nil {
		return ""
	}
	out, _ := exec.Command(tool, args...).CombinedOutput()
	for _, l := range strings.Split(string(out), "\n") {
		l = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), "#"))
		if l != "" {
			return l
		}
	}
	return ""
}
