"""Quantized checkpoints written the way the reference tools write them, from a tiny float model.

Round-to-nearest quantization (no calibration: the layout is what is tested, not the method) and packing
loops that follow the tools' own: AutoGPTQ's `pack` (codes along K, zero - 1 for the v1 format),
AutoAWQ's WQLinear_GEMM (codes along N in the order [0, 2, 4, 6, 1, 3, 5, 7]), compressed-tensors'
`pack_to_int32` (signed codes offset by 2**(bits - 1)), and FP8 e4m3 with per-tensor, per-channel or
block scales. Written independently of asyncengine.quantization, so each side checks the other.

`write_checkpoint` also writes the oracle: the same model with every quantized weight replaced by its
dequantized float32 value, as a plain HF checkpoint that transformers runs.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class Spec:
    fmt: str  # gptq | gptq_v2 | awq | compressed | fp8
    bits: int = 4
    group_size: int = 128  # -1: per channel
    sym: bool = True
    desc_act: bool = False
    fp8_scale: str = "tensor"  # tensor | channel | block
    fp8_block: tuple[int, int] = (32, 32)


class Quantized:
    """One weight's codes [N, K] (unsigned), scales [G, N] as stored, zeros [G, N] (unsigned), g_idx [K]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor):
        self.codes, self.scales, self.zeros, self.g_idx = codes, scales, zeros, g_idx

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, with the scales as stored
        g = self.g_idx.long()
        return (self.codes.float() - self.zeros.float()[g].t()) * self.scales.float()[g].t()


def groups_of(k: int, group_size: int, desc_act: bool, seed: int) -> torch.Tensor:
    """g_idx. Act-order: GPTQ quantizes columns by decreasing Hessian diagonal, and projections that read
    the same input (q/k/v, gate/up) share the Hessian, so they get the same order: `seed` names the input."""
    size = k if group_size == -1 else group_size
    if not desc_act:
        return torch.arange(k, dtype=torch.int32) // size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)  # group i // size of the i-th column quantized
    return g_idx


