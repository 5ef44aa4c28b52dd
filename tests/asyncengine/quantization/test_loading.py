"""Quantized checkpoints load into every projection of the Llama-family models, on one rank and on each
of two tensor-parallel ranks (built in-process: the ranks' outputs are assembled here, no processes),
and each projection computes what the dequantized float32 weight computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ODD_SHAPES
from quant_writer import Spec, load_time_method
from safetensors.torch import load_file

from asyncengine.errors import ModelLoadError
from asyncengine.layers.parallel import ParallelContext
from asyncengine.models.loader import load_model

SPECS = {
    "gptq4-g32": Spec("gptq", 4, 32),
    "gptq4-g64-asym-actorder": Spec("gptq", 4, 64, sym=False, desc_act=True),
    "gptq4-g128-v2": Spec("gptq_v2", 4, 128),
    "gptq8-channel": Spec("gptq", 8, -1),
    "gptq8-g32-asym-actorder": Spec("gptq", 8, 32, sym=False, desc_act=True),
    "awq-g64": Spec("awq", 4, 64),
    "awq-g128": Spec("awq", 4, 128),
    "ct-w4a16-g32": Spec("compressed", 4, 32),
    "ct-w8a16-channel-asym": Spec("compressed", 8, -1, sym=False),
    "ct-w4a16-actorder": Spec("compressed", 4, 32, desc_act=True),
    "fp8-tensor": Spec("fp8", fp8_scale="tensor"),
    "fp8-channel": Spec("fp8", fp8_scale="channel"),
    "fp8-block": Spec("fp8", fp8_scale="block", fp8_block=(32, 64)),
    "int8": None,
    "int4": "int4",
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def expected_outputs(oracle: dict[str, torch.Tensor], layer: int, x: dict[str, torch.Tensor]) -> dict:
    out = {}
    for proj in PROJECTIONS:
        block = "self_attn" if proj[0] in "qkvo" else "mlp"
        w = oracle[f"model.layers.{layer}.{block}.{proj}.weight"].float()
        inp = x["o"] if proj == "o_proj" else x["down"] if proj == "down_proj" else x["hidden"]
        out[proj] = inp @ w.t()
        bias = oracle.get(f"model.layers.{layer}.{block}.{proj}.bias")
        if bias is not None and proj not in ("o_proj", "down_proj"):
            out[proj] = out[proj] + bias
    return out


def engine_outputs(model: Any, layer: int, x: dict[str, torch.Tensor], tp: int, rank: int) -> dict:
    block = model.model.layers[str(layer)]
    attn, mlp = block.self_attn, block.mlp
    qkv = attn.qkv_proj(x["hidden"])  # column-parallel: this rank's heads
    q, k, v = attn.qkv_proj.split_qkv(qkv)
    gate, up = mlp.gate_up_proj(x["hidden"]).chunk(2, dim=-1)
    o_in = x["o"].chunk(tp, dim=-1)[rank]
    down_in = x["down"].chunk(tp, dim=-1)[rank]
    return {
        "q_proj": q,
        "k_proj": k,
        "v_proj": v,
        "gate_proj": gate,
        "up_proj": up,
        "o_proj": attn.o_proj.matmul(o_in, None),  # row-parallel: a partial sum
        "down_proj": mlp.down_proj.matmul(down_in, None),
    }


def check(
    quantized: Any, oracle_dir: Any, tp: int, arch_cfg: dict[str, int], quantization: str | None
) -> None:
    oracle = load_file(str(oracle_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    hidden, inter = arch_cfg["hidden"], arch_cfg["inter"]
    x = {
        "hidden": torch.randn(5, hidden, generator=gen),
        "o": torch.randn(5, arch_cfg["q"], generator=gen),
        "down": torch.randn(5, inter, generator=gen),
    }
    parts: list[dict] = []
    for rank in range(tp):
        parallel = ParallelContext(tp_rank=rank, tp_size=tp)
        model = load_model(
            str(quantized), parallel, torch.float32, torch.device("cpu"), quantization=quantization
        )
        assert all(m.quant_weight is not None for m in model.modules() if getattr(m, "quant_method", None))
        parts.append({i: engine_outputs(model, i, x, tp, rank) for i in range(2)})
    for i in range(2):
        expected = expected_outputs(oracle, i, x)
        for proj in PROJECTIONS:
            ranks = [p[i][proj] for p in parts]
            got = sum(ranks) if proj in ("o_proj", "down_proj") else torch.cat(ranks, dim=-1)
            torch.testing.assert_close(got, expected[proj], rtol=1e-5, atol=2e-5, msg=f"layer {i} {proj}")


SHAPES = {"hidden": 96, "inter": 160, "q": 96}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_format_loads_and_matches_the_dequantized_weights(name, tp, quantized_factory) -> None:
    quantized, oracle = quantized_factory("llama", SPECS[name], **ODD_SHAPES)
    check(quantized, oracle, tp, SHAPES, load_time_method(SPECS[name]))


@pytest.mark.parametrize(
    ("arch", "name"), [("qwen2", "gptq4-g64-asym-actorder"), ("qwen2", "awq-g64"), ("qwen3", "fp8-block")]
)
def test_qwen_families_load_quantized(arch, name, quantized_factory) -> None:
    """Qwen2's q/k/v biases stay full precision next to quantized weights; Qwen3's head_dim is explicit."""
    overrides = dict(ODD_SHAPES, head_dim=32) if arch == "qwen3" else ODD_SHAPES
    quantized, oracle = quantized_factory(arch, SPECS[name], **overrides)
    q = 128 if arch == "qwen3" else 96
    check(quantized, oracle, 2, dict(SHAPES, q=q), None)


def test_a_missing_quantized_tensor_is_named(quantized_factory, tmp_path) -> None:
    quantized, _ = quantized_factory("llama", SPECS["gptq4-g32"], **ODD_SHAPES)
    from safetensors.torch import save_file

    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((quantized / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="down_proj.scales"):
        load_model(str(tmp_path), ParallelContext(), torch.float32, torch.device("cpu"))
