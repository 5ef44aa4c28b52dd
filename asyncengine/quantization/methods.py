"""The linear method for a QuantConfig."""

from __future__ import annotations

from asyncengine.quantization.awq import AWQLinearMethod
from asyncengine.quantization.compressed import CompressedTensorsLinearMethod
from asyncengine.quantization.config import QuantConfig
from asyncengine.quantization.fp8 import FP8LinearMethod
from asyncengine.quantization.gptq import GPTQLinearMethod
from asyncengine.quantization.int4 import Int4LinearMethod
from asyncengine.quantization.int8 import Int8LinearMethod
from asyncengine.quantization.method import QuantLinearMethod

METHODS: dict[str, type[QuantLinearMethod]] = {
    "gptq": GPTQLinearMethod,
    "awq": AWQLinearMethod,
    "fp8": FP8LinearMethod,
    "compressed-tensors": CompressedTensorsLinearMethod,
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
}


def make_linear_method(config: QuantConfig) -> QuantLinearMethod:
    return METHODS[config.method](config)
