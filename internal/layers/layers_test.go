package layers

import (
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/testenv"
)

const mod = "github.com/kvxfer/kvxfer"

// pkg is the part of `go list -json` the rules read.
type pkg struct {
	ImportPath string
	CgoFiles   []string
	Imports    []string
	Deps       []string
	Module     *struct{ Path string }
}

// list runs `go list -deps -json ./...` at the module root and returns the
// module's own packages by import path.
func list(t *testing.T) map[string]*pkg {
	t.Helper()
	testenv.RequireTool(t, "go", "the layer rules (go list)")
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	// go test caches a result by the files the test itself touches; go
	// list runs in a child process, so stat every source file here to make
	// the cached result stale whenever an import can have changed.
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "build" || d.Name() == "bin" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && (strings.HasSuffix(path, ".go") || d.Name() == "go.mod") {
			_, err = os.Stat(path)
		}
		return err
	})
	if err != nil {
		t.Fatalf("walk the module's sources: %v", err)
	}
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	pkgs := map[string]*pkg{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		pkgs[p.ImportPath] = &p
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list returned %d packages; expected the whole module", len(pkgs))
	}
	return pkgs
}

// short strips the module path.
func short(p string) string {
	if p == mod {
		return "."
	}
	return strings.TrimPrefix(p, mod+"/")
}

// under reports whether import path p is dir or inside it (dir relative to
// the module root).
func under(p, dir string) bool {
	s := short(p)
	return s == dir || strings.HasPrefix(s, dir+"/")
}

// chain returns one import path from p to target through the module's
// packages (for the failure message), or just the two ends.
func chain(pkgs map[string]*pkg, from, target string) string {
	prev := map[string]string{from: ""}
	queue := []string{from}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		if cur == target {
			var path []string
			for c := cur; c != ""; c = prev[c] {
				path = append(path, short(c))
			}
			slices.Reverse(path)
			return strings.Join(path, " → ")
		}
		p := pkgs[cur]
		if p == nil {
			continue
		}
		for _, imp := range p.Imports {
			if _, seen := prev[imp]; !seen {
				prev[imp] = cur
				queue = append(queue, imp)
			}
		}
	}
	return short(from) + " → … → " + short(target)
}

