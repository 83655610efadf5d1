"""`decode-worker` refuses bad settings and unusable model paths with one line and exit code 2, before anything
starts; `--version` reads the package metadata."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

from decode_worker import cli

SUBCOMMANDS = [["serve"], ["generate", "--prompt", "hi"], ["up"], ["fetch-model"]]
LLAMA = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2}


@pytest.fixture
def nothing_starts(monkeypatch):
    """A check that let a bad setting through would start a server, a deployment or a download: fail instead."""
    def refuse(*_):
        raise AssertionError("started despite a bad setting")

    import decode_worker.model.embedded
    import decode_worker.server.app

    monkeypatch.setattr(decode_worker.server.app, "serve", refuse)
    monkeypatch.setattr(decode_worker.model.embedded, "ensure_default_model", refuse)
    monkeypatch.setattr(cli, "run_up", refuse)


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: a[0])
@pytest.mark.parametrize("name,value,line", [
    ("PORT", "abc", "error: DECODE_WORKER_PORT must be an integer, not 'abc'"),
    ("DISAGGREGATION_DECODE_ENABLE_HICACHE", "maybe", ("error: DECODE_WORKER_DISAGGREGATION_DECODE_ENABLE_HICACHE "
                                                       "must be true or false (or 1/0, yes/no, on/off), not 'maybe'")),
])
def test_bad_environment_value_stops_every_subcommand(argv, name, value, line, monkeypatch, capsys, nothing_starts):
    monkeypatch.setenv("DECODE_WORKER_" + name, value)
    assert run_main(argv + (["--port", "5"] if argv == ["serve"] else []), capsys) == (2, [line])


def test_bad_flag_value(capsys, nothing_starts):
    assert run_main(["serve", "--port", "abc"], capsys) == (2, ["error: --port must be an integer, not 'abc'"])


def test_refused_combination(capsys, nothing_starts):
    assert run_main(["serve", "--disaggregation-decode-enable-hicache"], capsys) == (
        2, ["error: --disaggregation-decode-enable-hicache requires --disaggregation-decode-enable-radix-cache"])


@pytest.mark.parametrize("argv", [["serve"], ["generate", "--prompt", "hi"], ["up"]], ids=lambda a: a[0])
def test_missing_model_path(argv, tmp_path, capsys, nothing_starts):
    missing = str(tmp_path / "nope")
    assert run_main(argv + ["--model-path", missing], capsys) == (
        2, [f"error: --model-path {missing!r}: no such file or directory"])


@pytest.mark.parametrize("argv", [["serve"], ["up"]], ids=lambda a: a[0])
def test_model_path_from_the_environment(argv, tmp_path, monkeypatch, capsys, nothing_starts):
    monkeypatch.setenv("DECODE_WORKER_MODEL_PATH", str(tmp_path / "nope"))
    rc, err = run_main(argv, capsys)
    assert rc == 2 and len(err) == 1 and "no such file or directory" in err[0]


def test_repo_id_is_not_downloaded(capsys, nothing_starts):
    rc, err = run_main(["serve", "--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct"], capsys)
    assert rc == 2 and len(err) == 1
    assert "decode-worker does not download models" in err[0]
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2-135M-Instruct" in err[0]


def test_folder_without_config(tmp_path, capsys, nothing_starts):
    assert run_main(["serve", "--model-path", str(tmp_path)], capsys) == (2, [f"error: {tmp_path} has no config.json"])


def test_unsupported_architecture(tmp_path, capsys, nothing_starts):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"model_type": "gpt2"}))
    rc, err = run_main(["serve", "--model-path", str(tmp_path)], capsys)
    assert rc == 2 and len(err) == 1 and "unsupported architecture 'gpt2'" in err[0]


def test_unreadable_model_path(tmp_path, monkeypatch, capsys, nothing_starts):
    monkeypatch.setattr(cli.os, "access", lambda *_: False)  # as root, a chmod would not keep us out
    rc, err = run_main(["serve", "--model-path", str(tmp_path)], capsys)
    assert rc == 2 and len(err) == 1 and "permission denied" in err[0]


def test_readable_model_passes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    cli.check_model_path(str(tmp_path))
    cli.check_model_path(None)  # the embedded model


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"decode-worker {version('decode-worker')}"


def test_help_survives_a_bad_environment(monkeypatch, capsys):
    monkeypatch.setenv("DECODE_WORKER_PORT", "abc")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0 and "(default: 30000) [env: DECODE_WORKER_PORT]" in capsys.readouterr().out


def test_real_process_prints_one_line_and_no_traceback(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "DECODE_WORKER_PORT": "abc"}
    result = subprocess.run([sys.executable, "-m", "decode_worker.cli", "serve"], check=False,
                            capture_output=True, text=True, env=env, timeout=120)
    assert (result.returncode, result.stderr, result.stdout) == (
        2, "error: DECODE_WORKER_PORT must be an integer, not 'abc'\n", "")
