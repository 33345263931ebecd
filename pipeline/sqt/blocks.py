"""The ``.sqt`` metadata blocks built from a Hugging Face model and tokenizer directory (SPEC section 9): the
model config, where the tokenizer is, the ``vocab`` block, the ``config`` block (rope frequencies, image mean and
std). Kept apart from the tensor export, which only calls them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from pipeline.sqt.container import SqtError


def _json_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SqtError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else None


def model_config_of(file: Path, meta: dict[str, str], directory: Path | None):
    from transformers import AutoConfig

    if "config" in meta:
        try:
            cfg = json.loads(meta["config"])
        except ValueError as e:
            raise SqtError(f"{file}: metadata 'config' is not valid JSON ({e})") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
            raise SqtError(f"{file}: metadata 'config' is not a model config (no 'model_type')")
        return AutoConfig.for_model(**cfg)
    if directory is not None and (directory / "config.json").is_file():
        return AutoConfig.from_pretrained(str(directory))
    raise SqtError(f"{file}: no model config (neither metadata 'config' nor a config.json beside it)")


def tokenizer_dir(file: Path, meta: dict[str, str], directory: Path | None, tokenizer: str | None) -> Path:
    """Where the tokenizer files are: ``tokenizer``, the model directory, or the packed file's source model."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if not (path / "tokenizer.json").is_file():
            raise SqtError(f"{path}: --tokenizer: no tokenizer.json in this directory")
        return path
    if directory is not None and (directory / "tokenizer.json").is_file():
        return directory
    candidates = []
    for key in ("source_model", "teacher_dir", "teacher"):
        if meta.get(key):
            candidates.append(meta[key])
    for source in candidates:
        for base in (Path(source), file.parent / source):
            if (base / "tokenizer.json").is_file():
                return base
        try:
            from pipeline.teacher.source import local_dir

            found = local_dir(source)
        except Exception:  # noqa: BLE001 - not a directory or hub id: try the next candidate
            continue
        if (found / "tokenizer.json").is_file():
            return found
    raise SqtError(f"{file}: no tokenizer found (not beside the model, source_model "
                   f"{meta.get('source_model')!r} has none); pass --tokenizer DIR")


def _special_id(path: Path, added: dict[str, list[int]], token: str, required: bool = True) -> int | None:
    ids = added.get(token, [])
    if len(ids) > 1:
        raise SqtError(f"{path}: vocab: special token {token!r} has several ids {ids}")
    if not ids:
        if required:
            raise SqtError(f"{path}: vocab: special token {token!r} not found in the added tokens")
        return None
    return ids[0]


# The split pattern of the tokenizers library's ByteLevel pre-tokenizer when use_regex is set.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


LLAMA3_CHAT_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class SqtUnsupported(SqtError):
    """The model is well formed but the reference engine cannot run it (e.g. a chat format it does not build)."""


