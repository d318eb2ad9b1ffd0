"""``kvtier engine make-checkpoint|generate|bench`` in-process, against a real daemon where needed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.commands.engine import read_prompt, register

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny GEMMs on a shared 2-core machine: a second BLAS thread only waits for the first.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_default_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A test names its daemon: none answers at the default address, whatever runs on this machine.
    monkeypatch.setenv("KVTIER_ADDRESS", f"unix:{tmp_path}/none.sock")


def kvtier(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert kvtier("engine", "make-checkpoint", str(path), "--layers", "2", "--hidden", "64", "--seed", "3") == 0
    return path


def test_make_checkpoint_writes_a_loadable_model(model_dir: Path, tmp_path: Path, capsys) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2 and config["vocab_size"] == 256
    mla = tmp_path / "mla"
    assert kvtier("engine", "make-checkpoint", str(mla), "--mla", "--layers", "1", "--shards", "2") == 0
    assert json.loads((mla / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert (mla / "model.safetensors.index.json").is_file()
    assert "MLA, 1 layers" in capsys.readouterr().out


def test_generate_prints_tokens_ttft_and_hits(model_dir: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "prompt.txt"
    f.write_text("1, 2, 3\n4 5\t6")
    assert kvtier("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f), "--max-tokens", "5") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tokens: ") and len(lines[0].split()) == 6
    assert lines[1].startswith("ttft_ms: ")
    assert lines[2] == "prefix_hit_tokens: 0 of 6 (loaded from kvtier: 0)"


def test_generate_reuses_a_prefix_stored_by_an_earlier_run(model_dir: Path, tmp_path: Path, kvtier_daemon,
                                                           capsys) -> None:
    f = tmp_path / "prompt.txt"
    f.write_text("A system prompt long enough for a few blocks of sixteen bytes each. Then a question?")
    argv = ("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f), "--text", "--json",
            "--max-tokens", "8", "--kvtier", kvtier_daemon.address)
    runs = []
    for _ in range(2):
        assert kvtier(*argv) == 0
        runs.append(json.loads(capsys.readouterr().out))
    n = len(f.read_bytes())
    assert runs[0]["prompt_tokens"] == n and runs[0]["prefix_hit_tokens"] == 0
    assert runs[0]["saved_blocks"] == n // 16
    assert runs[1]["loaded_tokens"] == runs[1]["prefix_hit_tokens"] == (n - 1) // 16 * 16
    assert runs[1]["token_ids"] == runs[0]["token_ids"] and isinstance(runs[1]["text"], str)
    assert kvtier(*argv, "--exact") == 0  # exact copies only: this daemon's raw blocks all are
    assert json.loads(capsys.readouterr().out)["loaded_tokens"] == runs[1]["loaded_tokens"]


def test_bench_reports_each_figure(model_dir: Path, kvtier_daemon, capsys) -> None:
    assert kvtier("engine", "bench", "--model", str(model_dir), "--prompt-tokens", "64", "--repetitions", "1",
                  "--kvtier", kvtier_daemon.address, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["ttft_ms"]) == {"full_prefill", "engine_hit", "kvtier_hit"}
    assert result["prefix_hit_tokens"] == {"full_prefill": 0, "engine_hit": 48, "kvtier_hit": 48}
    assert set(result["speedup"]) == {"engine_hit", "kvtier_hit"}


def test_bad_prompts_are_one_line_errors(model_dir: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "bad.txt"
    f.write_text("1 2 three")
    assert kvtier("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f)) == 2
    assert "'three' is not a token id (use --text" in capsys.readouterr().err
    f.write_text("1 999")
    assert kvtier("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f)) == 2
    assert "outside the model's vocabulary of 256" in capsys.readouterr().err
    assert kvtier("engine", "generate", "--model", str(tmp_path / "none"), "--prompt-file", str(f)) == 2
    assert capsys.readouterr().err.startswith("kvtier engine: ")


def test_read_prompt() -> None:
    assert read_prompt(" 7,8 ,\n9 ", as_text=False, vocab_size=10) == [7, 8, 9]
    assert read_prompt("hé", as_text=True, vocab_size=256) == [104, 195, 169]
    with pytest.raises(ValueError, match="no tokens"):
        read_prompt(" , ", as_text=False, vocab_size=10)


def test_the_module_imports_without_torch() -> None:
    code = "import sys, kvtier.commands.engine; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={"PYTHONPATH": f"{ROOT}:{ROOT / 'protocol'}", "PATH": "/usr/bin:/bin"})


def test_every_codec_of_the_protocol_is_offered() -> None:
    from kvtier_protocol.codec_plan import CODECS

    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    for codec in CODECS:
        args = parser.parse_args(["engine", "generate", "--model", "m", "--prompt-file", "p", "--codec", codec])
        assert args.codec == codec
    assert {"int2", "fp8_e4m3"} <= set(CODECS)


def test_an_explicit_daemon_that_does_not_answer_is_an_error(model_dir: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "p.txt"
    f.write_text("1 2 3")
    missing = f"unix:{tmp_path}/missing.sock"
    assert kvtier("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f), "--kvtier", missing) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("kvtier engine: cannot reach the kvtier daemon at " + missing)
    assert captured.out == ""


def test_without_kvtier_flag_the_default_daemon_is_used_if_it_answers(model_dir: Path, tmp_path: Path, kvtier_daemon,
                                                                     monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(str(i % 200) for i in range(40)))
    argv = ("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f), "--json", "--max-tokens", "2")
    assert kvtier(*argv) == 0  # nobody at the default address: runs alone, and says so
    alone = capsys.readouterr()
    assert json.loads(alone.out)["saved_blocks"] == 0 and "running without kvtier" in alone.err
    monkeypatch.setenv("KVTIER_ADDRESS", kvtier_daemon.address)
    runs = []
    for _ in range(2):
        assert kvtier(*argv) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["saved_blocks"] == 2 and runs[1]["loaded_tokens"] == 32
    assert kvtier(*argv, "--no-kvtier") == 0
    assert json.loads(capsys.readouterr().out)["loaded_tokens"] == 0


def test_generate_draws_progress_in_a_terminal_and_prints_the_same(model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    f = tmp_path / "p.txt"
    f.write_text(" ".join(str(i % 200) for i in range(40)))
    argv = ("engine", "generate", "--model", str(model_dir), "--prompt-file", str(f), "--json", "--seed", "1",
            "--no-kvtier")
    assert kvtier(*argv) == 0
    plain = json.loads(capsys.readouterr().out)
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert kvtier(*argv) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert drawn["token_ids"] == plain["token_ids"]
    assert "kvtier engine: " in tty.getvalue() and "tokens computed" in tty.getvalue()
