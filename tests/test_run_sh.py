"""run.sh, the first run: its usage at once, a set-up that was interrupted resumed (with a stand-in Python that logs
what it is asked to do instead of installing), and the demo on a copy of the repository (its .venv standing for this
one): every part said, every id within the tokenizer, and a rerun without the converter's re-reading.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for python: logs its arguments; `-m venv DIR` makes DIR/bin/python a copy of itself; exits 1 when its
# arguments are $STUB_FAIL (an install step that fails, as an interrupted one does)
STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
if [ "$*" = "${STUB_FAIL:-}" ]; then exit 1; fi
exit 0
"""
TORCH = "-m pip install --quiet torch==2.13.0"
REQS = "-m pip install --quiet -r requirements.txt"
EVAL = "-m pip install --quiet -r requirements-eval.txt"  # the tests' own (test only)
PYTEST = "-m pytest -q -n 2 --dist loadfile tests test_vision.py"


def run_sh(repo, *args, fail: str = "") -> tuple[int, list, str]:
    """bash run.sh ARGS in repo with the stand-in python -> (exit code, the calls it logged, stderr)."""
    log = repo / "calls.log"
    log.write_text("")
    r = subprocess.run(["bash", str(repo / "run.sh"), *args], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=str(repo / "stub-python"), STUB_LOG=str(log), STUB_FAIL=fail))
    calls = [c for c in log.read_text().splitlines() if not c.startswith("-c")]  # its version and start-up checks
    return r.returncode, calls, r.stderr


@pytest.fixture
def repo(tmp_path):
    for f in ("run.sh", "requirements.txt", "requirements-eval.txt"):
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    (tmp_path / "stub-python").write_text(STUB)
    os.chmod(tmp_path / "stub-python", 0o755)
    return tmp_path


def test_run_sh_alone_prints_its_usage_before_any_install(repo):
    rc, calls, err = run_sh(repo)
    assert rc == 2 and "usage: bash run.sh demo | test" in err and calls == [] and not (repo / ".venv").exists()
    rc, calls, err = run_sh(repo, "tset")
    assert rc == 2 and "usage:" in err and calls == []


def test_an_interrupted_set_up_is_resumed(repo):
    """The set-up fails at its last install step (as one interrupted there): the next run installs again and then
    runs; a finished set-up installs nothing; a .venv whose python does not start is made anew; a changed
    requirements.txt is installed; `test` also installs the tests' own requirements-eval.txt, once, and again when
    it changes."""
    rc, calls, _ = run_sh(repo, "test", fail=REQS)
    assert rc != 0 and calls[1:] == [TORCH, REQS] and calls[0].startswith("-m venv"), calls
    rc, calls, _ = run_sh(repo, "test", "quick")
    assert rc == 0 and calls == [TORCH, REQS, EVAL, PYTEST + ' -m not slow'], calls
    rc, calls, _ = run_sh(repo, "test")
    assert rc == 0 and calls == [PYTEST], calls
    (repo / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # a broken .venv
    rc, calls, _ = run_sh(repo, "test")
    assert rc == 0 and calls[0].startswith("-m venv") and calls[1:] == [TORCH, REQS, EVAL, PYTEST], calls
    with open(repo / "requirements.txt", "a") as f:
        f.write("llguidance>=1.9,<2\n")
    rc, calls, _ = run_sh(repo, "test")
    assert rc == 0 and calls == [TORCH, REQS, PYTEST], calls
    with open(repo / "requirements-eval.txt", "a") as f:
        f.write("jsonschema>=4.20,<5\n")
    rc, calls, _ = run_sh(repo, "test")
    assert rc == 0 and calls == [EVAL, PYTEST], calls


@pytest.mark.slow
def test_the_demo_says_what_each_part_is_and_is_quiet_on_a_rerun(tmp_path):
    """bash run.sh demo on a copy of the repository whose .venv stands for this one (set up: its mark written): it
    labels its four parts, every generated id is one its tokenizer prints, and a rerun keeps the checkpoint and
    the shards without the converter's 'changed on disk; re-reading' lines."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "out", ".git", "__pycache__", ".pytest_cache"))
    (repo / ".venv" / "bin").mkdir(parents=True)
    for name, exe in (("python", sys.executable), ("torchrun", os.path.join(os.path.dirname(sys.executable),
                                                                            "torchrun"))):
        (repo / ".venv" / "bin" / name).write_text(f'#!/bin/sh\nexec "{exe}" "$@"\n')
        os.chmod(repo / ".venv" / "bin" / name, 0o755)
    mark = subprocess.run("cksum < requirements.txt", shell=True, cwd=repo, capture_output=True, text=True).stdout
    (repo / ".venv" / ".step5-setup").write_text(mark)
    runs = [subprocess.run(["bash", "run.sh", "demo"], cwd=repo, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert [line[:6] for line in r.stdout.splitlines() if line.startswith("== ")] == [
            "== 1/4", "== 2/4", "== 3/4", "== 4/4"], r.stdout
        ids = [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("ids: ")]
        assert len(ids) == 2 and all(0 <= t < 512 for t in sum(ids, [])), r.stdout
        assert "Traceback" not in r.stderr and "setting up .venv" not in r.stderr
    assert "wrote tiny Step-5 checkpoint" in runs[0].stdout and "wrote tiny Step-5" not in runs[1].stdout
    assert not re.search(r"changed on disk|re-reading", runs[1].stderr + runs[1].stdout), runs[1].stderr[-3000:]
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(repo / "out" / "converted" / "tokenizer_files" / "tokenizer.json")
                               ).get_vocab_size() == 512
