import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paged_attn

# The tests are grouped by subject (ops/, block_manager/, engine/, emulated/, build/, vllm_backend/); the emulated
# and fp8 tests build their cases with the op tests' helpers (from test_attention import make_case, ...), so the
# folders whose modules others import are on the path whichever test is collected first.
for _folder in ("ops", "emulated"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / _folder))

HAS_GPU = torch.cuda.is_available()
HAS_CUDA_OPS = HAS_GPU and paged_attn.has_cuda_kernels()
CUDA_SKIP_REASON = (
    "no CUDA GPU visible" if not HAS_GPU else "paged_attn was built without its CUDA kernels"
)

# Parametrize over this to run a test on the CPU always and on CUDA when a GPU (and the CUDA build) is present;
# pytest's -ra prints the skip reason.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA_OPS, reason=CUDA_SKIP_REASON)),
]
requires_cuda = pytest.mark.skipif(not HAS_CUDA_OPS, reason=CUDA_SKIP_REASON)


# What another torch release can change (the `extension` marker, pyproject.toml): the op tests and the build's
# registration tests, by folder, so a new test file there is marked without a list to keep; elsewhere a test that
# calls the ops directly marks itself.
EXTENSION_TESTS = [Path(__file__).resolve().parent / "ops", Path(__file__).resolve().parent / "build" / "test_build.py"]
# ... except the files whose subject is the kernels' own arithmetic (the same C++ under any torch; their ops'
# registration, fakes and wrappers are the other files' subject): ~120 of the ~200 CPU-seconds of tests/ops, which
# the torch 2.11 run (scripts/check_torch_version.sh) would spend proving again what the main run proves.
KERNEL_ARITHMETIC_TESTS = {"test_batch_invariance.py", "test_nonfinite.py", "test_shared_blocks.py", "test_sinks.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in KERNEL_ARITHMETIC_TESTS:
            continue
        if any(item.path == place or place in item.path.parents for place in EXTENSION_TESTS):
            item.add_marker(pytest.mark.extension)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def validation():
    """Turns CUDA index validation on for one test and restores the previous setting."""
    before = paged_attn.validation_enabled()
    paged_attn.set_validation(True)
    yield
    paged_attn.set_validation(before)


@pytest.fixture(scope="session", autouse=True)
def _gguf_read_once():
    """Each GGUF file parsed once per test process: ``gguf.GGUFReader`` memoized by file (path, size, mtime). gguf-py
    takes 9-23 s to parse Gemma 3's 262k-token vocabulary (2 s SmolLM2's), and transformers' loaders read a file
    again for the config, the weights and the tokenizer; our loader and theirs only read from the reader."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original, readers = gguf.GGUFReader, {}

    def read_once(path, mode="r"):
        status = os.stat(path)
        key = (os.path.realpath(path), mode, status.st_size, status.st_mtime_ns, status.st_ino)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = read_once
    yield
    gguf.GGUFReader = original


@pytest.fixture(scope="session")
def tiny_model():
    """A small random Llama (2 layers, GQA 4:2, head_dim 16, vocab 101, EOS 7) built in place, on the CPU: for
    engine tests that need a model but not a real one (nothing is loaded)."""
    return tiny_llama()


def tiny_llama(head_dim: int = 16):
    """tiny_model's Llama with another head_dim (the tiled KV cache needs a multiple of 32)."""
    from paged_attn.engine import LlamaModel, ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=head_dim, vocab_size=101, max_model_len=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                      eos_token_id=7)
    generator = torch.Generator().manual_seed(0)

    def weight(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    q_size, kv_size, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    weights = {"model.embed_tokens.weight": weight(cfg.vocab_size, hidden, scale=1.0),
               "model.norm.weight": 1 + weight(hidden, scale=0.1),
               "lm_head.weight": weight(cfg.vocab_size, hidden, scale=1.0)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + weight(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + weight(hidden, scale=0.1),
            p + "self_attn.q_proj.weight": weight(q_size, hidden),
            p + "self_attn.k_proj.weight": weight(kv_size, hidden),
            p + "self_attn.v_proj.weight": weight(kv_size, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, q_size),
            p + "mlp.gate_proj.weight": weight(cfg.intermediate_size, hidden),
            p + "mlp.up_proj.weight": weight(cfg.intermediate_size, hidden),
            p + "mlp.down_proj.weight": weight(hidden, cfg.intermediate_size),
        })
    return LlamaModel(cfg, weights)



@pytest.fixture
def make_llm(model):
    """Builds LLMs on the requesting module's ``model`` (the engine tests on a real model; its weights shared);
    after the test, every block of each must be free again."""
    from paged_attn.engine import LLM

    made = []

    def make(**kwargs):
        made.append(LLM(model, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        scheduler = llm.scheduler
        assert not scheduler.has_unfinished()
        assert not scheduler.block_manager.seqs
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_kv_blocks
        assert scheduler.block_manager.num_free_swap_blocks == scheduler.block_manager.num_swap_blocks
        assert llm.stats().kv_blocks_used == 0

def snapshot(bm):
    """Everything the manager holds, to compare before and after a call that must fail."""
    blocks = [b.ref_count for b in bm.kv_pool.blocks]
    seqs = {seq_id: (list(s.token_ids), [list(t) for t in s.block_tables], s.swapped_out, s.prefix_hash,
                     s.prefix_content_id, s.window_floor, list(s.released_below))
            for seq_id, s in bm.seqs.items()}
    return (bm.stats(), blocks, [b.ref_count for b in bm.swap_pool.blocks], list(bm.kv_pool.free_block_ids),
            list(bm.prefix_cache.evictable_block_ids), list(bm.swap_pool.free_block_ids),
            dict(bm.prefix_cache.hash_to_block_id), dict(bm.prefix_cache.entries), seqs)


def run_on_portable_path(script: str, switch: str = "PAGED_ATTN_NO_AVX512") -> None:
    """Runs `script` in a child Python with PAGED_ATTN_NO_AVX512=1 (what CPUs without AVX-512 run: the choice is
    made once per process; switch="PAGED_ATTN_AMX": the opt-in AMX path), with this process's path, so it can
    import the test modules; fails if the script does."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env[switch] = "1"
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=Path(__file__).resolve().parent / "ops")


def cpu_flags() -> set:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


# The CPU can take the opt-in AMX decode path (PAGED_ATTN_AMX=1, csrc/cpu/amx_kernels.h); the tests run it in a
# child process.
HAS_AMX = {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags() and "PAGED_ATTN_NO_AVX512" not in os.environ
