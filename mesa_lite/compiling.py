"""``mesa_lite.compile``: ``torch.compile`` with the Inductor settings wrapped models need.

A wrapped model compiles to one graph with plain ``torch.compile``. One Inductor setting costs
it memory, though: ``reorder_for_peak_memory`` (on by default) reorders each compiled graph by
an estimate of its peak. On the H200 (torch 2.11, CUDA) it reorders the backward of a wrapped
DeiT so that every block's activations are rebuilt from their codes before the first is used:
a compiled DeiT-S (depth 6, batch 128) then peaks at 1,577 MiB above the step's start instead
of about 925 MiB with the setting off, against 2,103 MiB for the plain compiled model
(``benchmarks/results/compile_peak_variants_gpu.md``); on the full DeiT-S the activation
reduction against compiled plain is 2.79x with it off, 1.43x with it on
(``compile_speed_s_options.md``). ``mesa_lite.compile`` turns it off for
this model's graphs only (torch.compile's ``options`` apply per compiled function); other
models keep Inductor's defaults.
"""

from __future__ import annotations

__all__ = ["INDUCTOR_OPTIONS", "compile"]

# Inductor options for wrapped models (merged under the caller's own options)
INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}


def compile(  # noqa: A001
    model=None,
    *,
    mode: str | None = None,
    options: dict | None = None,
    in_place: bool = False,
    **kwargs,
):
    """``torch.compile(model, ...)`` with ``INDUCTOR_OPTIONS``; same arguments and result
    (without ``model``, a decorator).

    ``in_place=True`` compiles the module's own calls (``nn.Module.compile``) and returns
    ``model`` itself: its class, forward signature and state_dict keys stay as they are, for
    code that inspects the model it is given (the Hugging Face Trainer drops the batch's
    columns that the forward's signature does not name, and its ``save_model`` writes a
    compiled wrapper's weights under ``_orig_mod.`` keys, which ``from_pretrained`` then
    ignores).

    ``mode`` is turned into its Inductor options (torch.compile takes a mode or options, not
    both); ``options`` given here override ``INDUCTOR_OPTIONS``. Another backend than
    Inductor gets the call unchanged, but for ``dynamic``.

    ``dynamic`` is False unless given: the attention's SDPA backend choice is made while
    tracing on concrete sizes, and with symbolic ones (torch.compile's automatic dynamic
    shapes, after an input of a new sequence length) a fullgraph compile failed. A new input
    shape compiles a graph of its own (``torch._dynamo.config.recompile_limit`` applies).
    """
    import torch

    if model is None:  # the decorator form: the checks below need the model
        return lambda m: compile(m, mode=mode, options=options, in_place=in_place, **kwargs)
    kwargs.setdefault("dynamic", False)
    if kwargs.get("fullgraph"):
        _refuse_fullgraph_checkpointing(model)
    backend = kwargs.get("backend") or "inductor"
    if backend != "inductor":
        kwargs.update(mode=mode, options=options)
    else:
        merged: dict = {}
        if mode not in (None, "default"):
            merged.update(torch._inductor.list_mode_options(mode, kwargs.get("dynamic")))
        merged.update(INDUCTOR_OPTIONS)
        merged.update(options or {})
        kwargs["options"] = merged
    if not in_place:
        return torch.compile(model, **kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"mesa_lite.compile: in_place=True compiles a module's calls; got "
            f"{type(model).__name__}"
        )
    model.compile(**kwargs)
    return model


def _refuse_fullgraph_checkpointing(model) -> None:
    """mesa_lite's checkpointing (``Config(checkpoint=...)``) runs each checkpointed block
    outside the compiled graph (its recompute in backward is not traceable): with
    ``fullgraph=True`` Dynamo would stop at the first one with a message that names neither."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    from mesa_lite.checkpoint import checkpointed

    names = [n for n, _ in checkpointed(model)]
    if names:
        raise ValueError(
            f"mesa_lite.compile: fullgraph=True cannot trace mesa_lite's activation "
            f"checkpointing ({len(names)} checkpointed modules, e.g. {names[0]!r}; each runs "
            "outside the graph). Compile without fullgraph (a graph between checkpointed "
            "blocks), or wrap without Config(checkpoint=...) and use torch.compile's "
            "activation_memory_budget for recomputation"
        )
