"""A GGUF model as a plain Hugging Face folder, for engines that read one (vLLM) and the tests that compare with them.

``convert_gguf_to_hf`` lets transformers' GGUF loader dequantize the weights to float32 and saves them, with the
tokenizer, as an ordinary ``*ForCausalLM`` folder (no quantization config); ``check_same_weights`` proves that a
Llama folder holds exactly our GGUF loader's float32 tensors; ``prepare_hf_dir`` does both for SmolLM2-135M-Instruct
once, in ``DEFAULT_HF_DIR``. Needs ``transformers`` and ``gguf`` (and ``safetensors`` to check).

    from paged_attn.engine import default_model_path, model_path
    from paged_attn.engine.hf_export import check_same_weights, convert_gguf_to_hf

    convert_gguf_to_hf(default_model_path(), "/tmp/smollm2-hf")
    check_same_weights("/tmp/smollm2-hf")  # -> the parameter count
    convert_gguf_to_hf(model_path("gemma3-270m"), "/tmp/gemma3-hf", add_bos_token=True)
"""

from __future__ import annotations

import os
import shutil

DEFAULT_HF_DIR = os.path.expanduser("~/.cache/paged_attn/smollm2-135m-hf")


def convert_gguf_to_hf(gguf_path: str, hf_dir: str, **tokenizer_kwargs) -> None:
    """Write the GGUF's weights, dequantized to float32 by transformers, as a plain folder of the model class
    transformers' GGUF loader picks (``LlamaForCausalLM`` for SmolLM2, ``Gemma3ForCausalLM`` for Gemma 3), with its
    tokenizer (``tokenizer_kwargs`` go to ``AutoTokenizer.from_pretrained``; Gemma 3 needs ``add_bos_token=True``:
    its GGUF tokenizer does not add the BOS by itself, as our engine's and llama.cpp's do). The folder appears
    whole or not at all (written next to it, then renamed)."""
    import torch
    import transformers

    folder, name = os.path.split(gguf_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # it describes the GGUF, not these float32 tensors
        del config.quantization_config
    # A fresh model: transformers refuses to save one that still carries the GGUF's quantizer.
    model = type(loaded)(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, **tokenizer_kwargs)
    partial = hf_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.rename(partial, hf_dir)


def check_same_weights(hf_dir: str) -> int:
    """Raise unless the folder's tensors equal our GGUF loader's float32 weights of the default model (SmolLM2);
    return the parameter count."""
    import torch
    from safetensors.torch import load_file

    from paged_attn.engine import LlamaModel

    ours = LlamaModel.from_gguf(dtype=torch.float32, use_onednn=False).state_dict()
    theirs = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            theirs.update(load_file(os.path.join(hf_dir, name)))
    if "lm_head.weight" not in ours:  # tied embeddings: save_pretrained may or may not write the copy
        theirs.pop("lm_head.weight", None)
    if set(ours) != set(theirs):
        raise RuntimeError(f"{hf_dir}: tensor names differ from our loader's: only ours "
                           f"{sorted(set(ours) - set(theirs))[:5]}, only theirs {sorted(set(theirs) - set(ours))[:5]}")
    different = [name for name in ours if theirs[name].dtype != torch.float32 or not torch.equal(ours[name],
                                                                                                 theirs[name])]
    if different:
        raise RuntimeError(f"{hf_dir}: {len(different)} tensors differ from our loader's, e.g. {different[:5]}")
    return sum(t.numel() for t in ours.values())


def prepare_hf_dir(hf_dir: str = DEFAULT_HF_DIR) -> int:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder in ``hf_dir``, converted once (later calls
    reuse it) and checked equal to our loader's weights every time; returns the parameter count."""
    from paged_attn.engine import default_model_path

    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        print(f"converting the GGUF to a Hugging Face folder in {hf_dir} (once)", flush=True)
        os.makedirs(os.path.dirname(hf_dir), exist_ok=True)
        convert_gguf_to_hf(default_model_path(), hf_dir)
    return check_same_weights(hf_dir)
