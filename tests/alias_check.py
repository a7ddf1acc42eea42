"""A check, in eager mode and on any torch, for the class of autograd Functions that torch
2.11's compiler differentiates wrongly.

torch 2.11's Dynamo traces a Function's forward as a subgraph and also returns each tensor
that an op in it produced; when the tensor the forward returns is the very tensor object that
an earlier op produced too (an in-place op returns its operand, ``.to``/``.float()``/
``.contiguous()`` may return ``self``), the extra output shares the returned tensor's
TensorImpl and autograd routes the incoming gradient to the wrong slot: every gradient behind
the Function is silently zero (pytorch/pytorch#180642, fixed in 2.12). mesa_lite's Functions
must return a tensor that exactly one op produced and that is not an input (except an input
that an in-place Function marks dirty).

``install()`` wraps the ``forward`` of every Function class of mesa_lite so that in eager mode
a ``TorchFunctionMode`` counts, per tensor object, the ops that returned it, and raises if a
returned tensor was returned by more than one op or is one of the forward's inputs. The test
suite installs it for every test (``conftest.py``), so any torch version finds the class, not
only 2.11 under compile.
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class _Producers(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: dict[int, int] = {}
        self.names: dict[int, list[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the forward runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.count[id(t)] = self.count.get(id(t), 0) + 1
                self.names.setdefault(id(t), []).append(getattr(func, "__name__", str(func)))
                self.alive.append(t)
        return out


class AliasedOutputError(AssertionError):
    pass


def _checked(cls, forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        mode = _Producers()
        with mode:
            out = forward(*args, **kwargs)
        inputs = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # an in-place Function returns the input it marked dirty, as autograd requires
        inputs -= {id(t) for t in getattr(args[0], "dirty_tensors", None) or ()}
        for i, t in enumerate(tree_leaves(out)):
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) in inputs:
                raise AliasedOutputError(f"{cls.__name__}.forward returns its input as output {i}")
            if mode.count.get(id(t), 0) > 1:
                raise AliasedOutputError(
                    f"{cls.__name__}.forward: output {i} was returned by several ops "
                    f"({', '.join(mode.names[id(t)])}); torch 2.11's compiler zeroes the "
                    "gradients behind such a Function (return a tensor one op produced)"
                )
        return out

    return staticmethod(wrapper)


# Functions that return what the user's code returns and that Dynamo never traces as a
# subgraph: the checkpoint Function runs the user's block (whose last op may be in place, or a
# dropout that returns its input) and compile leaves it out of the graph (a skipped function)
EXEMPT = {"CheckpointFn"}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def install() -> list[type]:
    """Wraps the forward of every mesa_lite Function class (imported ones); returns them."""
    import importlib
    import pkgutil

    import mesa_lite

    for info in pkgutil.walk_packages(mesa_lite.__path__, "mesa_lite."):
        if info.name.startswith(("mesa_lite.ops", "mesa_lite.blocks", "mesa_lite.checkpoint")):
            importlib.import_module(info.name)

    done = []
    for cls in set(_subclasses(torch.autograd.Function)):
        if not cls.__module__.startswith("mesa_lite") or "forward" not in cls.__dict__:
            continue
        if cls.__name__ in EXEMPT:
            continue
        fwd = cls.__dict__["forward"]
        if getattr(fwd, "__func__", None) and getattr(fwd.__func__, "__wrapped__", None):
            continue
        cls.forward = _checked(cls, fwd.__func__ if isinstance(fwd, staticmethod) else fwd)
        done.append(cls)
    return done
