"""Builds one model shard from a HF directory and streams its safetensors weights into it."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers.parallel import ParallelContext
from asyncengine.model_config import is_self_contained, model_max_len, read_model_config
from asyncengine.quantization.config import LOAD_TIME_METHODS, parse_quant_config
from asyncengine.quantization.context import building_with
from asyncengine.quantization.method import QuantLinearMethod
from asyncengine.quantization.methods import make_linear_method

__all__ = ["get_model_config", "lm_head_cost", "load_model", "model_dtype", "model_max_len"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
# decoder-layer index in a checkpoint name: model.layers.3. (Llama family), transformer.h.3. / h.3. (GPT-2)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def get_model_config(model_dir: str) -> Any:
    """The directory's config for the model code, read locally (never downloads).

    config.json as it is (a model_config.ModelConfig) when it spells out every field the model code
    reads (model_config.is_self_contained): transformers' config machinery then stays unimported, the
    largest part of a worker's start-up after torch (about 2 s: its config classes import
    torch._dynamo and torch.distributed.tensor). Otherwise transformers' AutoConfig, with its per-class
    defaults and RoPE conventions."""
    cfg = read_model_config(model_dir)
    if is_self_contained(cfg):
        return cfg
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {e}") from e


def model_dtype(hf_config: Any) -> torch.dtype:
    """The dtype the checkpoint was saved in (config `dtype`, or `torch_dtype` before transformers 4.56)."""
    raw = getattr(hf_config, "dtype", None)
    if raw is None:
        raw = vars(hf_config).get("torch_dtype")
    if raw is None or raw == "auto":
        return torch.float32
    if isinstance(raw, torch.dtype):
        return raw
    name = str(raw).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported model dtype {raw!r}")
    return _DTYPES[name]


def lm_head_cost(hf_config: Any) -> float:
    """The LM head's matmul work in decoder layers' worth, for balancing pipeline stages.

    Per token a decoder layer multiplies by its attention and MLP weights, the head by a
    [vocab, hidden] matrix; but the head only runs for tokens that sample (every decode token, one
    per prompt), so its cost is halved: a middle between decode-bound and prefill-bound work."""
    hidden = int(getattr(hf_config, "hidden_size", 0) or getattr(hf_config, "n_embd", 0))
    vocab = int(getattr(hf_config, "vocab_size", 0))
    if not hidden or not vocab:
        return 0.0
    heads = int(getattr(hf_config, "num_attention_heads", 0) or getattr(hf_config, "n_head", 1))
    kv_heads = int(getattr(hf_config, "num_key_value_heads", 0) or heads)
    inter = int(getattr(hf_config, "intermediate_size", 0) or getattr(hf_config, "n_inner", 0) or 4 * hidden)
    gated = not hasattr(hf_config, "n_embd")  # Llama-family MLPs have gate, up and down; GPT-2 two
    attention = 2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads
    layer = attention + (3 if gated else 2) * hidden * inter
    return 0.5 * vocab * hidden / layer


def load_model(
    model_dir: str,
    parallel: ParallelContext,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
    quantization: str | None = None,
    lm_head_quantization: str | None = None,
) -> nn.Module:
    """Builds this rank's shard of the model on `device` in `dtype` and loads its weights.

    Raises ModelLoadError for an unknown architecture, missing / unreadable weight files, mismatched shapes,
    or any parameter of this shard that no checkpoint tensor filled.
    """
    from asyncengine.models.registry import resolve_model_class  # here: config readers need no model code

    hf_config = get_model_config(model_dir)
    model_class = resolve_model_class(hf_config)
    method = quant_method_for(hf_config, model_class, quantization)
    with _default_dtype(dtype), torch.device(device), building_with(method):
        model = model_class(hf_config, parallel)
    model.requires_grad_(False)
    loaded = model.load_weights(_iter_weights(_weight_files(Path(model_dir)), parallel, progress))  # type: ignore[operator]
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if method is not None:  # tensors a checkpoint may leave out (GPTQ's g_idx)
        missing = [name for name in missing if not method.optional(name.rsplit(".", 1)[-1])]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"{model_dir}: no weights found for {len(missing)} parameter(s): {shown}")
    if method is not None:
        for module in model.modules():  # codes and scales into each kernel's layout
            if callable(getattr(module, "process_weights_after_loading", None)):
                module.process_weights_after_loading()
    if lm_head_quantization is not None:
        from asyncengine.layers.embedding import ParallelLMHead

        for module in model.modules():
            if isinstance(module, ParallelLMHead):
                module.quantize(lm_head_quantization)
    return model.eval()


def quant_method_for(hf_config: Any, model_class: type, quantization: str | None) -> QuantLinearMethod | None:
    """The linear method for the checkpoint's `quantization_config` and --quantization; None if neither."""
    qconfig = parse_quant_config(getattr(hf_config, "quantization_config", None), quantization)
    if qconfig is None:
        return None
    if qconfig.method not in LOAD_TIME_METHODS and model_class.__name__ == "GPT2LMHeadModel":
        raise ModelLoadError(f"{qconfig.method} checkpoints are read for the Llama family, not GPT-2")
    return make_linear_method(qconfig)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # parameters are created in the target dtype directly, never as a float32 copy first
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"unreadable {index}: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise ModelLoadError(f"{model_dir}: weight files listed in {index.name} are missing: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir} (pickled .bin checkpoints are not loaded)"
        )
    return files


def _iter_weights(
    files: list[Path], parallel: ParallelContext, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor this stage may need, read one at a time."""
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    def wanted(name: str) -> bool:  # other stages' layers are never read from disk
        match = _LAYER.search(name)
        return match is None or parallel.owns_layer(int(match.group(1)))

    try:
        names: list[tuple[Path, list[str]]] = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names.append((path, [k for k in f.keys() if wanted(k)]))
        with tqdm(
            total=sum(len(k) for _, k in names), desc="loading weights", unit="tensor", disable=not progress
        ) as bar:
            for path, keys in names:
                with safe_open(str(path), framework="pt") as f:
                    for key in keys:
                        yield key, f.get_tensor(key)
                        bar.update(1)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read weights: {e}") from e
