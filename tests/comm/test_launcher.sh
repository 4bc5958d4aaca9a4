#!/usr/bin/env bash
# tools/squeeze-launch on trivial commands (ctest comm.launcher, label comm; no GPU):
#   every rank gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/NCCL_NVLS_ENABLE and its output is
#   prefixed; --port is passed through; one failing rank fails the launch with its status and the others
#   are killed after the grace period; --timeout kills a hanging rank, names it and exits 124; all ranks
#   exiting 77 gives 77 (ctest skip), a mix of 0 and 77 does not; bad usage exits 2.
# usage: test_launcher.sh path/to/squeeze-launch
set -u
L=${1:?usage: test_launcher.sh path/to/squeeze-launch}
fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }
now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $((t / 1000)); }
out=$(mktemp) err=$(mktemp) dir=$(mktemp -d)
trap 'rm -rf "$out" "$err" "$dir"' EXIT
export PIDDIR=$dir  # ranks that should be killed write their pid here
gone() {  # gone r...: the processes whose pids ranks r... wrote no longer exist
  local r pid
  for r in "$@"; do
    pid=$(cat "$PIDDIR/pid.$r" 2>/dev/null) || { bad "rank $r wrote no pid"; continue; }
    if kill -0 "$pid" 2>/dev/null; then bad "rank $r (pid $pid) still runs"; kill -9 "$pid"; else ok "rank $r (pid $pid) is gone"; fi
  done
  rm -f "$PIDDIR"/pid.*
}

# 1. Environment of every rank, output prefixes (stdout and stderr), one MASTER_PORT shared by all ranks.
"$L" --nproc 3 -- bash -c 'echo "env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE"; echo "to stderr $RANK" >&2' >"$out" 2>"$err"
rc=$?
((rc == 0)) && ok "3 ranks exit 0 -> 0" || bad "3 ranks exit 0 -> $rc"
port=""
for r in 0 1 2; do
  line=$(grep "^\[rank $r\] env " "$out")
  if [[ "$line" =~ ^\[rank\ $r\]\ env\ $r\ $r\ 3\ 3\ 127\.0\.0\.1\ ([0-9]+)\ 0$ ]]; then
    p=${BASH_REMATCH[1]}
    ((p >= 1 && p <= 65535)) || bad "rank $r: MASTER_PORT $p is not a port"
    [[ -z "$port" || "$port" == "$p" ]] || bad "rank $r: MASTER_PORT $p differs from $port"
    port=$p
    ok "rank $r environment: $line"
  else
    bad "rank $r environment line: '$line'"
  fi
  grep -qx "\[rank $r\] to stderr $r" "$out" && ok "rank $r stderr prefixed" || bad "rank $r stderr line missing"
done
[[ $(grep -c . "$out") == 6 ]] || bad "expected 6 output lines, got: $(cat "$out")"

# 2. --port and a caller's NCCL_NVLS_ENABLE pass through.
"$L" --nproc 2 --port 31234 -- bash -c 'echo "port $MASTER_PORT"' >"$out" 2>"$err"
[[ $(grep -c '^\[rank [01]\] port 31234$' "$out") == 2 ]] && ok "--port 31234" || bad "--port: $(cat "$out")"
NCCL_NVLS_ENABLE=1 "$L" --nproc 1 -- bash -c 'echo "nvls $NCCL_NVLS_ENABLE"' >"$out" 2>"$err"
grep -qx '\[rank 0\] nvls 1' "$out" && ok "caller's NCCL_NVLS_ENABLE kept" || bad "NCCL_NVLS_ENABLE: $(cat "$out")"

# 3. One rank fails: its status comes back, the others (sleeping 60 s) are killed after the grace period.
t=$(now_ms)
"$L" --nproc 3 --grace 1 -- bash -c 'if [ "$RANK" = 1 ]; then exit 3; fi; echo $$ >"$PIDDIR/pid.$RANK"; sleep 60; echo "rank $RANK was not killed"' >"$out" 2>"$err"
rc=$? dt=$(($(now_ms) - t))
((rc == 3)) && ok "failing rank's status 3 propagates" || bad "failing rank: exit $rc, expected 3"
((dt < 15000)) && ok "other ranks killed after the grace period (${dt} ms)" || bad "took ${dt} ms: the sleeping ranks were not killed"
grep -q "rank 1 exited with status 3" "$err" && ok "the failing rank is named" || bad "stderr does not name rank 1: $(cat "$err")"
grep -q "was not killed" "$out" && bad "a rank ran to the end"
gone 0 2

# 4. A hanging rank: --timeout kills it, names it and exits 124; the finished rank's output is kept.
t=$(now_ms)
"$L" --nproc 2 --timeout 2 -- bash -c 'if [ "$RANK" = 1 ]; then echo $$ >"$PIDDIR/pid.1"; sleep 60; fi; echo "finished $RANK"' >"$out" 2>"$err"
rc=$? dt=$(($(now_ms) - t))
((rc == 124)) && ok "timeout -> 124" || bad "timeout: exit $rc, expected 124"
((dt < 15000)) && ok "timeout returned after ${dt} ms" || bad "timeout took ${dt} ms"
grep -q "timeout after 2 s; still running, killed: rank 1 " "$err" && ok "the hanging rank is named" || bad "stderr: $(cat "$err")"
grep -q "rank 0 (pid" "$err" && bad "rank 0 (finished) named as running"
grep -qx '\[rank 0\] finished 0' "$out" && ok "finished rank's output kept" || bad "output: $(cat "$out")"
gone 1

# 5. Skip code: every rank 77 -> 77; 0 and 77 mixed -> a failure that is not 77.
"$L" --nproc 3 -- bash -c 'exit 77' >"$out" 2>"$err"
rc=$?
((rc == 77)) && ok "all ranks 77 -> 77 (skip)" || bad "all 77: exit $rc"
"$L" --nproc 2 -- bash -c 'exit $((RANK * 77))' >"$out" 2>"$err"
rc=$?
((rc != 0 && rc != 77)) && ok "ranks 0 and 77 -> $rc (a failure)" || bad "mixed 0/77: exit $rc"
"$L" --nproc 2 -- bash -c 'if [ "$RANK" = 0 ]; then exit 77; fi; exit 5' >"$out" 2>"$err"
rc=$?
((rc == 5)) && ok "ranks 77 and 5 -> 5" || bad "mixed 77/5: exit $rc"

# 6. A rank killed by a signal: 128 + signal.
"$L" --nproc 2 -- bash -c 'if [ "$RANK" = 1 ]; then kill -9 $$; fi' >"$out" 2>"$err"
rc=$?
((rc == 137)) && ok "SIGKILLed rank -> 137" || bad "killed rank: exit $rc"

# 7. Bad usage: exit 2 with a message.
for args in "--nproc 0 -- true" "--nproc 2" "--nproc x -- true" "--nproc 2 --timeout 0 -- true" "--port 70000 --nproc 1 -- true" "--bogus -- true"; do
  # shellcheck disable=SC2086
  "$L" $args >"$out" 2>"$err"
  rc=$?
  ((rc == 2)) && grep -q "squeeze-launch:" "$err" && ok "bad usage '$args' -> 2" || bad "bad usage '$args': exit $rc, stderr $(cat "$err")"
done

if ((fails)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all launcher checks passed"
