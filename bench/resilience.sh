#!/usr/bin/env bash
# bench/resilience.sh [KVXFER] — issue 18's operational faults against one
# kvxfer binary (tcp, loopback; ss -K needs root): case 1 (the decode's data
# connections reset between rooms, then 5 rooms 2 s apart), case 5 (the
# prefill fails a room at once, the decode asks 0.3 s later; waiting timeout
# 20 s), case 6 (8 metadata ring slots, 256 rooms in flight at once). Run it
# with an older binary in the same session for the baseline.
set -u
KVX=${1:-kvxfer}
D=$(mktemp -d /tmp/rec.XXXX); cd $D
now() { date +%s%N; }
start_pair() { # $1 extra prefill args, $2 extra decode args
  BP=$((20000 + RANDOM % 20000))
  $KVX bootstrap --port $BP --log-level warn > boot.out 2> boot.err & BPID=$!
  sleep 0.5
  rm -f pin din; mkfifo pin din
  $KVX prefill --bootstrap 127.0.0.1:$BP --transport tcp --pool-mb ${PPOOL:-128} --aux-rows 512 --fill --prefault=false --log-level error $1 < pin > p.out 2> p.err & PP=$!
  exec 7>pin
  $KVX decode --bootstrap 127.0.0.1:$BP --transport tcp --pool-mb ${DPOOL:-256} --aux-rows 512 --prefault=false --waiting-timeout 20s --log-level error $2 < din > d.out 2> d.err & DP=$!
  exec 8>din
  for i in $(seq 1 100); do grep -q ready d.out 2>/dev/null && grep -q ready p.out 2>/dev/null && break; sleep 0.1; done
}
stop_pair() { exec 7>&- 8>&-; wait $DP $PP 2>/dev/null; kill $BPID; wait $BPID 2>/dev/null; }
results() { grep -c '"ok":true' $1; }
waitlines() { for i in $(seq 1 ${3:-600}); do [ $(grep -c '"line"' $1) -ge $2 ] && return; sleep 0.1; done; }
# case 1: ss -K the decode's data connections between rooms; then 5 rooms 2 s apart
start_pair "" ""
echo '{"room":1,"tokens":64}' >&7; echo '{"room":1,"tokens":64}' >&8; waitlines d.out 1
CTRL=$(head -1 d.out | grep -o 'tcp://[^"]*' | head -1 | sed 's/.*://')
for port in $(ss -Hltnp | grep "pid=$DP," | awk '{print $4}' | sed 's/.*://' | sort -u); do
  [ "$port" = "$CTRL" ] && continue
  ss -HK state established "( sport = :$port or dport = :$port )" | grep -vc RTNETLINK > /dev/null
done
T0=$(now)
for r in 2 3 4 5 6; do echo "{\"room\":$r,\"tokens\":64}" >&7; echo "{\"room\":$r,\"tokens\":64}" >&8; waitlines d.out $r 200; [ $r = 2 ] && T1=$(now); sleep 2; done
waitlines p.out 6
echo "case1 idle reset: rooms ok after the reset: decode $(($(results d.out)-1))/5 prefill $(($(results p.out)-1))/5; first room after the reset done $(( (T1-T0)/1000000 )) ms after it"
stop_pair
# case 5: the prefill fails the room at once (pool too small); decode 0.3 s later
PPOOL=32 start_pair "" ""
echo '{"room":1,"tokens":16}' >&7; echo '{"room":1,"tokens":16}' >&8; waitlines d.out 1
echo '{"room":2,"tokens":1024}' >&7; sleep 0.3; T0=$(now); echo '{"room":2,"tokens":1024}' >&8; waitlines d.out 2 400; T1=$(now)
echo "case5 early prefill failure: decode result $(( (T1-T0)/1000000 )) ms after its request (waiting timeout 20 s): $(grep '"line":2' d.out | grep -o '"ok":[a-z]*')"
stop_pair
# case 6: 8 ring slots, 256 rooms of 16 tokens in flight at once
PPOOL=600 DPOOL=600 start_pair "" "--ring-slots 8"
T0=$(now)
for r in $(seq 100 355); do echo "{\"room\":$r,\"tokens\":16}" >&7; done
for r in $(seq 100 355); do echo "{\"room\":$r,\"tokens\":16}" >&8; done
waitlines d.out 256 1800; T1=$(now); waitlines p.out 256 300
echo "case6 8 ring slots, 256 concurrent rooms: decode ok $(results d.out)/256, prefill ok $(results p.out)/256, $(( (T1-T0)/1000000 )) ms"
stop_pair
cd /; rm -rf $D
