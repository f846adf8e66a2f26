#!/bin/bash
# demo-ab.sh: same-run A/B(/C...) comparison of kvxfer binaries on the main job,
# `kvxfer demo --concurrency 1`. Runs are interleaved (round 1: A, B, ...;
# round 2: A, B, ...) per transport, so every binary sees the same machine load;
# compare medians per transport and binary, not single runs.
#
# usage: scripts/demo-ab.sh BIN_A BIN_B [BIN_C ...] > out.tsv
#   env: ROUNDS (3), REQ (10 requests), POOL (512 MiB per rank), SEED (42),
#        TRANSPORTS ("shm tcp"), PYTHON (python3; only its json module is used),
#        A_ARGS, B_ARGS, C_ARGS, ... extra demo flags per binary, e.g.
#        B_ARGS="--prefix-cache-mb 0 --prefault=false --bench=false" runs a
#        newer binary the way an older one ran (no prefix reuse, no prefault,
#        no bench after the requests)
#
# One TSV line per run on stdout (a header first):
#   transport label round load1 ok|FAIL transfer_GBps warm_GBps goodput_GBps
#   p50_ms first_ms bytes verified cpu_s
# transfer_GBps: the demo's "per request" figure, verified bytes / Σ per-request
# transfer time (prefill Send -> Success), the figure issue #11 names;
# warm_GBps: the same without the first request (which pays first-touch page
# faults of fresh memory, hundreds of ms on a VM); first_ms: that request's
# transfer time; cpu_s: user+sys CPU seconds of the whole demo (all processes).
# A failed run prints FAIL and "-" for the figures; its log is kept in $KEEP
# (a directory) when set.
#
# Build a baseline binary from an older commit, e.g. the one before caller-owned
# buffers (issue #11):
#   mkdir -p /tmp/base && git archive dcb08b4^ | tar -x -C /tmp/base &&
#     (cd /tmp/base && go build -o /tmp/kvxfer-base ./cmd/kvxfer)
#   scripts/demo-ab.sh /tmp/kvxfer-base bin/kvxfer > ab.tsv
# then the runs per transport and binary, sorted by transfer_GBps (take the
# middle line of each group, or ratios of the same round):
#   awk -F'\t' 'NR>1 && $5=="ok"' ab.tsv | sort -t$'\t' -k1,1 -k2,2 -k6,6n
# bench/RESULTS.md (issue #11 section) has a full example and its figures.
set -u
if [ $# -lt 2 ]; then
	echo "usage: $0 BIN_A BIN_B [BIN_C ...] > out.tsv (see the header of $0 for the environment)" >&2
	exit 2
fi
labels=(A B C D E F G H)
if [ $# -gt ${#labels[@]} ]; then
	echo "$0: at most ${#labels[@]} binaries" >&2
	exit 2
fi
bins=("$@")
for b in "${bins[@]}"; do
	if [ ! -x "$b" ]; then
		echo "$0: $b is not an executable kvxfer binary" >&2
		exit 2
	fi
done
ROUNDS=${ROUNDS:-3} REQ=${REQ:-10} POOL=${POOL:-512} SEED=${SEED:-42}
PYTHON=${PYTHON:-python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf 'transport\tlabel\tround\tload1\tok\ttransfer_GBps\twarm_GBps\tgoodput_GBps\tp50_ms\tfirst_ms\tbytes\tverified\tcpu_s\n'
for t in ${TRANSPORTS:-shm tcp}; do
	for r in $(seq 1 "$ROUNDS"); do
		for i in "${!bins[@]}"; do
			v=${labels[$i]}
			args_var=${v}_ARGS
			load=$(cut -d' ' -f1 /proc/loadavg)
			ok=ok
			rm -f "$dir/r.json"
			TIMEFORMAT="%U %S"
			# shellcheck disable=SC2086 # the extra flags are meant to split
			{ time "${bins[$i]}" demo --concurrency 1 --pool-mb "$POOL" --requests "$REQ" --seed "$SEED" \
				--transport "$t" --no-progress --json "$dir/r.json" ${!args_var:-} >"$dir/log" 2>&1; } 2>"$dir/cpu" || ok=FAIL
			cpu=$(awk '{print $1+$2}' "$dir/cpu")
			line=$("$PYTHON" -c '
import json, sys
d = json.load(open(sys.argv[1]))
s, rq = d["summary"], d["requests"]
# "transfer_gbps" until issue #16 split it into aggregate and per-request
gbps = s.get("per_request_transfer_gbps", s.get("transfer_gbps"))
ok = [q for q in rq if q.get("ok")]
warm = ok[1:]
wg = sum(q["bytes"] for q in warm) / (sum(q["transfer_ms"] for q in warm) / 1e3) / 1e9 if warm else 0
first = ok[0]["transfer_ms"] if ok else 0
print("%.3f\t%.3f\t%.3f\t%.1f\t%.1f\t%d\t%d" % (gbps, wg, s["goodput_gbps"],
      s["transfer_latency_p50_ms"], first, s["bytes"], s["verified"]))' "$dir/r.json" 2>/dev/null) || line=""
			if [ -z "$line" ]; then
				ok=FAIL
				line=$(printf -- '-\t-\t-\t-\t-\t-\t-')
			fi
			if [ "$ok" = FAIL ] && [ -n "${KEEP:-}" ]; then
				mkdir -p "$KEEP" && cp "$dir/log" "$KEEP/$t-$v-$r.log"
			fi
			printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$v" "$r" "$load" "$ok" "$line" "$cpu"
		done
	done
done
