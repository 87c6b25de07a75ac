#!/usr/bin/env bash
# Set-up and entry points.  bash run.sh demo   -> tiny checkpoint -> convert (TP=2) -> torchrun generate on CPU
#                           bash run.sh test   -> the whole test suite (quick: the quick tier, tests marked slow left out)
# Both set up .venv on first use: CPU torch 2.13.0 first, so the requirement ranges never pull a CUDA build (test
# also installs requirements-eval.txt, the tests' own). The set-up
# is done when .venv/.step5-setup holds requirements.txt's checksum, written after the last install step: a set-up
# that was interrupted (or a requirements.txt that changed since) is completed by running the installs again, and a
# .venv whose python does not start is made anew.
# Python: $PYTHON if set, else the first of python3.11, python3.12, python3.10, python3 that is 3.10-3.12.
set -euo pipefail
cd "$(dirname "$0")"
usage() {
  echo "usage: bash run.sh demo | test [quick] [pytest args]" >&2
  exit 2
}
case "${1:-}" in
  demo | test) ;;
  *) usage ;;
esac
find_python() {
  local c
  for c in ${PYTHON:-} python3.11 python3.12 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
      echo "$c"
      return
    fi
  done
  echo "run.sh: no Python 3.10-3.12 found; install one or set PYTHON=/path/to/python3.x" >&2
  exit 2
}
setup() {
  local done_mark=.venv/.step5-setup want
  want=$(cksum < requirements.txt)
  if ! .venv/bin/python -c '' >/dev/null 2>&1; then
    rm -rf .venv
    PY=$(find_python)
    "$PY" -m venv .venv
  fi
  if [ -f "$done_mark" ] && [ "$(cat "$done_mark")" = "$want" ]; then
    return
  fi
  echo "run.sh: setting up .venv (CPU torch 2.13.0, then requirements.txt; about a minute)" >&2
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -r requirements.txt
  echo "$want" > "$done_mark"
}
setup_tests() {  # the tests' own requirements (lm-evaluation-harness scores a test server), beside the product's
  local done_mark=.venv/.step5-setup-tests want
  want=$(cksum < requirements-eval.txt)
  if [ -f "$done_mark" ] && [ "$(cat "$done_mark")" = "$want" ]; then
    return
  fi
  echo "run.sh: installing the tests' requirements (requirements-eval.txt)" >&2
  .venv/bin/python -m pip install --quiet -r requirements-eval.txt
  echo "$want" > "$done_mark"
}
setup
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank (and no torchrun banner about it)
case "$1" in
  demo)
    TP=${TP:-2}
    TR=(.venv/bin/torchrun --standalone --nproc-per-node="$TP" generate.py --tp-dir "out/converted/tp$TP")
    echo "== 1/4 a tiny Step-5 checkpoint with random weights (their text is noise) in out/tiny-ckpt; its 512-token"
    echo "       vocabulary is its tokenizer's, so every id prints"
    if [ ! -f out/tiny-ckpt/TINY_STEP5_FIXTURE ]; then  # written last: the checkpoint is whole (kept on a rerun)
      .venv/bin/python tiny_checkpoint.py out/tiny-ckpt --set vocab_size=512
    fi
    echo "== 2/4 convert.py: per-rank shards for TP=EP=$TP in out/converted/tp$TP (a rerun keeps them)"
    .venv/bin/python convert.py --checkpoint out/tiny-ckpt --out-dir out/converted --tp-size "$TP" --ep-size "$TP"
    echo "== 3/4 generate.py on $TP CPU ranks: a chat prompt; then its answer, its ids (--print-ids) and the speed"
    "${TR[@]}" --prompt "请介绍一下张量并行。" --max-new-tokens 16 --print-ids
    echo "== 4/4 an image request: a synthetic 900x300 picture, cut into crops + an overview by image_processing.py"
    .venv/bin/python -c "import numpy as np; from PIL import Image; Image.fromarray((np.random.default_rng(0)
      .random((300, 900, 3)) * 255).astype('uint8')).save('out/demo.png')"
    "${TR[@]}" --prompt "What is in this picture?" --image out/demo.png --max-new-tokens 8 --print-ids
    ;;
  test)
    shift
    setup_tests
    if [ "${1:-}" = quick ]; then  # the edit-test loop: every test but those marked slow (pytest.ini)
      shift
      set -- -m "not slow" "$@"
    fi
    # Two workers, each taking whole files (a file's module fixtures, its servers among them, start once): the tests
    # keep both cores busy where one process left the second idle. TEST_WORKERS=0 runs them in this process.
    .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile tests test_vision.py "$@"
    ;;
esac
