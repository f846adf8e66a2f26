#!/bin/sh
# rdma-vm-guest.sh — runs INSIDE the Soft-RoCE VM (scripts/rxe-vm.sh), from
# /payload: the ibverbs and rdma test binaries (hardware required: a missing
# device fails instead of skipping; the rdma conformance suite includes its
# READ cases), then bandwidth side-by-sides of the rdma transport and
# perftest on the same rxe0 (one QP): WRITE against ib_write_bw with 1 MiB
# messages (KVXFER_BW_RATIO) and 4 KiB messages (KVXFER_BW_RATIO_4K, the
# scattered-KV-page shape: 4096 writes per batch), and READ against
# ib_read_bw likewise (KVXFER_READ_BW_RATIO, KVXFER_READ_BW_RATIO_4K).
# Prints the ratios; asserts nothing about speed.
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
ib_run() { # port, message bytes, tool (ib_write_bw, ib_read_bw)
  n=$((BW_MIB * 1048576 / $2))
  $3 -d "$RXE_DEV" -x "$RXE_GID_IDX" -F -s $2 -n $n --report_gbits -p $1 > /tmp/srv.log 2>&1 &
  srv=$!
  i=0
  while ! netstat -ltn 2>/dev/null | grep -q ":$1 "; do
    i=$((i + 1)); [ $i -gt 300 ] && break; sleep 0.1
  done
  $3 -d "$RXE_DEV" -x "$RXE_GID_IDX" -F -s $2 -n $n --report_gbits -p $1 127.0.0.1 > /tmp/cli.log 2>&1
  wait $srv
  awk -v s=$2 '$1 == s {print $4}' /tmp/cli.log | tail -1
}
our_run() { # message bytes, op (write, read)
  KVXFER_RDMA_BW=$BW_MIB KVXFER_RDMA_BW_BLOCK=$1 KVXFER_RDMA_BW_OP=$2 ./rdma.test -test.run '^TestBandwidth$' -test.v -test.timeout=4m > /tmp/bw.log 2>&1
  sed -n 's/^KVXFER_BW_GBPS=\([0-9.]*\).*/\1/p' /tmp/bw.log | tail -1
  grep '^KVXFER_BW_GBPS=' /tmp/bw.log | sed 's/^KVXFER_BW_GBPS=[0-9.]* /  kvxfer: /' >&2
}
# compare SIZE LABEL PORT [OP]: perftest -s SIZE (ib_write_bw, or ib_read_bw
# for OP read) and the transport with SIZE-byte writes (reads) in 16 MiB
# batches, interleaved twice, on the same rxe0 in this boot; prints
# KVXFER_BW_RATIO<LABEL> (KVXFER_READ_BW_RATIO<LABEL>).
compare() {
  size=$1 label=$2 port=$3 op=${4:-write}
  tool=ib_${op}_bw key=KVXFER_BW_RATIO
  [ "$op" = read ] && key=KVXFER_READ_BW_RATIO
  echo "== bandwidth: $tool -s $size vs rdma transport, $size-byte ${op}s, one QP, $BW_MIB MiB per run, interleaved x2"
  refs= ours=
  for round in 1 2; do
    r=$(ib_run $((port + round)) $size $tool); o=$(our_run $size $op)
    echo "round $round: $tool ${r:-?} Gb/s, kvxfer rdma ${o:-?} Gb/s"
    refs="$refs $r"; ours="$ours $o"
  done
  set -- $refs; nref=$#
  set -- $ours; nours=$#
  if [ "$nref" = 2 ] && [ "$nours" = 2 ]; then
    echo "$refs | $ours" | awk -F'|' -v k="$key" -v l="$label" -v s="$size" -v tool="$tool" '{ split($1, a, " "); split($2, b, " ");
      printf "%s%s=%.2f (mean kvxfer rdma / mean %s -s %s, same rxe0, same boot)\n", k, l, (b[1] + b[2]) / (a[1] + a[2]), tool, s }'
  else
    echo "bandwidth comparison incomplete:"; tail -20 /tmp/cli.log; tail -20 /tmp/bw.log
  fi
}
compare 1048576 "" 18514
compare 4096 _4K 18524
compare 1048576 "" 18534 read
compare 4096 _4K 18544 read
echo "== guest suite: $(( $(cut -d. -f1 /proc/uptime) - t0 )) s, exit $rc"
exit $rc
