// Command kvxfer is the KV-cache transfer engine's command line: the bootstrap
// directory server, prefill and decode roles, the end-to-end demo, the
// benchmark, topology and doctor commands.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/spf13/cobra"
)

// rootCmd is the top-level command; each subcommand adds itself from its own
// file's init so that commands stay independent.
var rootCmd = &cobra.Command{
	Use:           "kvxfer",
	Short:         "KV-cache transfer engine for prefill/decode disaggregated LLM serving",
	SilenceUsage:  true,
	SilenceErrors: true,
	PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
		return setupLogging()
	},
}

var logLevel string

func init() {
	rootCmd.PersistentFlags().StringVar(&logLevel, "log-level", envOr("KVXFER_LOG_LEVEL", "info"), "log level: debug, info, warn, error (env KVXFER_LOG_LEVEL)")
}

func setupLogging() error {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
		return fmt.Errorf("--log-level %q: want debug, info, warn or error", logLevel)
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})))
	return nil
}

// envOr returns the environment variable's value, or def when it is unset or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// bootstrapTokenEnv are the environment variables a rank, the demo and
// `kvxfer bootstrap` read the directory's bearer token from, in order:
// kvxfer's name, then SGLang's (spec §2.8).
var bootstrapTokenEnv = []string{"KVXFER_BOOTSTRAP_AUTH_TOKEN", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"}

// bootstrapToken returns flag when set, else the first non-empty
// bootstrapTokenEnv variable, else "" (no token).
func bootstrapToken(flag string, getenv func(string) string) string {
	return flagOrEnv(flag, getenv, bootstrapTokenEnv)
}

// flagOrEnv returns flag when set, else the first non-empty variable of
// names, else "".
func flagOrEnv(flag string, getenv func(string) string, names []string) string {
	if flag != "" {
		return flag
	}
	for _, name := range names {
		if v := getenv(name); v != "" {
			return v
		}
	}
	return ""
}

// tokenFlagHelp is the help text of --bootstrap-auth-token.
const tokenFlagHelp = "bearer token the bootstrap directory requires on its mutating routes (PUT/DELETE /route, POST /register_dp_rank); " +
	"default: env KVXFER_BOOTSTRAP_AUTH_TOKEN, then SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN (prefer the env: flags show in ps)"

func main() {
	if err := rootCmd.Execute(); err != nil {
		if errors.Is(err, context.Canceled) {
			// Every command's context ends on SIGINT/SIGTERM only; "context
			// canceled" alone tells a user nothing.
			fmt.Fprintf(os.Stderr, "kvxfer: interrupted (SIGINT or SIGTERM); stopped what was running (%v)\n", err)
			os.Exit(130)
		}
		fmt.Fprintln(os.Stderr, "kvxfer:", err)
		if _, stale := err.(errStale); stale {
			os.Exit(3)
		}
		var coded errDoctor
		if errors.As(err, &coded) {
			os.Exit(coded.ExitCode())
		}
		os.Exit(1)
	}
}
