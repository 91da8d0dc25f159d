"""Quantized expert formats (FP8 block, NVFP4, MXFP4): the format table, reference codecs, checkpoint reading."""

from freetoken.quant.formats import (
    BF16,
    FORMATS,
    MXFP4,
    NVFP4,
    ExpertFormat,
    ExpertLayout,
    QuantConfigError,
    QuantSpec,
    fp8_block,
    quant_spec,
)

__all__ = [
    "BF16",
    "FORMATS",
    "MXFP4",
    "NVFP4",
    "ExpertFormat",
    "ExpertLayout",
    "QuantConfigError",
    "QuantSpec",
    "fp8_block",
    "quant_spec",
]
