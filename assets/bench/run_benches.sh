#!/usr/bin/env bash
# The README's judged benches, each resumable: a step whose output says it is complete is skipped, a
# killed one goes on with --resume from its .runs log (kept beside the output, in the work tree).
#   bash assets/bench/run_benches.sh STEP [STEP ...]
# Steps: trees-mtbench trees-humaneval (tau at the shared trees, fp32) tuned-fp32 tuned-auto (speed).
# CORE=N pins the step to one core with one torch thread, so two tau-only steps can share a 2-core
# machine; their tokens/s are then not speed figures (the tuned steps run alone, on every core).
set -euo pipefail
cd "$(dirname "$0")/../.."
TREE16=depth=4:top_k=4:total_tokens=16
TREES="ar,pld,lookahead,medusa:preset=paper,medusa:heads=4:top_k=8:total_tokens=60,\
medusa:heads=4:top_k=1:total_tokens=4,redrafter:preset=paper,redrafter:width=15:length=4,\
semi-attn:preset=paper,semi-lstm:preset=paper,eagle2:preset=paper,eagle2:$TREE16,\
hass:preset=paper,hass:$TREE16,fspad:preset=paper,fspad:$TREE16"
TUNED="ar,hf,pld,lookahead,skip,eagle2,hass,fspad,medusa,redrafter,semi-attn,semi-lstm"

run() {  # OUT, then bench arguments
  local out=$1; shift
  if [ ! -f "$out.runs" ] && python3 -c "import sys; from pathlib import Path; from specviz.apps.bench import \
load_results; sys.exit(load_results(Path(sys.argv[1]))['interrupted'])" "$out" 2>/dev/null; then
    echo "done: $out"; return
  fi
  local resume=() pin=()
  [ -f "$out.runs" ] && resume=(--resume)
  [ -n "${CORE:-}" ] && pin=(env OMP_NUM_THREADS=1 taskset -c "$CORE")
  "${pin[@]}" python3 -m specviz bench --out "$out" "${resume[@]}" "$@"
}

for step in "$@"; do
  case $step in
    trees-mtbench) run assets/bench/mtbench80_trees_cpu.json.xz --questions mt-bench --dtype float32 \
      --max-new-tokens 256 --methods "$TREES" --update-cards ;;
    trees-humaneval) run assets/bench/humaneval40_trees_cpu.json.xz --questions humaneval --limit 40 \
      --dtype float32 --max-new-tokens 256 --methods "$TREES" --update-cards ;;
    tuned-fp32) run assets/bench/mtbench80_tuned_fp32_cpu.json.xz --questions mt-bench --dtype float32 \
      --max-new-tokens 256 --methods "$TUNED" ;;
    tuned-auto) run assets/bench/mtbench80_tuned_auto_cpu.json.xz --questions mt-bench --dtype auto \
      --max-new-tokens 256 --methods "$TUNED" ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
