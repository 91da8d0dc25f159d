"""Shared memory that a Triton kernel needs on a CUDA architecture, from Triton's compiler alone (no GPU).

Triton fixes a kernel's shared-memory size when it lowers the kernel to LLVM IR (the `shared` entry of its
metadata, what the launcher checks against the device's limit and raises `OutOfResources` for), so the stages up
to "llir" run here without a device or ptxas. Uses Triton's compiler internals (`ASTSource`, backend stages) as
Triton 3.x lays them out. Run as a script in a process without TRITON_INTERPRET (under the interpreter `triton.jit`
gives no compilable kernel):

    python tests/triton_shared_memory.py MODULE KERNEL '{"signature": {...}, "constexprs": {...}, "num_stages": 2}'

prints the bytes.
"""

from __future__ import annotations

import importlib
import json
import sys


def shared_memory_bytes(
    kernel,
    signature: dict[str, str],
    constexprs: dict[str, int],
    num_stages: int,
    num_warps: int = 4,
    arch: int = 90,
) -> int:
    """Bytes of shared memory `kernel` (a `triton.jit` function) needs per block on CUDA compute capability `arch`.

    Args:
        signature: Triton type strings ("*fp32", "*bf16", "i32", "fp32") of the non-constexpr arguments; those not
            named are taken as "i32" (strides).
        constexprs: values of the constexpr arguments.
        num_stages, num_warps: launch options as given at the launch.
    """
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else signature.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(c),): v for c, v in constexprs.items()})
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_stages": num_stages, "num_warps": num_warps})
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = src.make_ir(target, options, codegen, backend.get_module_map(), context)
    metadata: dict = {}
    for ext in ("ttir", "ttgir", "llir"):
        module = stages[ext](module, metadata)
    return int(metadata["shared"])


if __name__ == "__main__":
    module, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    kernel = getattr(importlib.import_module(module), name)
    print(
        shared_memory_bytes(
            kernel,
            spec["signature"],
            spec["constexprs"],
            spec["num_stages"],
            spec.get("num_warps", 4),
            spec.get("arch", 90),
        )
    )
