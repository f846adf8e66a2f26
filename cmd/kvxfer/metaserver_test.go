package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestRunMetaServer: the command prints its URL once it listens, serves
// Mooncake's routes there, and stops with its context.
func TestRunMetaServer(t *testing.T) {
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runMetaServer(ctx, metaServerFlags{host: "127.0.0.1", port: 0, maxValue: 1 << 20, maxKeys: 10, maxMemory: 1 << 24}, pw)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, pr)
	url := strings.TrimSpace(strings.TrimPrefix(line, "metadata server listening on "))
	if !strings.HasPrefix(url, "http://127.0.0.1:") || !strings.HasSuffix(url, "/metadata") {
		t.Fatalf("line %q", line)
	}
	req, _ := http.NewRequest(http.MethodPut, url+"?key=k", strings.NewReader("v"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("PUT: %v %v", resp, err)
	}
	resp.Body.Close()
	resp, err = http.Get(url + "?key=k")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "v" {
		t.Fatalf("GET: %d %q", resp.StatusCode, b)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("did not stop")
	}
	if err := runMetaServer(context.Background(), metaServerFlags{port: 70000, maxValue: 1, maxKeys: 1, maxMemory: 1}, io.Discard); err == nil || !strings.Contains(err.Error(), "--port") {
		t.Fatalf("bad port: %v", err)
	}
}
