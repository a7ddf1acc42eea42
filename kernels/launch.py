"""The one dispatch point between Triton and the PyTorch references, and the kernel launcher.

``use_triton(t)``: Triton for CUDA tensors when Triton is installed, the references while
torch.compile traces (a caller may force either path, e.g. tests that run kernels in Triton's
interpreter on CPU tensors).

``Launcher``: ``kernel[grid](*args)`` costs 13-30 us of host time per call in Triton 3.x,
most of it in the JIT's argument binding and specialization. A Launcher keeps the compiled
kernel of each specialization and calls it directly (about as cheap as a torch op). Its key is
a superset of what Triton's JIT specializes on: each tensor's dtype and 16-byte alignment,
each int's equality to 1, divisibility by 16 and width, each constexpr's value, and the
device. On a key it has not seen (and in the interpreter, under a launch hook such as
Proton's, or when the direct call is unavailable) it goes through ``kernel[grid]``, which
compiles, launches and returns the kernel to keep.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "Launcher", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """The path for tensor ``t`` when the caller does not force one: Triton for CUDA tensors,
    except while torch.compile traces: there the references run, as plain torch ops that the
    compiler fuses into its own kernels (a kernel's launch code would reach Inductor as ops
    it may not lower: torch 2.11 fails on the bool-to-uint8 view that packs a dropout mask)."""
    return HAS_TRITON and t.is_cuda and not torch.compiler.is_compiling()


# Triton runs kernels in its interpreter: read once, as Triton reads it when a kernel is defined
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton, or no Triton
    _knobs = None


def _hooked() -> bool:
    """A launch hook is set (a profiler such as Proton): only the JIT path calls it. Triton
    3.6+ keeps hooks in a ``HookChain``, present and empty by default."""
    if _knobs is None:
        return False
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """Launches one ``@triton.jit`` kernel with its compiled specializations kept.

    Args:
        fn: the ``@triton.jit`` function.
        num_warps: warps per program (Triton's default, 4, when None); one Launcher per
            value, each with its own compiled kernels.

    Call ``launcher(grid, *args)`` with every parameter of the kernel in order, constexprs
    included, positionally (as ``fn[grid](*args)`` takes them). Each position keeps the kind
    of argument (tensor, int or other) it had on the first call.
    """

    direct = True  # class switch: False sends every launch through kernel[grid] (tests, debugging)

    def __init__(self, fn, num_warps: int | None = None) -> None:
        self.fn = fn
        self._options = {} if num_warps is None else {"num_warps": num_warps}
        params = getattr(fn, "params", None)
        self._constexpr = tuple(p.is_constexpr for p in params) if params else None
        self._cache: dict = {}
        self._parts = None

    def _partition(self, args) -> tuple:
        """Positions of the constexprs (and other non-tensor, non-int values: keyed by value),
        the tensors and the ints."""
        const, tensors, ints = [], [], []
        for i, (a, c) in enumerate(zip(args, self._constexpr, strict=True)):
            if not c and isinstance(a, torch.Tensor):
                tensors.append(i)
            elif not c and isinstance(a, int) and not isinstance(a, bool):
                ints.append(i)
            else:
                const.append(i)
        return tuple(const), tuple(tensors), tuple(ints)

    def key(self, args, device: int | None = None) -> tuple:
        """The specialization key of ``args`` (the device: the first tensor's, unless given)."""
        if self._parts is None:
            self._parts = self._partition(args)
        const, tensors, ints = self._parts
        return (
            args[0].get_device() if device is None else device,
            tuple([args[i] for i in const]),
            tuple([(args[i].dtype, not args[i].data_ptr() % 16) for i in tensors]),
            tuple([(args[i] == 1, not args[i] % 16, -2147483648 <= args[i] <= 2147483647)
                   for i in ints]),
        )  # fmt: skip

    def __call__(self, grid: tuple, *args) -> None:
        device = args[0].get_device()  # -1 for a CPU tensor
        if device >= 0 and device != torch._C._cuda_getDevice():
            # Triton (and a cached kernel's function handle) target the current device
            with torch.cuda.device(device):
                return self(grid, *args)
        fast = device >= 0 and self.direct and self._constexpr is not None
        if fast:
            key = self.key(args, device)
            entry = self._cache.get(key)
            if entry is not None and not _hooked():
                run, function, metadata = entry
                stream = torch._C._cuda_getCurrentRawStream(device)
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function,
                    metadata, None, None, None, *args)  # fmt: skip
                return
        kernel = self.fn[grid](*args, **self._options)
        if fast and not INTERPRETING and hasattr(kernel, "packed_metadata"):
            run = kernel.run  # first: binds the launcher (and the function handle) now
            self._cache[key] = (run, kernel.function, kernel.packed_metadata)
