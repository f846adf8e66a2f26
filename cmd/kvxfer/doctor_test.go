package main

import (
	"strings"
	"testing"
)

func TestDoctor(t *testing.T) {
	items := runDoctor()
	seen := map[string]doctorItem{}
	for _, it := range items {
		seen[it.Component] = it
		switch it.Status {
		case "ok", "warn", "missing", "n/a", "error":
		default:
			t.Errorf("%s: status %q", it.Component, it.Status)
		}
		if it.Detail == "" {
			t.Errorf("%s: no detail", it.Component)
		}
	}
	for _, c := range []string{"libzmq", "libibverbs", "RDMA NICs", "CUDA", "NVML", "memlock limit"} {
		if _, ok := seen[c]; !ok {
			t.Errorf("doctor lacks %q: %+v", c, items)
		}
	}
	if it := seen["libibverbs"]; it.Status == "missing" && strings.Contains(it.Detail, "library loaded") {
		t.Errorf("libibverbs: a loaded library is not missing: %+v", it)
	}
	if seen["libzmq"].Status != "ok" {
		t.Errorf("libzmq: %+v", seen["libzmq"])
	}
}
