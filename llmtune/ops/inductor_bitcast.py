"""Bitcasts in registers for torch.compile's C++ (CPU) backend, while BF16AdamW's compiled step runs.

Inductor's C++ backend has no vector form of a bitcast (`Tensor.view(dtype)` of a computed value between float32
and int32): it stores the vector, converts it element by element, and loads it back. BF16AdamW's stochastic rounding
bitcasts six times per element (three values to bits and back), and that detour made its compiled step on a
4M-element tensor 3.2x torch's fused AdamW, against 1.0x in registers (1.69 against 0.59 ns per element, 2 cores,
Zen 4). ATen's vector types bitcast in registers (`at::vec::cast`, a reinterpretation); `vector_bitcasts()` has
inductor emit that for vectors of 32-bit floats and ints, and leaves every other case, and every other backend
(Triton on CUDA), to inductor.

Scoped in time, not in space: the patch is in place only while BF16AdamW's compiled step runs (inductor compiles
inside its first call), but for the whole process: a graph another thread compiles meanwhile gets the register
bitcasts too (as exact: a bitcast is a reinterpretation either way). Inductor's caches (the FX graph and AOTAutograd
caches, on disk and shared by every process and run) key a graph by its code and inductor's config, which the patch
changes neither of: a graph compiled without it (an older llmtune, a benchmark's baseline) would be served to the
patched compile, the scalar detour with it, and the reverse. So every graph compiled under the patch is keyed apart, by
`torch.compiler.config.cache_key_tag` (the tag torch adds to its caches' keys, the user's own kept in it).
Where inductor's internals are not what this expects (another torch version), nothing is patched nor keyed.

The upstream fix, which makes this module unnecessary: `CppVecOverrides.to_dtype_bitcast` in
torch/_inductor/codegen/cpp.py emitting `at::vec::cast` for a vector whose source and target dtypes have one width
(float32/int32, float64/int64, bfloat16/float16/int16), as this does for the 32-bit pair, in place of the
scalarised fallback `CppVecOverrides._initialize_scalarize` installs. No release has it yet (2.13, the newest
checked, scalarises); the first that does is the version from which this patch is unnecessary, and it stands aside
there on its own: it replaces only the scalarised fallback (`_scalarised`), so nothing is patched nor keyed apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_WORDS = (torch.float32, torch.int32)
# What the patched compiles add to torch's cache keys; a new value where the emitted code changes.
CACHE_KEY_TAG = "llmtune.vector_bitcasts.v1"


def _vector_bitcast(cpp: Any, kernel: Any, x: Any, dtype: torch.dtype) -> Any:
    """The C++ expression reinterpreting vector `x` as `dtype`, one `at::vec::cast` per vector register."""
    target = cpp.DTYPE_TO_CPP[dtype]
    registers = kernel._get_num_vectors(dtype)  # a 32-element tile of floats is two 16-lane AVX-512 registers
    if registers == 1:
        expr = f"at::vec::cast<{target}>({x})"
    else:
        expr = (
            f"[&]() {{ at::vec::VectorizedN<{target}, {registers}> out; "
            f"for (int i = 0; i < {registers}; i++) out[i] = at::vec::cast<{target}>({x}[i]); return out; }}()"
        )
    result = kernel.cse.generate(kernel.compute, expr)
    result.update_on_args("to_dtype_bitcast", (x, dtype), {})
    return result


def _scalarised(override: Any) -> bool:
    """Whether inductor's `to_dtype_bitcast` for vectors is the element-by-element fallback its `_scalarize` makes."""
    return "._scalarize." in getattr(getattr(override, "__func__", None), "__qualname__", "")


@contextmanager
def vector_bitcasts() -> Iterator[None]:
    """While inside, inductor's C++ vector kernels bitcast float32 <-> int32 in registers, and what it compiles is
    cached under keys of its own (`CACHE_KEY_TAG`)."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.virtualized import V

        scalarised = cpp.CppVecOverrides.__dict__["to_dtype_bitcast"]
        cpp.DTYPE_TO_CPP, cpp.CppCSEVariable  # noqa: B018 (what the patch uses, present before anything is patched)
    except (ImportError, AttributeError, KeyError):
        scalarised = None
    if not _scalarised(scalarised):  # internals other than this expects, or torch bitcasts vectors itself
        yield
        return

    def to_dtype_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
        kernel = V.kernel
        vector = isinstance(x, cpp.CppCSEVariable) and x.is_vec and hasattr(kernel, "_get_num_vectors")
        if vector and dtype in _WORDS and src_dtype in _WORDS:
            return _vector_bitcast(cpp, kernel, x, dtype)
        return scalarised.__func__(x, dtype, src_dtype)

    tag = "+".join(filter(None, (torch.compiler.config.cache_key_tag, CACHE_KEY_TAG)))
    cpp.CppVecOverrides.to_dtype_bitcast = staticmethod(to_dtype_bitcast)
    try:
        with torch.compiler.config.patch(cache_key_tag=tag):
            yield
    finally:
        cpp.CppVecOverrides.to_dtype_bitcast = scalarised
