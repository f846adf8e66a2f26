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
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("go command not on PATH: %v", err)
	}
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
		deps   []string // import paths it must not depend on, directly or not, with the packages under them (mod: any of the module's packages but internal/)
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
}
