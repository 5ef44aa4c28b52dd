#!/usr/bin/env bash
# Runs every benchmark with its default settings, one after another, each only once the machine is
# quiet: 1-minute load average below $MAX_LOAD and the CPUs at least $MIN_IDLE % idle over 10 s (the
# load average lags; the idle share sees a job that just started). Waits at most $MAX_WAIT_S per
# benchmark; after that it runs anyway and the load it started at is in its output.
# Logs: bench/out/<name>.log.
#
#   bash bench/run_all.sh                         # all four
#   bash bench/run_all.sh control_plane startup   # a subset, in this order
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MAX_LOAD="${MAX_LOAD:-1.5}"
MAX_WAIT_S="${MAX_WAIT_S:-1800}"
MIN_IDLE="${MIN_IDLE:-85}"
PY="${PYTHON:-python}"
mkdir -p "$HERE/out"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(control_plane startup serving throughput)

idle_pct() {  # share of CPU time idle over the next 10 seconds
  local a b
  a=($(head -1 /proc/stat))
  sleep 10
  b=($(head -1 /proc/stat))
  local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$(( total + b[i] - a[i] )); done
  echo $(( 100 * idle / (total > 0 ? total : 1) ))
}

wait_quiet() {
  local waited=0
  while :; do
    local load idle
    load=$(cut -d' ' -f1 /proc/loadavg)
    idle=$(idle_pct)
    waited=$((waited + 10))
    if awk -v l="$load" -v m="$MAX_LOAD" 'BEGIN { exit !(l < m) }' && [ "$idle" -ge "$MIN_IDLE" ]; then
      echo "load $load < $MAX_LOAD, ${idle}% idle, after ${waited}s"
      return 0
    fi
    if [ "$waited" -ge "$MAX_WAIT_S" ]; then
      echo "load still $load (${idle}% idle) after ${waited}s: running anyway (NOISY)"
      return 0
    fi
    sleep 5
    waited=$((waited + 5))
  done
}

for name in "${names[@]}"; do
  extra=()
  [ "$name" = control_plane ] && extra=(--py-spy)
  wait_quiet
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $name (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  "$PY" "$HERE/$name.py" "${extra[@]}" > "$HERE/out/$name.log" 2>&1
  echo "   exit $? -> bench/out/$name.log"
done