func TestLayerRules(t *testing.T) {
	pkgs := list(t)
	// The module's own packages that the rules name.
	var names []string
	for name := range pkgs {
		names = append(names, name)
	}
	slices.Sort(names)

	// Rule 1: only the cgo bindings and the C ABI import "C".
	cgoAllowed := []string{"ibverbs", "cuda", "capi"}
	for _, name := range names {
		p := pkgs[name]
		if len(p.CgoFiles) == 0 {
			continue
		}
		if !slices.ContainsFunc(cgoAllowed, func(d string) bool { return under(name, d) }) {
			t.Errorf("%s uses cgo (%s): only %v may import \"C\"; put the C call in a binding package", short(name), strings.Join(p.CgoFiles, ", "), cgoAllowed)
		}
	}

	type forbid struct {
		from   string   // package (and the packages under it) the rule holds for
		except []string // packages under from the rule does not cover
		deps   []string // import paths it must not depend on, directly or not, with the packages under them (mod: any of the module's packages but internal/; a trailing "$": that package only, not the ones under it)
		why    string
	}
	rules := []forbid{
		{from: "engine", except: []string{"engine/tcp", "engine/shm", "engine/faulty", "engine/transporttest"},
			deps: []string{mod + "/engine/tcp", mod + "/engine/shm", mod + "/rdma", mod + "/ibverbs"},
			why:  "the engine sees transports only through the Transport interface and the registry"},
		{from: "engine",
			deps: []string{"github.com/labstack/echo", "go.etcd.io/etcd", "github.com/prometheus/client_golang/prometheus/promhttp", mod + "/bootstrap/server", mod + "/metadata", mod + "/cmd", mod + "/bench", mod + "/capi", mod + "/workload"},
			why:  "the library links no HTTP server, etcd client or CLI/harness code; those sit at the edges"},
		{from: "bootstrap", except: []string{"bootstrap/server"},
			deps: []string{mod + "/engine", mod + "/bootstrap/server", "github.com/labstack/echo", "github.com/prometheus/client_golang"},
			why:  "the directory client and types are what ranks link: no engine, no server"},
		{from: "bootstrap/server",
			deps: []string{mod + "/engine"},
			why:  "the directory server knows nothing of transfers"},
		{from: "ibverbs",
			deps: []string{mod},
			why:  "bindings wrap a C library and hold no policy"},
		{from: "cuda", except: []string{"cuda/gputopo", "cuda/gpucheck"},
			deps: []string{mod},
			why:  "bindings wrap a C library and hold no policy"},
		{from: "cuda/gpucheck",
			deps: []string{mod + "/engine", mod + "/bootstrap", mod + "/rdma", mod + "/workload", mod + "/metadata", mod + "/ibverbs"},
			why:  "the GPU proof kernel sits on the cuda binding only"},
		{from: "bench/gpustaging",
			deps: []string{mod + "/engine", mod + "/bootstrap", mod + "/rdma", mod + "/workload", mod + "/metadata", mod + "/ibverbs"},
			why:  "the staging benchmark measures the cuda binding only"},
		{from: "metadata",
			deps: []string{mod + "/bench"},
			why:  "bench tools (the fleet simulation: bench/fleetsim) sit on top of the metadata library, not in it"},
		{from: "cuda/gputopo",
			deps: []string{mod + "/engine", mod + "/bootstrap", mod + "/rdma", mod + "/workload", mod + "/metadata"},
			why:  "GPU topology discovery is a binding helper: no policy"},
		{from: "rdma",
			deps: []string{mod + "/engine/tcp", mod + "/engine/shm", mod + "/metadata", mod + "/workload"},
			why:  "a transport depends on the engine's interface and its binding only"},
		{from: "engine/tcp",
			deps: []string{mod + "/engine/shm", mod + "/rdma", mod + "/ibverbs", mod + "/metadata", mod + "/workload"},
			why:  "a transport depends on the engine's interface only"},
		{from: "engine/shm",
			deps: []string{mod + "/engine/tcp", mod + "/rdma", mod + "/ibverbs", mod + "/metadata", mod + "/workload"},
			why:  "a transport depends on the engine's interface only"},
		// The transport SPI is a leaf; transports and their test tools see
		// only it, never the KV manager, the codec or the segment engine.
		{from: "engine/transport",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", mod + "/engine/kvargs", mod + "/bootstrap",
				"github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why: "the transport SPI is a leaf: no control plane (ZeroMQ, Prometheus, OpenTelemetry, bootstrap client) and no engine"},
		{from: "engine/tcp",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "a transport implements the transport SPI (engine/transport) and links nothing of the control plane"},
		{from: "engine/shm",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "a transport implements the transport SPI (engine/transport) and links nothing of the control plane"},
		{from: "rdma",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "a transport implements the transport SPI (engine/transport) and links nothing of the control plane"},
		{from: "engine/faulty",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4"},
			why:  "the fault-injecting decorator wraps transports through the transport SPI only"},
		{from: "engine/transporttest",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4"},
			why:  "the conformance suite tests transports through the transport SPI only"},
		// The KV arguments are data: no manager, no codec, no control plane.
		{from: "engine/kvargs",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", mod + "/bootstrap", "github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "the KV argument types are data (types, validation, pairing), not the manager"},
		// The codec is the manager's: internal, and below the manager.
		{from: "engine/internal/control",
			deps: []string{mod + "/engine$", mod + "/engine/segengine", "github.com/pebbe/zmq4", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "the control codec encodes and decodes frames; sockets, metrics and spans are the manager's"},
		{from: "engine/segengine",
			deps: []string{mod + "/engine$", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "the segment engine and the KV manager are independent: they share the transport SPI and the codec's frame reader only"},
		{from: "engine/segengine",
			deps: []string{mod + "/engine/agent"},
			why:  "the NIXL-shaped agent sits on top of the segment engine, never below it"},
		{from: "engine/agent",
			deps: []string{mod + "/engine$", "github.com/prometheus", "go.opentelemetry.io"},
			why:  "the agent is built on the segment engine, the transport SPI and the codec's frame reader: no KV manager, no metrics stack"},
		{from: "workload",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4"},
			why:  "workloads lay out buffers (engine/kvargs, engine/transport); they do not link the KV manager"},
		{from: "metadata",
			deps: []string{mod + "/engine$", mod + "/engine/internal", mod + "/engine/segengine", "github.com/pebbe/zmq4"},
			why:  "the metadata store implements transport.SegmentDirectory; it does not link the KV manager or the segment engine"},
	}
	for _, r := range rules {
		matched := 0
		for _, name := range names {
			if !under(name, r.from) || slices.ContainsFunc(r.except, func(e string) bool { return under(name, e) }) {
				continue
			}
			matched++
			for _, dep := range pkgs[name].Deps {
				for _, bad := range r.deps {
					hit := dep == bad || strings.HasPrefix(dep, bad+"/")
					if exact, ok := strings.CutSuffix(bad, "$"); ok {
						hit = dep == exact
					}
					if bad == mod {
						hit = hit && !under(dep, "internal")
					}
					if hit {
						t.Errorf("%s depends on %s (%s): %s", short(name), short(dep), chain(pkgs, name, dep), r.why)
					}
				}
			}
		}
		if matched == 0 {
			t.Errorf("rule for %s matched no package (renamed or moved? update the rule)", r.from)
		}
	}

	// The leaf's whole dependency set: the standard library, golang.org/x/sys
	// and the cuda binding, nothing else (an allowlist, so a new import of
	// any other module or package fails here even if no rule above names it).
	leaf := mod + "/engine/transport"
	if p := pkgs[leaf]; p == nil {
		t.Errorf("%s not found (renamed or moved? update the rule)", short(leaf))
	} else {
		for _, dep := range p.Deps {
			first, _, _ := strings.Cut(dep, "/")
			if !strings.Contains(first, ".") || strings.HasPrefix(dep, "golang.org/x/sys/") || under(dep, "cuda") && !under(dep, "cuda/gputopo") && !under(dep, "cuda/gpucheck") {
				continue
			}
			t.Errorf("%s depends on %s (%s): the transport SPI imports only the standard library, golang.org/x/sys and cuda", short(leaf), short(dep), chain(pkgs, leaf, dep))
		}
	}

	// The request/reply plumbing is ZeroMQ and the standard library only
	// (an allowlist): no frames, no codec, no engine package.
	plumbing := mod + "/engine/internal/zrpc"
	if p := pkgs[plumbing]; p == nil {
		t.Errorf("%s not found (renamed or moved? update the rule)", short(plumbing))
	} else {
		for _, dep := range p.Deps {
			first, _, _ := strings.Cut(dep, "/")
			if !strings.Contains(first, ".") || dep == "github.com/pebbe/zmq4" {
				continue
			}
			t.Errorf("%s depends on %s (%s): the ZeroMQ request/reply plumbing imports only zmq4 and the standard library", short(plumbing), short(dep), chain(pkgs, plumbing, dep))
		}
	}

	// The control codec stays internal to engine/: only engine and the
	// packages under it may import it (Go enforces that for any path under
	// engine/internal; this keeps it there).
	codec := mod + "/engine/internal/control"
	if pkgs[codec] == nil {
		t.Errorf("%s not found: the control codec must stay internal to engine/ (moved out? put it back under engine/internal)", short(codec))
	}
	for _, name := range names {
		if slices.Contains(pkgs[name].Imports, codec) && !under(name, "engine") {
			t.Errorf("%s imports the control codec %s: only engine/ may", short(name), short(codec))
		}
	}

}
