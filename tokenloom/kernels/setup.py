"""Build every C++ kernel this CPU runs, ahead of time: ``python -m tokenloom.kernels.setup``.

``make setup`` runs it once, so no user call waits ~2 minutes for the compiler or prints a
"compiling" line into its output. Each kernel is built for the fastest instruction set this CPU
has (AVX-512 VNNI, AVX-512 or AVX2, chosen at run time as when it is loaded); a build already in
torch's extension cache is only loaded, so running this again costs a second or two.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def kernels() -> list[tuple[str, Callable[[], object]]]:
    """(what, a call that builds and loads it: falsy if it cannot be) for every kernel."""
    from tokenloom.attention import cpu_decode, cpu_latent, cpu_prefill
    from tokenloom.layers import fused, grouped, op_tape, prepacked, ssm_scan
    from tokenloom.lora import kernel as lora_kernel
    from tokenloom.quant.gguf import tensor as ggml
    from tokenloom.quant.int8 import kernels as quant_kernels
    from tokenloom.sampling import kernels as sampler_kernels

    found = [
        ("paged decode attention", cpu_decode.ops),
        ("paged prefill attention", cpu_prefill.ops),
        ("latent decode attention", cpu_latent.build),
        ("grouped matrix-vector", grouped.kernel_built),
        ("Mamba-2 decode step", ssm_scan.build),
        ("fused decoder ops", fused.build),
        ("op tape replayer", op_tape.tape_module),
        ("int8/int4 kernels", quant_kernels.available),
        ("GGUF block kernels", ggml.ops),
        ("float32 linear panels", prepacked.build),
        ("sampler selection kernels", sampler_kernels.build),
        ("batched LoRA", lora_kernel.kernel_built),
    ]
    return found


def main() -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="tokenloom: %(message)s", stream=sys.stderr)
    for what, build in kernels():
        start = time.perf_counter()
        ok = bool(build())
        print(
            f"tokenloom: {what}: {'ready' if ok else 'not built (its slower torch path runs)'} "
            f"({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
        )
    return 0  # a kernel that cannot be built is not an error: its torch fallback runs (and said why)


if __name__ == "__main__":
    sys.exit(main())
