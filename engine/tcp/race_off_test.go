//go:build !race

package tcp_test

// raceOn: this test binary runs under the race detector (go test -race).
const raceOn = false
