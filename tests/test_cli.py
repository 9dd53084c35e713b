"""python -m pocketlab generate / chat: text on stdout equal to the text API's, timing on stderr, chat turns that
reuse the slot's prefix, bad input in one line with exit status 2."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pocketlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--max-new-tokens", "6", "--temperature", "0", "--max-seq-len", "256"]


@pytest.fixture(scope="module")
def path(checkpoint):
    return str(checkpoint("tiny-qwen3-text"))


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine("tiny-qwen3-text", max_slots=1)


def test_generate_streams_the_text_api_output(path, eng, capsys):
    assert main(["generate", path, "--prompt", "Hi 🙂", "--system", "Be brief.", "--no-think", *FLAGS]) == 0
    out, err = capsys.readouterr()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    want = eng.generate([chat], eng.default_sampling(temperature=0.0, max_new_tokens=6), enable_thinking=False)[0]
    assert out == want.text + "\n"
    assert "loaded in" in err and "tokens/s" in err and "6 tokens" in err
    assert main(["generate", path, "--prompt", "Once upon", "--raw", *FLAGS]) == 0
    raw = eng.generate(["Once upon"], eng.default_sampling(temperature=0.0, max_new_tokens=6))[0]
    assert capsys.readouterr().out == raw.text + "\n"


def test_chat_is_multi_turn_and_reuses_the_prefix(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nAnd then?\n/reset\nAgain\n"))
    assert main(["chat", path, "--no-think", *FLAGS]) == 0
    out, err = capsys.readouterr()
    stats = re.findall(r"prompt (\d+) tokens, (\d+) reused", err)
    assert len(stats) == 3 and out.endswith("\n")  # the empty line is skipped; EOF ends the chat
    (p1, _), (p2, r2), (p3, _) = [(int(a), int(b)) for a, b in stats]
    # turn 2 renders turn 1 again and its prompt comes from the cache, up to the 4 tokens of the empty thought
    # (<think>, \n\n, </think>, \n\n) that Qwen3's template drops from past assistant turns
    assert p2 > p1 and r2 == p1 - 4
    assert p3 < p2  # /reset: a fresh conversation


def test_bad_input_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a preset name is written under ./checkpoints
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a checkpoint folder" in capsys.readouterr().err
    assert main(["generate", "tiny-qwen3", "--prompt", "x"]) == 2  # a preset without a tokenizer
    assert "need a tokenizer" in capsys.readouterr().err
    assert main(["generate", "checkpoints/tiny-qwen3-seed1", "--prompt", "x"]) == 2  # written on first use
    assert (tmp_path / "checkpoints/tiny-qwen3-seed1/config.json").is_file()


def test_python_dash_m_pocketlab(path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pocketlab", "generate", path, "--prompt", "Hi", "--raw", *FLAGS]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("\n") and "tokens/s" in res.stderr and "tokens/s" not in res.stdout
