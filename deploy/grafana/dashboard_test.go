// Package grafana holds the Grafana dashboard for kvxfer's metrics
// (kvxfer.json); its test checks every query against the metrics the engine
// and the bootstrap directory really export.
package grafana_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
)

type dashboard struct {
	Title  string  `json:"title"`
	UID    string  `json:"uid"`
	Panels []panel `json:"panels"`
}

type panel struct {
	Type    string `json:"type"`
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// directoryMetrics scrapes a bootstrap server's /metrics and returns its
// kvxfer_bootstrap_* family names with their label names.
func directoryMetrics(t *testing.T) map[string][]string {
	t.Helper()
	srv := server.New(server.Options{Host: "127.0.0.1", Logger: slog.New(slog.DiscardHandler)})
	rec := httptest.NewRecorder()
	srv.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	out := map[string][]string{}
	series := regexp.MustCompile(`(?m)^(kvxfer_bootstrap_[a-z0-9_]+)(?:\{([^}]*)\})? `)
	for _, m := range series.FindAllStringSubmatch(string(body), -1) {
		var labels []string
		for _, kv := range strings.Split(m[2], ",") {
			if k, _, ok := strings.Cut(kv, "="); ok {
				labels = append(labels, k)
			}
		}
		out[m[1]] = labels
	}
	if len(out) == 0 {
		t.Fatalf("the bootstrap server exports no kvxfer_bootstrap_* series:\n%s", body)
	}
	return out
}

var (
	metricRe   = regexp.MustCompile(`\b(kvxfer_[a-z0-9_]+)(\{[^}]*\})?`)
	matcherRe  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	byClauseRe = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
)

// targetLabels are labels Prometheus adds to every scraped series.
var targetLabels = []string{"job", "instance"}

// TestDashboardQueriesExportedMetrics: every metric kvxfer.json queries is
// one the engine (engine.MetricNames, the names it registers) or the
// bootstrap directory (scraped from a live server) exports, histogram
// suffixes only on histograms, and every label it selects or groups by is
// one of those metrics' labels.
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	b, err := os.ReadFile("kvxfer.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("kvxfer.json is not valid JSON: %v", err)
	}
	if d.Title == "" || d.UID == "" {
		t.Fatalf("dashboard without title or uid")
	}
	dir := directoryMetrics(t)
	used := map[string]bool{}
	queries := 0
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			queries++
			ms := metricRe.FindAllStringSubmatch(tg.Expr, -1)
			if len(ms) == 0 {
				t.Errorf("panel %q: query %q names no kvxfer metric", p.Title, tg.Expr)
			}
			labelsOfExpr := slices.Clone(targetLabels)
			for _, m := range ms {
				name, sel := m[1], m[2]
				base, labels, ok := resolve(name, dir)
				if !ok {
					t.Errorf("panel %q: %s is not exported by the engine or the bootstrap directory (query %q)", p.Title, name, tg.Expr)
					continue
				}
				used[base] = true
				labels = append(labels, targetLabels...)
				if strings.HasSuffix(name, "_bucket") {
					labels = append(labels, "le")
				}
				labelsOfExpr = append(labelsOfExpr, labels...)
				for _, lm := range matcherRe.FindAllStringSubmatch(sel, -1) {
					if !slices.Contains(labels, lm[1]) {
						t.Errorf("panel %q: %s has no label %q (it has %v)", p.Title, name, lm[1], labels)
					}
				}
			}
			for _, by := range byClauseRe.FindAllStringSubmatch(tg.Expr, -1) {
				for _, l := range strings.Split(by[1], ",") {
					if l = strings.TrimSpace(l); l != "" && !slices.Contains(labelsOfExpr, l) {
						t.Errorf("panel %q: groups by %q, which no metric of %q has", p.Title, l, tg.Expr)
					}
				}
			}
		}
	}
	if queries < 10 {
		t.Errorf("only %d queries", queries)
	}
	// Every engine metric is on the dashboard.
	for _, n := range engine.MetricNames() {
		if !used[n] {
			t.Errorf("engine metric %s is on no panel", n)
		}
	}
}

// resolve maps a queried name to its exported family (stripping the
// histogram suffixes of engine histograms) and that family's labels.
func resolve(name string, dir map[string][]string) (string, []string, bool) {
	if ls, ok := dir[name]; ok {
		return name, ls, true
	}
	if engine.MetricKind(name) != "" {
		if engine.MetricKind(name) == "histogram" {
			return name, nil, false // a histogram is queried by _bucket, _sum or _count
		}
		return name, engine.MetricLabels(name), true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok && engine.MetricKind(base) == "histogram" {
			return base, engine.MetricLabels(base), true
		}
	}
	return name, nil, false
}

// TestJobPickerListsRanksAndDirectories: the $job variable lists the jobs of
// a metric family every rank exports from its start (a gauge of the
// engine) and of one the bootstrap directory exports, so a directory
// scraped under a job of its own can be picked (it used to list only the
// jobs with kvxfer_rooms_total, which a directory never has).
func TestJobPickerListsRanksAndDirectories(t *testing.T) {
	b, err := os.ReadFile("kvxfer.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	var def string
	for _, v := range d.Templating.List {
		if v.Name == "job" {
			def = v.Definition
		}
	}
	m := regexp.MustCompile(`^label_values\(\{__name__=~"([^"]+)"\}, job\)$`).FindStringSubmatch(def)
	if m == nil {
		t.Fatalf("$job query %q: want label_values({__name__=~\"a|b\"}, job)", def)
	}
	dir := directoryMetrics(t)
	var engineGauge, directory bool
	for _, name := range strings.Split(m[1], "|") {
		if _, ok := dir[name]; ok {
			directory = true
		} else if engine.MetricKind(name) == "gauge" {
			engineGauge = true
		} else {
			t.Errorf("$job query names %s, which neither the directory nor the engine (as a gauge) exports", name)
		}
	}
	if !engineGauge || !directory {
		t.Fatalf("$job query %q: want an engine gauge (every rank has it from its start) and a directory metric", def)
	}
}
