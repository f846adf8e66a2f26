// Package layers holds no code: its test asserts the module's layer rules
// from `go list` (which packages may use cgo, which may import which), so a
// change that breaks a boundary fails `make test` with the import chain.
package layers