def gptq_rtn(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool) -> Quantized:
    """GPTQ's quantizer (min / max including 0), round to nearest; scales stored as float16."""
    maxq = 2**bits - 1
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    codes = torch.empty(n, k, dtype=torch.int32)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols]
        xmin = torch.clamp(x.min(1).values, max=0)
        xmax = torch.clamp(x.max(1).values, min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both_zero = (xmin == 0) & (xmax == 0)
        xmin[both_zero], xmax[both_zero] = -1, 1
        scale = (xmax - xmin) / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
        codes[:, cols] = torch.clamp(torch.round(x / scale[:, None]) + zero[:, None], 0, maxq).to(torch.int32)
        scales[g] = scale.half()
        zeros[g] = zero.to(torch.int32)
    return Quantized(codes, scales, zeros, g_idx)


def awq_rtn(w: torch.Tensor, group_size: int) -> Quantized:
    """AutoAWQ's pseudo-quantizer (asymmetric, zero point clamped to [0, 15]); scales stored as float16."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    g_idx = torch.arange(k, dtype=torch.int32) // size
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    codes = torch.empty(n, k, dtype=torch.int32)
    for g in range(groups):
        x = w[:, g * size : (g + 1) * size]
        mx, mn = x.amax(1), x.amin(1)
        scale = (mx - mn).clamp(min=1e-5) / 15
        zero = (-torch.round(mn / scale)).clamp(0, 15)
        codes[:, g * size : (g + 1) * size] = torch.clamp(
            torch.round(x / scale[:, None]) + zero[:, None], 0, 15
        )
        scales[g], zeros[g] = scale.half(), zero.to(torch.int32)
    return Quantized(codes, scales, zeros, g_idx)


# -- the tools' packing loops -------------------------------------------------------------------------
def autogptq_pack(
    codes: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool
) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's qlinear pack: qweight [K / per, N] along K; qzeros [G, N / per] along N (zero - 1 for v1,
    masked to `bits` bits as GPTQModel writes it, so a zero of 0 does not spill into its neighbours)."""
    per = 32 // bits
    intweight = codes.t().numpy().astype(np.uint32)  # [K, N]
    # AutoGPTQ sizes these `// 32 * bits` (it requires multiples of 32); the same for multiples of 32 / bits
    qweight = np.zeros((intweight.shape[0] * bits // 32, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + per):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += per
        row += 1
    z = ((zeros - 1) if v1 else zeros).numpy().astype(np.int64) & (2**bits - 1)
    z = z.astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] * bits // 32), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + per):
            qzeros[:, col] |= z[:, j] << (bits * (j - i))
        i += per
        col += 1
    return qweight.astype(np.int32), qzeros.astype(np.int32)


def autoawq_pack(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """WQLinear_GEMM.from_linear: qweight [K, N / 8], qzeros [G, N / 8], eight to a word in AWQ's order."""
    intweight = codes.t().numpy().astype(np.uint32)  # [K, N]
    z = zeros.numpy().astype(np.uint32)
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
            qzeros[:, col] |= z[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
    return qweight.astype(np.int32), qzeros.astype(np.int32)


def ct_pack_to_int32(signed: torch.Tensor, bits: int, packed_dim: int = 1) -> np.ndarray:
    """compressed-tensors' pack_to_int32: signed int8 values + 2**(bits - 1), LSB first, padded."""
    value = (signed.to(torch.int32) + (1 << (bits - 1))).numpy().astype(np.uint32)
    per = 32 // bits
    packed_size = math.ceil(value.shape[packed_dim] / per)
    padding = packed_size * per - value.shape[packed_dim]
    if packed_dim == 1:
        value = np.pad(value, [(0, 0), (0, padding)])
        packed = np.zeros((value.shape[0], packed_size), dtype=np.uint32)
        for i in range(per):
            packed |= value[:, i::per] << bits * i
    else:
        value = np.pad(value, [(0, padding), (0, 0)])
        packed = np.zeros((packed_size, value.shape[1]), dtype=np.uint32)
        for i in range(per):
            packed |= value[i::per, :] << bits * i
    return np.ascontiguousarray(packed).view(np.int32)


# -- per format: checkpoint tensors and the dequantized weight ------------------------------------------
def input_seed(prefix: str, seed: int) -> int:
    """One act-order permutation per layer input: q/k/v share one, gate/up one, o and down their own."""
    shared = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", prefix))
    return seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(shared)) % 1_000_003


def quantize_weight(prefix: str, w: torch.Tensor, spec: Spec, seed: int = 0) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    order_seed = input_seed(prefix, seed)
    if spec.fmt in ("gptq", "gptq_v2"):
        quant = gptq_rtn(w, spec.bits, groups_of(k, spec.group_size, spec.desc_act, order_seed), spec.sym)
        qweight, qzeros = autogptq_pack(quant.codes, quant.zeros, spec.bits, v1=spec.fmt == "gptq")
        tensors = {
            "qweight": torch.from_numpy(qweight),
            "qzeros": torch.from_numpy(qzeros),
            "scales": quant.scales,
            "g_idx": quant.g_idx,
        }
        return {f"{prefix}.{name}": t for name, t in tensors.items()}, quant.dequantize()
    if spec.fmt == "awq":
        quant = awq_rtn(w, spec.group_size)
        qweight, qzeros = autoawq_pack(quant.codes, quant.zeros)
        tensors = {
            "qweight": torch.from_numpy(qweight),
            "qzeros": torch.from_numpy(qzeros),
            "scales": quant.scales,
        }
        return {f"{prefix}.{name}": t for name, t in tensors.items()}, quant.dequantize()
    if spec.fmt == "compressed":
        quant = gptq_rtn(w, spec.bits, groups_of(k, spec.group_size, spec.desc_act, order_seed), spec.sym)
        offset = 1 << (spec.bits - 1)
        tensors = {
            "weight_packed": torch.from_numpy(ct_pack_to_int32(quant.codes - offset, spec.bits)),
            "weight_scale": quant.scales.t().contiguous(),  # [N, G]
            "weight_shape": torch.tensor([n, k], dtype=torch.int32),
        }
        if not spec.sym:
            zp = quant.zeros.t().contiguous() - offset  # [N, G] signed
            tensors["weight_zero_point"] = torch.from_numpy(ct_pack_to_int32(zp, spec.bits, packed_dim=0))
        if spec.desc_act:
            tensors["weight_g_idx"] = quant.g_idx
        return {f"{prefix}.{name}": t for name, t in tensors.items()}, quant.dequantize()
    if spec.fmt == "fp8":
        return quantize_fp8(prefix, w, spec)
    raise ValueError(spec.fmt)


def quantize_fp8(prefix: str, w: torch.Tensor, spec: Spec) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    if spec.fp8_scale == "block":
        bn, bk = spec.fp8_block
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        codes = (w / full).to(torch.float8_e4m3fn)
        return {f"{prefix}.weight": codes, f"{prefix}.weight_scale_inv": scale}, codes.float() * full
    if spec.fp8_scale == "tensor":
        scale = w.abs().max() / 448
        codes = (w / scale).to(torch.float8_e4m3fn)
        return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scale.reshape(())}, codes.float() * scale
    scale = w.abs().amax(1, keepdim=True) / 448  # [N, 1]
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scale}, codes.float() * scale


def quant_config(spec: Spec) -> dict[str, Any]:
    if spec.fmt in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": spec.bits,
            "group_size": spec.group_size,
            "desc_act": spec.desc_act,
            "sym": spec.sym,
            "checkpoint_format": spec.fmt,
        }
    if spec.fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    if spec.fmt == "fp8":
        cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if spec.fp8_scale == "block":
            cfg["weight_block_size"] = list(spec.fp8_block)
        return cfg
    weights = {
        "num_bits": spec.bits,
        "type": "int",
        "symmetric": spec.sym,
        "strategy": "channel" if spec.group_size == -1 else "group",
        "group_size": None if spec.group_size == -1 else spec.group_size,
        "actorder": "group" if spec.desc_act else None,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


def write_checkpoint(src: Path, dst: Path, oracle: Path, spec: Spec, seed: int = 0) -> tuple[Path, Path]:
    """`dst`: `src` quantized per `spec`; `oracle`: `src` with those weights dequantized (float32)."""
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if LINEAR.search(name):
            parts, deq = quantize_weight(name.removesuffix(".weight"), t.float(), spec, seed)
            quantized.update(parts)
            dequantized[name] = deq.contiguous()
        else:
            quantized[name] = t
            dequantized[name] = t
    config = json.loads((src / "config.json").read_text())
    for path, weights, extra in ((dst, quantized, quant_config(spec)), (oracle, dequantized, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
        cfg = dict(config, quantization_config=extra) if extra else config
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", path / "generation_config.json")
    return dst, oracle


def round_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """`--quantization int8` (and the int8 LM head), dequantized: symmetric per output row,
    scale = max |w| / 127 of the row."""
    w = w.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def round_int4_groups(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`--quantization int4` (and the int4 LM head), dequantized: per output row and `group` input columns
    (the last group may be shorter), code = round((w - min) / scale) with scale = (max - min) / 15."""
    w = w.float()
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group):
        block = w[:, start : start + group]
        lo, hi = block.amin(1, keepdim=True), block.amax(1, keepdim=True)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[:, start : start + group] = torch.round((block - lo) / scale).clamp(0, 15) * scale + lo
    return out


LOAD_TIME_ROUNDING = {"int8": round_int8_rows, "int4": round_int4_groups}
# GPT-2's linear layers are Conv1D: stored [in, out], so their output rows are the stored columns
GPT2_LINEAR = re.compile(r"(^|\.)h\.\d+\.(attn\.(c_attn|c_proj)|mlp\.(c_fc|c_proj))\.weight$")


def load_time_method(spec: Spec | str | None) -> str | None:
    """The --quantization flag a factory spec asks for: None and "int8" -> int8, "int4" -> int4, a Spec
    (a pre-quantized checkpoint) -> no flag."""
    if spec is None:
        return "int8"
    return spec if isinstance(spec, str) else None


def write_load_time_oracle(src: Path, oracle: Path, method: str) -> Path:
    """The oracle of `--quantization {method}` on `src`: each linear weight rounded as the method rounds
    it and dequantized to float32."""
    rounding = LOAD_TIME_ROUNDING[method]
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if LINEAR.search(name):
            out[name] = rounding(t).contiguous()
        elif GPT2_LINEAR.search(name):
            out[name] = rounding(t.t()).t().contiguous()
        else:
            out[name] = t
    oracle.mkdir(parents=True, exist_ok=True)
    save_file(out, str(oracle / "model.safetensors"))
    shutil.copy(src / "config.json", oracle / "config.json")
    return oracle
