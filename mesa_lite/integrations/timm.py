"""timm integration: timm's Linear, LayerNorm, GELU and vision-transformer ``Attention``.

timm's ``Attention`` computes ``q @ k^T``, softmax and ``attn @ v`` inline when its fused
attention is off; the subclass here does the same computation through mesa_lite's matmul and
softmax, so those activations are kept compressed too. With fused attention on
(``F.scaled_dot_product_attention``, timm's default) it calls mesa_lite's compressed fused
attention, which runs the same fused backend and keeps q, k, v and the output compressed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mesa_lite.modules import (
    MesaModule,
    eager_under_compile,
    matmul,
    scaled_dot_product_attention,
    softmax,
)

try:
    import timm.layers as _tl
    from timm.layers import Attention as _TimmAttention
except ImportError:  # pragma: no cover - timm is optional
    _tl = None
    _TimmAttention = None


def _resolve_mask(n: int, attn: torch.Tensor, attn_mask, is_causal: bool):
    """The additive bias timm's explicit path adds (SDPA semantics)."""
    resolve = getattr(_tl, "resolve_self_attn_mask", None)
    if resolve is not None:
        return resolve(n, attn, attn_mask, is_causal)
    if is_causal:
        return attn.new_full((n, n), float("-inf")).triu_(1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        bias = torch.zeros_like(attn_mask, dtype=attn.dtype)
        return bias.masked_fill_(~attn_mask, float("-inf"))
    return attn_mask


def _plain_layer_norm(module: nn.Module) -> bool:
    """timm's LayerNorm is F.layer_norm unless its fast-norm (apex) path is on."""
    return not getattr(module, "_fast_norm", False)


def registrations() -> list[tuple[type, type, str, object, str | None]]:
    """(timm type, mesa_lite class, kind, accepts(module) or None, why accepts rejects) for
    ``wrap``'s registry."""
    if _tl is None:
        return []
    from mesa_lite.modules import GELU, LayerNorm, Linear

    regs = [(_TimmAttention, Attention, "attention", None, None)]
    if hasattr(_tl, "LayerNorm"):
        regs.append(
            (_tl.LayerNorm, LayerNorm, "layernorm", _plain_layer_norm, "timm fast-norm path on")
        )
    gelu = getattr(getattr(_tl, "activations", None), "GELU", None)
    if gelu is not None and gelu is not nn.GELU:
        regs.append((gelu, GELU, "gelu", None, None))
    linear = getattr(_tl, "Linear", None)
    if linear is not None and linear is not nn.Linear:
        # timm's Linear (MobileNetV3/EfficientNet classifiers) overrides forward only for
        # TorchScript: when torch.jit.is_scripting() it casts weight and bias to the input's
        # dtype, otherwise it is F.linear(input, weight, bias), nn.Linear's forward. A
        # converted module is never scripted (mesa_lite's modules are not scriptable; script
        # the unwrapped model), so the branch it drops is one that cannot run.
        regs.append((linear, Linear, "linear", None, None))
    return regs


if _TimmAttention is not None:

    class Attention(MesaModule, _TimmAttention):
        """timm ``Attention`` keeping what attention needs for backward compressed.

        Fused mode: q, k, v and the attention output (``scaled_dot_product_attention``).
        Explicit mode: q, k, the softmax output and v; the softmax output is kept once, as the
        ``attn @ v`` product reuses the softmax's uint8 codes (also under autocast, where it is
        cast before the product).
        """

        mesa_kind = "attention"

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if not self._mesa_active(x):
                return super().forward(x, *args, **kwargs)
            return self._mesa_forward(x, *args, **kwargs)

        # one eager island under torch.compile: the projection then finds the attention
        # output's codes through the view it takes in eager mode
        @eager_under_compile
        def _mesa_forward(self, x, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
            spec = self.mesa_spec
            B, N, C = x.shape
            gate = getattr(self, "gate", None)
            gate = gate(x).sigmoid() if gate is not None else None
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            if self.fused_attn:
                x = scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask,
                    dropout_p=self.attn_drop.p if self.training else 0.0,
                    is_causal=is_causal, spec=spec,
                )  # fmt: skip
            else:
                q = q * self.scale
                attn = matmul(q, k.transpose(-2, -1), spec)
                bias = _resolve_mask(N, attn, attn_mask, is_causal)
                if bias is not None:
                    attn = attn + bias
                attn = softmax(attn, -1, spec)
                attn = self.attn_drop(attn)
                x = matmul(attn, v, spec)
            x = x.transpose(1, 2).reshape(B, N, getattr(self, "attn_dim", C))
            x = self.norm(x)
            if gate is not None:
                x = x * gate
            x = self.proj(x)
            x = self.proj_drop(x)
            return x
