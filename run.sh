#!/usr/bin/env bash
# Set-up and entry points.  bash run.sh demo   -> tiny checkpoint -> convert (TP=2) -> torchrun generate on CPU
#                           bash run.sh test   -> the whole test suite
# Both create .venv on first use: CPU torch 2.13.0 first, so the requirement ranges never pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -r requirements.txt
fi
case "${1:-}" in
  demo)
    TP=${TP:-2}
    .venv/bin/python tiny_checkpoint.py out/tiny-ckpt
    .venv/bin/python convert.py --checkpoint out/tiny-ckpt --out-dir out/converted --tp-size "$TP" --ep-size "$TP"
    .venv/bin/torchrun --standalone --nproc-per-node="$TP" generate.py --tp-dir "out/converted/tp$TP" \
      --ep-size "$TP" --prompt "请介绍一下张量并行。" --max-new-tokens 16 --print-ids
    ;;
  test)
    shift
    .venv/bin/python -m pytest -q tests test_vision.py "$@"
    ;;
  *)
    echo "usage: bash run.sh demo | test [pytest args]" >&2
    exit 2
    ;;
esac
