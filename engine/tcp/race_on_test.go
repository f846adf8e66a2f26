//go:build race

package tcp_test

// raceOn: this test binary runs under the race detector (go test -race),
// where a byte moved costs several times its plain cost.
const raceOn = true
