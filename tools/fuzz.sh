#!/usr/bin/env bash
# Builds the fuzz preset (clang-19, libFuzzer + ASan + UBSan) and runs every harness of fuzz/ for
# SECONDS each on a scratch copy of its seed corpus (fuzz/corpus/NAME), with its dictionary
# (fuzz/dict/NAME.dict) when there is one. Fails on any finding (crash, sanitizer report, non-kiln
# exception, timeout, out-of-memory); the input is left in build-fuzz/findings/NAME/. Files named
# crash-* in a corpus are known findings not fixed yet: kept out of the run until fixed, then renamed,
# so every seed corpus doubles as the harness's regression test (each run starts by executing it).
# Usage: bash tools/fuzz.sh [SECONDS] [HARNESS...]     (default: 30 s each, every harness)
#        KILN_FUZZ_JOBS=N runs N harnesses at once (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
shift || true

# ccache shares objects between worktrees and clean clones (same relative paths under /work).
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$PWD")}" CCACHE_NOHASHDIR=1
fi
command -v clang++-19 >/dev/null || bash tools/bootstrap.sh fuzz  # installs clang-19 and libFuzzer
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz

harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  for dir in fuzz/corpus/*/; do harnesses+=("$(basename "$dir")"); done
fi

work=build-fuzz/fuzz-run
findings=build-fuzz/findings
rm -rf "$work" "$findings"
mkdir -p "$work" "$findings"

run_one() {
  local name="$1" bin="build-fuzz/fuzz/fuzz_$1" log="$work/$1.log"
  local corpus="$work/$1.corpus" dict=()
  mkdir -p "$corpus" "$findings/$name"
  cp -r "fuzz/corpus/$name/." "$corpus/"
  rm -f "$corpus"/crash-*
  [ -f "fuzz/dict/$name.dict" ] && dict=("-dict=fuzz/dict/$name.dict")
  # -timeout: one input may take at most 10 s; -rss_limit_mb: or 2 GB. Findings go to findings/NAME.
  if "$bin" "$corpus" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$findings/$name/" >"$log" 2>&1; then
    status=ok
  else
    status=FINDING
  fi
  echo "$status" >"$work/$name.status"
  # libFuzzer's last status line: "#N  DONE  cov: C ft: F corp: ..."; the stats say execs.
  local execs cov ft
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo '?')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo '?')
  printf '%-24s %-8s execs %-10s cov %-6s ft %s\n' "$name" "$status" "$execs" "$cov" "$ft"
  if [ "$status" != ok ]; then
    grep -m1 -B2 -A25 'ERROR: \|fuzz: \|==ERROR\|runtime error\|deadly signal\|Timeout\|out-of-memory' "$log" >&2 || tail -40 "$log" >&2
    ls "$findings/$name" >&2
  fi
}

# The harnesses write each input to a file (the loaders take paths): in memory (/dev/shm) a run does
# about 20x the executions of one on a busy disk.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
# ASan records the call stack of every allocation so that a report can say where the memory came
# from; the harnesses allocate in small pieces, and that unwinding was a quarter of fuzz_dim's time.
# Without it a run does 1.5x the executions and finds the same faults; a finding's input, run again
# as `ASAN_OPTIONS= build-fuzz/fuzz/fuzz_NAME FILE`, reports with the stacks. A caller's ASAN_OPTIONS
# win.
export ASAN_OPTIONS="${ASAN_OPTIONS-malloc_context_size=0}"
jobs_max="${KILN_FUZZ_JOBS:-1}"
for name in "${harnesses[@]}"; do
  [ -x "build-fuzz/fuzz/fuzz_$name" ] || { echo "fuzz: no harness fuzz_$name" >&2; exit 1; }
  run_one "$name" &
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
done
wait
if grep -qv '^ok$' "$work"/*.status; then
  echo "fuzz: findings above (inputs in $findings/)" >&2
  exit 1
fi
echo "fuzz: ${#harnesses[@]} harnesses, ${seconds}s each, no findings"
