"""Shared test setup: devices, the SQNR measure, and counting bytes kept for backward.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so every kernel is
still checked bit for bit against its PyTorch reference. The variable must be set before
Triton is first imported (timm imports it), hence here.
"""

import functools
import os
import sys
from pathlib import Path

# The tests import mesa_lite as installed, never from the repository root: there the folder
# kernels/ (installed as mesa_lite.kernels) would hide the `kernels` package (Hugging Face's, which
# transformers 5.24+ imports). `python -m pytest` puts the working directory first on sys.path.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

try:  # property tests draw the same examples on every run: CI must not fail one run in fifty
    from hypothesis import settings

    settings.register_profile("mesa_lite", derandomize=True)
    settings.load_profile("mesa_lite")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass

from tiers import exhaustive  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
    """Marks the exhaustive tier (tests/tiers.py): ``pytest -m exhaustive`` runs it, the
    default command leaves it out (pyproject's addopts)."""
    for item in items:
        if exhaustive(item.nodeid):
            item.add_marker(pytest.mark.exhaustive)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def graph_nodes(out) -> set[str]:
    """The class names of the autograd nodes behind ``out``."""
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        stack += [g for g, _ in f.next_functions]
    return names


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """20 * log10(||ref|| / ||ref - x||) in fp64; inf when equal."""
    ref, x = ref.double(), x.double()
    err = (ref - x).norm()
    if err == 0:
        return float("inf")
    return (20 * torch.log10(ref.norm() / err)).item()


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality (NaN equal to NaN); on failure prints the worst elements."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(
        actual, expected, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


def kept_by_both(plain, wrapped, x) -> tuple[int, int, object, object]:
    """``saved_activation_bytes`` of ``plain(x)`` and ``wrapped(x)``, their parameters left
    out: ``(plain bytes, wrapped bytes, plain output, wrapped output)``."""
    params = [*plain.parameters(), *wrapped.parameters()]
    kept_p, out_p = saved_activation_bytes(lambda: plain(x), params)
    kept_w, out_w = saved_activation_bytes(lambda: wrapped(x), params)
    return kept_p, kept_w, out_p, out_w


def assert_compiles_like_eager(eager, x, loss, floor_db: float = 30.0):
    """``mesa_lite.compile`` of a copy of the wrapped ``eager`` model, ``fullgraph=True``: no
    graph break (counted on another copy, so buffers such as running statistics move alike in
    both), and each parameter gradient of ``loss(model(x))`` within ``floor_db`` of eager
    mode's. Returns the compiled copy's module, its gradients filled."""
    import copy

    import mesa_lite

    torch._dynamo.reset()
    src = copy.deepcopy(eager)
    compiled = mesa_lite.compile(src, fullgraph=True)
    explained = torch._dynamo.explain(copy.deepcopy(src))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    loss(eager(x)).backward()
    loss(compiled(x)).backward()
    for (n, p), q in zip(eager.named_parameters(), src.parameters(), strict=True):
        assert sqnr_db(p.grad, q.grad) >= floor_db, (n, sqnr_db(p.grad, q.grad))
    return src


def saved_activation_bytes(fn, params=()) -> tuple[int, object]:
    """Bytes of the unique storages kept for backward while ``fn()`` runs its forward.

    Counted through ``torch.autograd.graph.saved_tensors_hooks``; storages of ``params`` are
    left out (they exist anyway), everything else kept for backward is counted once.

    Returns:
        (bytes, what fn returned) - keep the result alive until the count is read.
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t.detach()  # t itself would make a reference cycle for saved outputs

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def tiny_vit(fused: bool = True, seed: int = 0):
    """A 2-block, 32-wide timm VisionTransformer on 16x16 images (5 classes), fused or explicit
    attention, weights drawn under ``seed``: a whole timm model that trains in milliseconds."""
    import timm

    torch.manual_seed(seed)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5
    )
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model


def tiny_lm_config(family: str, dropout: float = 0.0, vocab: int = 256):
    """A 2-layer, 64-wide transformers config of ``family`` (gpt2, bert, llama, mistral, qwen2),
    ``dropout`` on every dropout it has (GPT-2's and BERT's)."""
    import transformers as tf

    small = dict(vocab_size=vocab)
    if family == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, attn_pdrop=dropout,
                             resid_pdrop=dropout, embd_pdrop=dropout, **small)  # fmt: skip
    if family == "bert":
        return tf.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, attention_probs_dropout_prob=dropout,
                             hidden_dropout_prob=dropout, **small)  # fmt: skip
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
    return cls(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, **small)  # fmt: skip


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def count_calls(monkeypatch, owner, name: str) -> list:
    """Patches ``owner.name`` (a module's function or a class's attribute) for the test to
    count its calls, one entry each in the list returned; the calls still run."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@functools.cache
def interpreter_runs_loops() -> bool:
    """Whether Triton's interpreter runs a kernel's loop over a runtime bound (the gated
    product's backward loops over a group): Triton 3.6's cannot with NumPy 2.4 (torch 2.11's
    environment, an InterpreterError), so tests that force that kernel in the interpreter skip
    there; the kernel tests in tests/kernels run on Triton 3.8+ and on the GPU. By version, not
    by a probe, so that a kernel broken on a newer Triton fails rather than skips."""
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 8)


@pytest.fixture
def triton_device():
    """Where Triton kernels run: compiled on the GPU, else in the interpreter on CPU tensors."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFStyleRMSNorm(torch.nn.Module):
    """The Hugging Face RMSNorm formula (``LlamaRMSNorm``: an fp32 upcast, the cast back, an
    fp32 weight), which ``wrap`` recognises by structure; a non-trivial weight."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.3 * torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


@pytest.fixture(scope="session", autouse=True)
def _no_function_returns_an_aliased_tensor():
    """Every mesa_lite Function's forward, in every test, returns tensors that one op produced
    (``alias_check``: the class torch 2.11's compiler differentiates to zero)."""
    import alias_check

    assert len(alias_check.install()) >= 20
    yield
