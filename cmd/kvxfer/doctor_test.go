package main

import (
	"testing"
)

func TestDoctor(t *testing.T) {
	items := runDoctor()
	seen := map[string]doctorItem{}
	for _, it := range items {
		seen[it.Component] = it
		if it.Status != "ok" && it.Status != "missing" && it.Status != "error" {
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
	if seen["libzmq"].Status != "ok" {
		t.Errorf("libzmq: %+v", seen["libzmq"])
	}
}