def vocab_block(directory: Path, config=None) -> dict:
    """The ``vocab`` metadata of SPEC section 9 from a Hugging Face tokenizer directory."""
    path = directory / "tokenizer.json"
    data = _json_file(path)
    if data is None:
        raise SqtError(f"{path}: tokenizer.json missing or not a JSON object")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise SqtError(f"{path}: vocab: the engine reads byte-level BPE tokenizers, this one is {model.get('type')!r}")
    if not model.get("ignore_merges", False):
        warnings.warn(f"{path}: the tokenizer does not set ignore_merges; the reference engine always "
                      f"matches whole tokens first (ignore_merges = true)", stacklevel=2)
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regex = [s["pattern"]["Regex"] for s in steps
             if s.get("type") == "Split" and isinstance(s.get("pattern"), dict) and "Regex" in s["pattern"]]
    # A ByteLevel step with use_regex splits by the GPT-2 pattern itself (SmolLM2, GPT-2): the same as a Split step.
    regex += [GPT2_PATTERN for s in steps if s.get("type") == "ByteLevel" and s.get("use_regex", True)]
    if len(regex) != 1 or not any(s.get("type") == "ByteLevel" for s in steps):
        raise SqtError(f"{path}: vocab.pre_tokenizer: expected one split pattern (a Split regex or a ByteLevel "
                       f"step with use_regex) and a ByteLevel step, got {[s.get('type') for s in steps]}")
    added: dict[str, list[int]] = {}
    tokens: dict[int, str] = {}
    for token, i in model.get("vocab", {}).items():
        tokens[int(i)] = token
    for t in data.get("added_tokens", []):
        added.setdefault(t["content"], []).append(int(t["id"]))
        tokens.setdefault(int(t["id"]), t["content"])
    if not tokens:
        raise SqtError(f"{path}: vocab: empty vocabulary")
    size = max(tokens) + 1
    missing = [i for i in range(size) if i not in tokens]
    if missing:
        raise SqtError(f"{path}: vocab: no token for ids {missing[:5]} (ids must run 0 .. {size - 1} without gaps)")
    merges, seen = [], set()
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a + b not in seen:
            seen.add(a + b)
            merges.append(a + b)
    template = None
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    else:
        tok_cfg = _json_file(directory / "tokenizer_config.json") or {}
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise SqtError(f"{directory}: vocab.chat_template: no chat_template.jinja nor a chat_template in "
                       f"tokenizer_config.json")
    absent = [t for t in LLAMA3_CHAT_TOKENS if t not in added]
    if absent:
        raise SqtUnsupported(f"{path}: vocab: the reference engine builds Llama 3 chat prompts and this tokenizer "
                             f"has no {', '.join(absent)} (its added tokens start {list(added)[:4]})")
    eot = _special_id(path, added, "<|eot_id|>")
    gen = _json_file(directory / "generation_config.json") or {}
    eos = gen.get("eos_token_id")
    if eos is None and config is not None:
        eos = getattr(getattr(config, "text_config", config), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return {
        "chat_template": template,
        "begin_of_text_id": _special_id(path, added, "<|begin_of_text|>"),
        "start_header_id": _special_id(path, added, "<|start_header_id|>"),
        "end_header_id": _special_id(path, added, "<|end_header_id|>"),
        "eot_id": eot,
        "stop_token_ids": sorted({int(i) for i in eos} | {eot}),
        "image_id": _special_id(path, added, "<|image|>", required=False),
        "pre_tokenizer": regex[0],
        "merges": merges,
        "vocab": [tokens[i] for i in range(size)],
    }


def rope_angular_frequency(text) -> list[float]:
    """Per-pair rotary angular frequencies, with Llama 3 rope scaling applied (as the reference)."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    params = dict(getattr(text, "rope_parameters", None) or {})
    scaling = dict(getattr(text, "rope_scaling", None) or {}) or params
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is None:
        raise SqtError("config: no rope_theta")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    freq = float(theta) ** -(torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    if kind == "llama3":
        z = ((scaling["original_max_position_embeddings"] * freq / (2 * torch.pi) - scaling["low_freq_factor"])
             / (scaling["high_freq_factor"] - scaling["low_freq_factor"]))
        freq = freq * torch.lerp(torch.tensor(1 / scaling["factor"]), torch.tensor(1.0), z.clip(0, 1))
    elif kind != "default":
        raise SqtError(f"config: rope_type {kind!r} is not supported by the engine (default or llama3)")
    return freq.tolist()


def _image_stats(directory: Path) -> tuple[list[float], list[float]]:
    for name in ("processor_config.json", "preprocessor_config.json"):
        cfg = _json_file(directory / name)
        if cfg is None:
            continue
        cfg = cfg.get("image_processor", cfg)
        if "image_mean" in cfg and "image_std" in cfg:
            return [float(v) for v in cfg["image_mean"]], [float(v) for v in cfg["image_std"]]
    raise SqtError(f"{directory}: config.vision.image_mean: no image processor config "
                   f"(processor_config.json / preprocessor_config.json with image_mean and image_std)")


def config_block(config, tok_dir: Path) -> dict:
    """``config`` metadata: ``text`` and ``vision`` (null for a text-only model)."""
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None)
    out = {"text": {
        "d_layers": text.num_hidden_layers,
        "d_vocab": text.vocab_size,
        "d_model": text.hidden_size,
        "d_mlp": text.intermediate_size,
        "d_attention_head": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "d_attention_q": text.num_attention_heads // text.num_key_value_heads,
        "d_attention_kv": text.num_key_value_heads,
        "d_sequence_max": text.max_position_embeddings,
        "norm_epsilon": float(text.rms_norm_eps),
        "rope_angular_frequency": rope_angular_frequency(text),
        "tied_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
        "cross_attention_layers": list(getattr(text, "cross_attention_layers", None) or []),
    }, "vision": None}
    if vision is not None:
        mean, std = _image_stats(tok_dir)
        out["vision"] = {
            "image_mean": mean, "image_std": std,
            "d_image": vision.image_size, "d_patch": vision.patch_size,
            "d_layers0": vision.num_hidden_layers, "d_layers1": vision.num_global_layers,
            "d_model": vision.hidden_size, "d_mlp": vision.intermediate_size,
            "d_attention_head": vision.hidden_size // vision.attention_heads,
            "d_attention_qkv": vision.attention_heads,
            "norm_epsilon": float(vision.norm_eps),
            "output_taps": list(vision.intermediate_layers_indices),
        }
    return out
