package main

// The transports compiled into libkvxfer.so (each registers itself with the
// engine registry from init).
import (
	_ "github.com/kvxfer/kvxfer/engine/tcp"
)
