#!/usr/bin/env bash
# The benches behind docs/results.md, each resumable: a step whose output says it is complete is skipped,
# a killed one goes on with --resume from its .runs log (kept beside the output, in the work tree).
#   bash scripts/run_benches.sh STEP [STEP ...]
# Steps: trees-mtbench trees-humaneval (tau at the shared trees, fp32) tuned-fp32 tuned-auto (speed, packed
# linear weights) tuned-fp32-default (speed on PyTorch's default linear kernels);
# eagle3-train (the shared budget, 4 epochs on the shared sequences, resumable, shipped when done; its saves are
# mirrored in .train-state/ for a lost cache; DEVICE=cuda on a GPU, whose run is another), then
# eagle3-mtbench eagle3-humaneval (eagle3 at the trees hass was benched at), eagle3-all (all three, unattended);
# redrafter-mtbench redrafter-humaneval
# (ReDrafter at Medusa's node counts after prefix merging); hass-mtbench hass-humaneval (HASS trained in the
# reference's two stages, at the shared trees).
# CORE=N pins the step to one core with one torch thread, so two tau-only steps can share a 2-core
# machine; their tokens/s are then not speed figures (the tuned steps run alone, on every core). The tau steps
# resume on any machine (--any-machine); a tuned step's log only resumes on the machine it started on.
# PART=K/N runs the K-th of N blocks of what a tau step has left (bench --part): CORE=0 PART=1/2 and
# CORE=1 PART=2/2 side by side, then the step without PART takes both parts in and finishes (pinned to core 0
# too, so its results name the one thread each part ran with).
# A step unfinished when a session ends: stop it and commit its *.runs logs (a new checkout holds only what
# landed, and ~/.cache may be gone); the step removes them when it completes.
set -euo pipefail
cd "$(dirname "$0")/.."
TREE16=depth=4:top_k=4:total_tokens=16
TREES="ar,pld,lookahead,medusa:preset=paper,medusa:heads=4:top_k=8:total_tokens=60,\
medusa:heads=4:top_k=1:total_tokens=4,redrafter:preset=paper,redrafter:width=15:length=4,\
semi-attn:preset=paper,semi-lstm:preset=paper,eagle2:preset=paper,eagle2:$TREE16,\
hass:preset=paper,hass:$TREE16,fspad:preset=paper,fspad:$TREE16"
TUNED="ar,hf,pld,lookahead,skip,eagle2,hass,fspad,medusa,redrafter,semi-attn,semi-lstm"
[ -f assets/drafters/eagle3/card.json ] && TUNED="$TUNED,eagle3"
# ReDrafter's beams share prefixes: 4x4 beams verify 10 nodes on average, 7x4 about 16, 28x4 about 57 (4 MT-bench
# prompts); these widths compare it with Medusa's 16- and 60-node trees at equal verified nodes.
REDRAFTER="ar,medusa:preset=paper,medusa:heads=4:top_k=8:total_tokens=60,redrafter:width=7:length=4,\
redrafter:width=28:length=4"
# HASS at these two trees is in the trees-* results (same questions, fp32, greedy): not run twice.
EAGLE3="ar,eagle3:preset=paper,eagle3:$TREE16"
HASS="ar,hass:preset=paper,hass:$TREE16"  # HASS trained with the reference's two stages (drafters/hass.py)

complete() {  # a results file that exists and was not interrupted (plain JSON, or xz-compressed by its name)
  python3 - "$1" 2>/dev/null <<'PY'
import json, lzma, sys
path = sys.argv[1]
with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:
    sys.exit(1 if json.load(f).get("interrupted", True) else 0)
PY
}

