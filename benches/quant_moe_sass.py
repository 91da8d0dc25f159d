"""SASS instruction counts of the quantized grouped kernels (`fused_moe_quant`), compiled for sm_90 without a GPU:
Triton's `triton.compile` for GPUTarget("cuda", 90, 32) with the ptxas, nvdisasm and cuobjdump its wheel ships.

    python benches/quant_moe_sass.py [--formats fp8 nvfp4 mxfp4] [--block-m 16 64] [--scale-modes f32 bf16]
                                     [--unaligned-stride]

For each format, M tile, 4-bit scale mode (`fused_moe_quant.SCALE_MODES`, default all) and kernel (Qwen3-30B-A3B:
H 2048, I 768): the K loop's instructions per thread and per weight, its shared-memory operations (LDS*, STS*, BAR:
layout conversions and cp.async stages), the kernel's registers and stack, and the loop's most frequent opcodes; a
compile error here is one the GPU would hit (the interpreter accepts more). Integer arguments and pointers are
declared 16-divisible, as Triton specializes them at a real launch on the pool's slots (`EXPERT_ALIGN`-byte strides);
--unaligned-stride declares the expert stride not 16-divisible, as a launch on experts packed at expert_nbytes gets
for NVFP4 (2654220 bytes here): the weights' loads lose their alignment and go by byte.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are defined: compile them, do not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from freetoken.kernels import fused_moe_gemv as gemv
from freetoken.kernels import fused_moe_quant as fmq
from freetoken.kernels.moe_tiles import FORMAT_IDS
from freetoken.quant import MXFP4, NVFP4, fp8_block

HIDDEN, INTER = 2048, 768
FORMATS = {"fp8": fp8_block(), "nvfp4": NVFP4, "mxfp4": MXFP4}
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16", "weight_ptr": "*bf16", "w_ptr": "*u8"}
POINTERS |= {"sorted_pair_ptr": "*i64", "block_expert_ptr": "*i64"}
NOT_16_DIVISIBLE = {"num_pairs", "top_k"}


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the longest backward-branch loop in `sass` (nvdisasm -c output)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if m := re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line):
            ins.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
        elif m := re.match(r"\.(L_x_\d+):", line.strip()):
            labels[m.group(1)] = len(ins)
    loops = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    # innermost loops (no other loop inside), the longest of them: the K loop, also where it sits in a row loop
    inner = [(a, b) for a, b in loops if not any(a <= c and d < b and (c, d) != (a, b) for c, d in loops)]
    if not inner:
        return []
    a, b = max(inner, key=lambda span: span[1] - span[0])
    return [t.split()[0] for t in ins[a : b + 1]]


def compile_sass(kernel, constants: dict, num_warps: int, num_stages: int, not_divisible: set[str]):
    """(SASS text, registers, stack bytes) of `kernel` compiled for sm_90 with `constants`."""
    args_ = [a for a in kernel.arg_names if a not in constants]
    signature = {a: "constexpr" if a in constants else POINTERS.get(a, "i32") for a in kernel.arg_names}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in args_ if a not in not_divisible}
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
        usage = subprocess.run(
            [os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs, stack = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "STACK"))  # type: ignore[union-attr]
    return sass, regs, stack


def report(label: str, sass: str, regs: str, stack: str, per_thread: float) -> None:
    """One line: the K loop's instructions per thread and per weight (`per_thread` weights per thread per K step),
    its shared-memory operations, registers, stack, flush-to-zero float operations anywhere in the kernel (the
    gemv kernels' e2m1 0.5 codes are float32 subnormals) and the loop's most frequent opcodes."""
    ops = loop_ops(sass)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    top = ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda t: -t[1])[:8])
    shared = {kind: sum(n for op, n in counts.items() if op.startswith(kind)) for kind in ("LDS", "STS", "BAR")}
    ftz = len(re.findall(r"\.FTZ", sass))
    print(
        f"{label}: loop {len(ops)} instructions per thread, {len(ops) / per_thread:.1f} per weight, "
        f"LDS {shared['LDS']} STS {shared['STS']} BAR {shared['BAR']}; {regs} registers, stack {stack}; "
        f"FTZ {ftz}; {top}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 64], choices=[16, 64])
    parser.add_argument("--scale-modes", nargs="+", default=list(fmq.SCALE_MODES), choices=list(fmq.SCALE_MODES))
    parser.add_argument("--unaligned-stride", action="store_true", help="the expert stride not 16-divisible")
    parser.add_argument("--kernels", nargs="+", default=["mma", "gemv"], choices=["mma", "gemv"])
    parser.add_argument(
        "--gemv-config",
        type=int,
        nargs=4,
        metavar=("N", "K", "WARPS", "PREFETCH"),
        help="one `GemvConfig` for both gemv kernels; default: each kernel's of fused_moe_gemv.GEMV_CONFIGS",
    )
    args = parser.parse_args()
    not_divisible = NOT_16_DIVISIBLE | ({"stride_we"} if args.unaligned_stride else set())
    if "mma" in args.kernels:
        mma(args, not_divisible)
    if "gemv" in args.kernels:
        for name in args.formats:
            fmt = FORMATS[name]
            defaults = gemv.GEMV_CONFIGS[fmt.weight_bits]
            kernels = ((gemv._gate_up_gemv_kernel, HIDDEN, 2), (gemv._down_gemv_kernel, INTER, 1))
            for (kernel, num_in, rows), default in zip(kernels, defaults, strict=True):
                config = tuple(args.gemv_config) if args.gemv_config else default
                constants = gemv._launch_meta(fmt, config, 16, num_in)  # type: ignore[arg-type]
                warps = constants.pop("num_warps")
                constants["WORD_ACTIVATIONS"] = True  # bf16 activations, as served
                step = constants["BLOCK_SIZE_K"]
                sass, regs, stack = compile_sass(kernel, constants, warps, 1, not_divisible)
                label = f"{kernel.__name__:>22} {name:>5} gemv ({rows * config[0]} x {step}, {warps} warps)"
                report(label, sass, regs, stack, rows * config[0] * step / (32 * warps))


def mma(args, not_divisible: set[str]) -> None:
    """The tensor-core kernels (`fused_moe_quant`) at each format, M tile and scale mode."""
    cases = [
        (f, m, mode)
        for f in args.formats
        for m in args.block_m
        for mode in (args.scale_modes if FORMATS[f].weight_bits == 4 else ["-"])
    ]
    for name, block_m, mode in cases:
        fmt = FORMATS[name]
        config = fmq.launch_config(fmt, 8 if block_m == 16 else 4096)
        for kernel, num_in in ((fmq._gate_up_quant_kernel, HIDDEN), (fmq._down_quant_kernel, INTER)):
            block_n, block_k = fmq._blocks(fmt, config, num_in)
            constants = {
                "FORMAT": FORMAT_IDS[fmt.name],
                "BLOCK_ROWS": fmt.block_rows,
                "BLOCK_COLS": fmt.block_cols,
                "HAS_TENSOR_SCALE": fmt.tensor_scale,
                "SPLIT_ACTIVATIONS": False,
                "SCALE_MODE": fmq.SCALE_MODES.get(mode, 0),
                # the wrapper's choice for aligned slots and bf16 activations (`fused_moe_quant_tiles`)
                "WORD_ACTIVATIONS": fmq.WORD_LOADS and fmt.weight_bits == 4,
                "SCALE_WORDS": fmq.WORD_LOADS and fmt.weight_bits == 4 and fmq._scale_words(fmt, num_in, block_k),
                "BLOCK_SIZE_M": block_m,
                "BLOCK_SIZE_N": block_n,
                "BLOCK_SIZE_K": block_k,
            }
            sass, regs, stack = compile_sass(kernel, constants, config[2], config[3], not_divisible)
            weights = 2 if kernel is fmq._gate_up_quant_kernel else 1
            label = f"{kernel.__name__:>22} {name:>5} {mode:>4} M tile {block_m:>2} ({block_n} x {block_k})"
            report(label, sass, regs, stack, weights * block_k * block_n / (32 * config[2]))


if __name__ == "__main__":
    main()
