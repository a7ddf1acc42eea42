"""The one dispatch point between Triton and the PyTorch references, and the kernel launcher.

``use_triton(t)``: Triton for CUDA tensors when Triton is installed, the references while
torch.compile traces (a caller may force either path, e.g. tests that run kernels in Triton's
interpreter on CPU tensors).

``Launcher``: ``kernel[grid](*args)`` costs 13-30 us of host time per call in Triton 3.x,
most of it in the JIT's argument binding and specialization, and Triton's own launcher of a
compiled kernel (``CompiledKernel.run``) still costs about 15 us on the H200's host: a Python
wrapper, then a C function that parses every argument, constexprs included, and asks the
driver about each pointer. A Launcher keeps the compiled kernel of each specialization and
launches it through PyTorch's C++ launcher of Triton cubins (``torch._C._StaticCudaLauncher``,
the one Inductor's generated code uses; torch 2.7+), with the runtime arguments alone and the
tensors as their device addresses. Its key is a superset of what Triton's JIT specializes on:
each tensor's dtype and 16-byte alignment, each int's equality to 1, divisibility by 16 and
width, each constexpr's value, and the device. On a key it has not seen (and in the
interpreter, under a launch hook such as Proton's, or when the direct call is unavailable) it
goes through ``kernel[grid]``, which compiles, launches and returns the kernel to keep; a
kernel the static launcher cannot take (cluster launches, tensor descriptors, scratch memory)
is kept with Triton's own ``run``.
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


# PyTorch's C++ launcher of Triton cubins: ``(function, grid x, y, z, num_warps, shared bytes,
# argument types, arguments, stream)``, the arguments one character each in the types
_STATIC_LAUNCH = getattr(getattr(torch._C, "_StaticCudaLauncher", None), "_launch_kernel", None)

# Triton's scalar types as the static launcher reads them (Inductor's own table); a pointer
# ("*fp16", ...) is "O" and takes a device address as an int
_ARG_TYPES = {
    "i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l",
    "u1": "I", "u8": "B", "u16": "H", "u32": "I", "u64": "K",
    "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip


def static_entry(kernel, n_args: int, tensors: tuple = ()) -> tuple | None:
    """How the static launcher launches ``kernel`` (a Triton ``CompiledKernel`` of a
    ``@triton.jit`` function with ``n_args`` parameters, ``tensors`` the positions of its
    tensor arguments): ``(function, num_warps, shared, argument types, slots, trailing
    Nones)``, ``slots`` holding ``(position, index in tensors)`` of each runtime argument
    (-1 for a scalar); None where it cannot (no static launcher, an unknown argument type,
    scratch memory, clusters, cooperative or programmatic-dependent launches, tensor
    descriptors): the caller then keeps Triton's own ``run``."""
    if _STATIC_LAUNCH is None:
        return None
    meta = kernel.metadata
    src = getattr(kernel, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    signature = getattr(src, "signature", None)
    if names is None or signature is None or len(names) != n_args:
        return None
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "tensordesc_meta", None):
        return None
    if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        return None
    constants = getattr(src, "constants", {}) or {}
    types, slots = [], []
    for i, name in enumerate(names):
        ty = signature.get(name, signature.get(i))
        if ty is None:
            return None
        if ty == "constexpr" or name in constants or (i,) in constants or i in constants:
            continue
        if ty.startswith("*"):
            if i not in tensors:
                return None
            types.append("O")
            slots.append((i, tensors.index(i)))
        elif ty in _ARG_TYPES:
            types.append(_ARG_TYPES[ty])
            slots.append((i, -1))
        else:
            return None
    trailing = 0  # newer Triton passes its scratch buffers last: None when a kernel needs none
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, attr):
            if getattr(meta, attr):
                return None
            types.append("O")
            trailing += 1
    shared = kernel.shared if hasattr(kernel, "shared") else meta.shared
    return kernel.function, meta.num_warps, shared, "".join(types), tuple(slots), (None,) * trailing


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
    static = True  # class switch: False launches kept kernels with Triton's run (measurements)

    def __init__(self, fn, num_warps: int | None = None) -> None:
        self.fn = fn
        self._options = {} if num_warps is None else {"num_warps": num_warps}
        params = getattr(fn, "params", None)
        self._constexpr = tuple(p.is_constexpr for p in params) if params else None
        self._cache: dict = {}
        self._parts = None
        self.launches = [0, 0]  # kept kernels launched: statically, through Triton's run

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

    def key(self, args, device: int | None = None, ptrs=None) -> tuple:
        """The specialization key of ``args`` (the device: the first tensor's, unless given;
        ``ptrs``: the tensors' ``data_ptr()`` in order, when the caller has them)."""
        if self._parts is None:
            self._parts = self._partition(args)
        const, tensors, ints = self._parts
        if ptrs is None:
            ptrs = [args[i].data_ptr() for i in tensors]
        return (
            args[0].get_device() if device is None else device,
            tuple([args[i] for i in const]),
            tuple([args[i].dtype for i in tensors]),
            tuple([not p % 16 for p in ptrs]),
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
            if self._parts is None:
                self._parts = self._partition(args)
            ptrs = [args[i].data_ptr() for i in self._parts[1]]  # once: key and launch
            key = self.key(args, device, ptrs)
            entry = self._cache.get(key)
            if entry is not None and not _hooked():
                stream = torch._C._cuda_getCurrentRawStream(device)
                n = len(grid)
                gy, gz = (grid[1] if n > 1 else 1), (grid[2] if n > 2 else 1)
                static, run, function, metadata = entry
                if static is not None and self.static:
                    function, warps, shared, types, slots, trailing = static
                    # a slot: (position, index among the tensors, or -1 for a scalar)
                    values = [ptrs[j] if j >= 0 else args[i] for i, j in slots]
                    _STATIC_LAUNCH(function, grid[0], gy, gz, warps, shared, types,
                                   (*values, *trailing), stream)  # fmt: skip
                    self.launches[0] += 1
                    return
                run(grid[0], gy, gz, stream, function, metadata, None, None, None, *args)
                self.launches[1] += 1
                return
        kernel = self.fn[grid](*args, **self._options)
        if fast and not INTERPRETING and hasattr(kernel, "packed_metadata"):
            run = kernel.run  # first: binds Triton's launcher (and the function handle) now
            static = static_entry(kernel, len(args), self._parts[1])
            entry = (static, run, kernel.function, kernel.packed_metadata)
            self._cache[key] = entry
