#!/bin/sh
# rdma-vm-guest.sh — runs INSIDE the Soft-RoCE VM (scripts/rxe-vm.sh), from
# /payload: the ibverbs and rdma test binaries (hardware required: a missing
# device fails instead of skipping), then a bandwidth side-by-side of the
# rdma transport and perftest's ib_write_bw on the same rxe0 (1 MiB messages,
# one QP). Prints the ratio; asserts nothing about speed.
# Env from rxe-vm.sh: RXE_DEV, RXE_GID_IDX. BW_MIB (default 64) sets volume.
export KVXFER_REQUIRE_RDMA=1
rc=0
t0=$(cut -d. -f1 /proc/uptime)
run() { # name, binary, args...
  n=$1; shift
  echo "== $n"
  if "$@" > /tmp/$n.log 2>&1; then
    grep -E '^(    )?--- (PASS|SKIP)|^(PASS|FAIL)$' /tmp/$n.log | sed 's/^/  /'
    grep -E 'leaked|refused as expected|batch [0-9]+: rdma|bad rkey|destroyed QP|moving the QP' /tmp/$n.log | head -8 | sed 's/^/  log: /'
    echo "== $n: PASS ($(grep -c '^--- PASS' /tmp/$n.log) tests, $(grep -c -- '--- PASS' /tmp/$n.log) incl. subtests)"
  else
    grep -E -B3 -A12 -- '--- FAIL|^panic:|timed out' /tmp/$n.log | head -200
    echo "== $n: FAIL"
    rc=1
  fi
}
run ibverbs ./ibverbs.test -test.v -test.timeout=4m
run rdma ./rdma.test -test.v -test.timeout=8m -test.run 'Test[^B]'

BW_MIB=${BW_MIB:-32}
echo "== bandwidth: ib_write_bw vs rdma transport, 1 MiB writes, one QP, $BW_MIB MiB per run, interleaved x2"
ib_run() { # port
  ib_write_bw -d "$RXE_DEV" -x "$RXE_GID_IDX" -F -s 1048576 -n "$BW_MIB" --report_gbits -p $1 > /tmp/srv.log 2>&1 &
  srv=$!
  i=0
  while ! netstat -ltn 2>/dev/null | grep -q ":$1 "; do
    i=$((i + 1)); [ $i -gt 300 ] && break; sleep 0.1
  done
  ib_write_bw -d "$RXE_DEV" -x "$RXE_GID_IDX" -F -s 1048576 -n "$BW_MIB" --report_gbits -p $1 127.0.0.1 > /tmp/cli.log 2>&1
  wait $srv
  awk '$1 == 1048576 {print $4}' /tmp/cli.log | tail -1
}
our_run() {
  KVXFER_RDMA_BW=$BW_MIB ./rdma.test -test.run '^TestBandwidth$' -test.v -test.timeout=4m > /tmp/bw.log 2>&1
  sed -n 's/^KVXFER_BW_GBPS=\([0-9.]*\).*/\1/p' /tmp/bw.log | tail -1
}
refs= ours=
for round in 1 2; do
  r=$(ib_run $((18514 + round))); o=$(our_run)
  echo "round $round: ib_write_bw ${r:-?} Gb/s, kvxfer rdma ${o:-?} Gb/s"
  refs="$refs $r"; ours="$ours $o"
done
set -- $refs; nref=$#
set -- $ours; nours=$#
if [ "$nref" = 2 ] && [ "$nours" = 2 ]; then
  echo "$refs | $ours" | awk -F'|' '{ split($1, a, " "); split($2, b, " ");
    printf "KVXFER_BW_RATIO=%.2f (mean kvxfer rdma / mean ib_write_bw, same rxe0, same boot)\n", (b[1] + b[2]) / (a[1] + a[2]) }'
else
  echo "bandwidth comparison incomplete:"; tail -20 /tmp/cli.log; tail -20 /tmp/bw.log
fi
echo "== guest suite: $(( $(cut -d. -f1 /proc/uptime) - t0 )) s, exit $rc"
exit $rc