run() {  # OUT, then bench arguments
  local out=$1; shift
  local parts=("$out".part*-of-*.runs)
  [ -f "${parts[0]}" ] || parts=()
  if [ ! -f "$out.runs" ] && [ ${#parts[@]} = 0 ] && complete "$out"; then
    echo "done: $out"; return
  fi
  local extra=()
  if [ -n "${PART:-}" ]; then  # K/N: one block of what is left, in a log of its own (bench --part)
    extra=(--part "$PART")
    [ -f "$out.part${PART/\//-of-}.runs" ] && extra+=(--resume)
  elif [ -f "$out.runs" ] || [ ${#parts[@]} -gt 0 ]; then
    extra=(--resume)  # takes finished parts in
    # the parts ran pinned, one thread each: so does the run that takes them in, so the results say so
    [ ${#parts[@]} -gt 0 ] && local CORE=${CORE:-0}
  fi
  pinned python3 -m specviz bench --out "$out" "${extra[@]}" "$@"
}

keep_state() {  # the cache may not survive a session: mirror each run's last whole save into .train-state/
  local runs=${SPECVIZ_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specviz}/train/runs mirror=.train-state name inode
  mkdir -p "$runs" "$mirror"
  for kept in "$mirror"/*/; do  # restore what the cache lost
    [ -d "$kept/state" ] && [ ! -e "$runs/$(basename "$kept")/state" ] && cp -r "$kept" "$runs/"
  done
  while sleep 600; do
    for state in "$runs"/*/state; do
      [ -f "$state/progress.json" ] || continue
      name=$(basename "$(dirname "$state")"); inode=$(stat -c %i "$state")
      cmp -s "$state/progress.json" "$mirror/$name/state/progress.json" 2>/dev/null && continue  # mirrored already
      rm -rf "$mirror/$name.partial"; mkdir -p "$mirror/$name.partial"
      cp -r "$state" "$mirror/$name.partial/" 2>/dev/null || continue
      [ "$(stat -c %i "$state" 2>/dev/null)" = "$inode" ] || continue  # a save was swapped in meanwhile
      rm -rf "$mirror/$name"; mv "$mirror/$name.partial" "$mirror/$name"
    done
  done
}

pinned() { if [ -n "${CORE:-}" ]; then env OMP_NUM_THREADS=1 taskset -c "$CORE" "$@"; else "$@"; fi; }

for step in "$@"; do
  case $step in
    trees-mtbench) run assets/bench/mtbench80_trees_cpu.json.xz --any-machine --questions mt-bench --dtype float32 \
      --max-new-tokens 256 --methods "$TREES" --update-cards ;;
    trees-humaneval) run assets/bench/humaneval40_trees_cpu.json.xz --any-machine --questions humaneval --limit 40 \
      --dtype float32 --max-new-tokens 256 --methods "$TREES" --update-cards ;;
    tuned-fp32) run assets/bench/mtbench80_tuned_fp32_cpu.json.xz --questions mt-bench --dtype float32 \
      --max-new-tokens 256 --methods "$TUNED" ;;
    tuned-fp32-default) run assets/bench/mtbench80_tuned_fp32_default_kernels_cpu.json.xz --questions mt-bench \
      --dtype float32 --max-new-tokens 256 --methods "$TUNED" --no-pack ;;
    tuned-auto) run assets/bench/mtbench80_tuned_auto_cpu.json.xz --questions mt-bench --dtype auto \
      --max-new-tokens 256 --methods "$TUNED" ;;
    eagle3-train) epochs=$(python3 -c "import json; print(json.load(open('assets/drafters/eagle3/card.json'))\
['training']['epochs'])" 2>/dev/null || echo 0)
      [ "$epochs" = 4 ] && { echo "done: eagle3 is shipped at the shared 4 epochs"; continue; }
      keep_state & trap "kill $! 2>/dev/null" EXIT
      pinned python3 -m specviz train --drafter eagle3 --samples all --prompts all --max-prompt-tokens 512 \
        --answer-tokens 256 --epochs 4 --device "${DEVICE:-cpu}" \
        --feature-dtype bfloat16 --distill-dtype bfloat16 --precision bf16 --save-every 25 --resume --ship ;;
    eagle3-mtbench) run assets/bench/mtbench80_eagle3_4ep_cpu.json.xz --any-machine --questions mt-bench \
      --dtype float32 --max-new-tokens 256 --methods "$EAGLE3" --update-cards ;;  # the 4-epoch checkpoint's
    eagle3-humaneval) run assets/bench/humaneval40_eagle3_4ep_cpu.json.xz --any-machine --questions humaneval \
      --limit 40 --dtype float32 --max-new-tokens 256 --methods "$EAGLE3" --update-cards ;;
    eagle3-all)  # unattended: the retrain, then each of its benches in two pinned halves side by side, then whole
      bash "$0" eagle3-train
      for bench in eagle3-mtbench eagle3-humaneval; do
        CORE=0 PART=1/2 bash "$0" "$bench" & CORE=1 PART=2/2 bash "$0" "$bench" & wait
        bash "$0" "$bench"
      done ;;
    hass-mtbench) run assets/bench/mtbench80_hass_two_stage_cpu.json.xz --any-machine --questions mt-bench \
      --dtype float32 --max-new-tokens 256 --methods "$HASS" --update-cards ;;
    hass-humaneval) run assets/bench/humaneval40_hass_two_stage_cpu.json.xz --any-machine --questions humaneval \
      --limit 40 --dtype float32 --max-new-tokens 256 --methods "$HASS" --update-cards ;;
    redrafter-mtbench) run assets/bench/mtbench80_redrafter_nodes_cpu.json.xz --any-machine --questions mt-bench \
      --dtype float32 --max-new-tokens 256 --methods "$REDRAFTER" ;;
    redrafter-humaneval) run assets/bench/humaneval40_redrafter_nodes_cpu.json.xz --any-machine --questions humaneval --limit 40 \
      --dtype float32 --max-new-tokens 256 --methods "$REDRAFTER" ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
