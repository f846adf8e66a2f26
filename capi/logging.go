//go:build cgo

package main

import (
	"log/slog"
	"os"
	"strings"
)

// A library should not chat on its host's stderr: kvxfer's logs (slog) go to
// stderr at level warn unless KVXFER_LOG_LEVEL says debug, info, warn or error.
func init() {
	level := slog.LevelWarn
	switch strings.ToLower(getenv("KVXFER_LOG_LEVEL")) {
	case "debug":
		level = slog.LevelDebug
	case "info":
		level = slog.LevelInfo
	case "error":
		level = slog.LevelError
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
}
