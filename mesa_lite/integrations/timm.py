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

from mesa_lite import blocks
from mesa_lite.modules import (
    GELU,
    BatchNorm2d,
    FusedBlock,
    LayerNorm,
    Linear,
    MesaModule,
    matmul,
    plain_modules,
    scaled_dot_product_attention,
    softmax,
)
from mesa_lite.ops.attention import window_attention
from mesa_lite.ops.common import autocast_dtype
from mesa_lite.ops.mul import scale_mul

try:
    import timm.layers as _tl
    from timm.layers import Attention as _TimmAttention
    from timm.layers import Mlp as _TimmMlp
    from timm.models.convnext import ConvNeXtBlock as _ConvNeXtBlock
    from timm.models.swin_transformer import SwinTransformerBlock as _SwinBlock
    from timm.models.swin_transformer import WindowAttention as _WindowAttention
    from timm.models.vision_transformer import Block as _TimmBlock
except ImportError:  # pragma: no cover - timm is optional
    _tl = None
    _TimmAttention = _TimmMlp = _TimmBlock = _SwinBlock = _ConvNeXtBlock = None
    _WindowAttention = None


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


class LayerNorm2d(LayerNorm):
    """timm's ``LayerNorm2d`` (ConvNeXt atto-nano's stem and downsampling, many hybrid models): a
    LayerNorm over the channels of an NCHW tensor, computed as timm does (permute to NHWC,
    ``F.layer_norm``, permute back), its input kept compressed as ``LayerNorm`` keeps it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = LayerNorm.forward(self, x.permute(0, 2, 3, 1))
        return x.permute(0, 3, 1, 2)


def registrations() -> list[tuple[type, type, str, object, str | None]]:
    """(timm type, mesa_lite class, kind, accepts(module) or None, why accepts rejects) for
    ``wrap``'s registry."""
    if _tl is None:
        return []
    regs = [(_TimmAttention, Attention, "attention", None, None)]
    if _WindowAttention is not None:
        regs.append((_WindowAttention, WindowAttention, "attention", None, None))
    if hasattr(_tl, "LayerNorm"):
        regs.append(
            (_tl.LayerNorm, LayerNorm, "layernorm", _plain_layer_norm, "timm fast-norm path on")
        )
    if hasattr(_tl, "LayerNorm2d"):
        regs.append(
            (_tl.LayerNorm2d, LayerNorm2d, "layernorm", _plain_layer_norm,
             "timm fast-norm path on")
        )  # fmt: skip
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
    if _BatchNormAct2d is not None:
        regs.append((_BatchNormAct2d, BatchNormAct2d, "batchnorm", None, None))
    if _SqueezeExcite is not None:
        regs.append((_SqueezeExcite, SqueezeExcite, "se", None, None))
    if _SEModule is not None:
        regs.append((_SEModule, SEModule, "se", None, None))
    return regs


try:
    from timm.layers.squeeze_excite import SEModule as _SEModule
    from timm.models._efficientnet_blocks import SqueezeExcite as _SqueezeExcite
except ImportError:  # pragma: no cover - timm missing, or moved them
    _SEModule = _SqueezeExcite = None

if _SqueezeExcite is not None:

    class SqueezeExcite(MesaModule, _SqueezeExcite):
        """timm's EfficientNet/MobileNet ``SqueezeExcite``: its forward, with the final
        ``x * gate`` keeping ``x`` compressed (``ops/mul.py``; the SiLU before it has
        registered codes for it, so nothing new is kept) and the per-channel gate itself."""

        mesa_kind = "se"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self._mesa_active(x):
                return _SqueezeExcite.forward(self, x)
            x_se = x.mean((2, 3), keepdim=True)
            x_se = self.conv_expand(self.act1(self.conv_reduce(x_se)))
            return scale_mul(x, self.gate(x_se), self.mesa_spec)


if _SEModule is not None:

    class SEModule(MesaModule, _SEModule):
        """timm's ``SEModule`` (SE-ResNet, RegNet, ...): its forward, with the final
        ``x * gate`` as ``SqueezeExcite``'s."""

        mesa_kind = "se"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self._mesa_active(x):
                return _SEModule.forward(self, x)
            x_se = x.mean((2, 3), keepdim=True)
            if self.add_maxpool:
                x_se = 0.5 * x_se + 0.5 * x.amax((2, 3), keepdim=True)
            x_se = self.fc2(self.act(self.bn(self.fc1(x_se))))
            return scale_mul(x, self.gate(x_se), self.mesa_spec)


_BatchNormAct2d = getattr(_tl, "BatchNormAct2d", None) if _tl is not None else None
if _BatchNormAct2d is not None:

    class BatchNormAct2d(BatchNorm2d, _BatchNormAct2d):
        """timm's ``BatchNormAct2d`` (EfficientNet, MobileNetV3, RegNet, ...): its batch norm
        (the same code as ``nn.BatchNorm2d``'s forward) keeping the normalized input
        compressed, then its own ``drop`` and ``act`` modules (wrapped by their own kinds)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # BatchNorm2d.forward takes the plain path itself, reading weight and bias once
            return self.act(self.drop(BatchNorm2d.forward(self, x)))


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


if _WindowAttention is not None:

    class WindowAttention(MesaModule, _WindowAttention):
        """timm Swin's ``WindowAttention`` keeping what attention needs for backward
        compressed.

        Explicit mode (timm's default for Swin): q, k, the softmax output and v, through
        mesa_lite's matmul and the (converted) softmax child, whose codes ``attn @ v`` reuses.
        Fused mode: ``ops.attention.window_attention``: q, k, v and the output compressed, and
        the full relative-position-plus-window bias not kept (made again in backward).
        """

        mesa_kind = "attention"

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            if not self._mesa_active(x):
                return super().forward(x, mask)
            spec = self.mesa_spec
            B_, N, C = x.shape
            qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            if self.fused_attn:
                p = self.attn_drop.p if self.training else 0.0
                x = window_attention(q, k, v, self._get_rel_pos_bias(), mask, p, spec)
            else:
                q = q * self.scale
                attn = matmul(q, k.transpose(-2, -1), spec)
                attn = attn + self._get_rel_pos_bias()
                if mask is not None:
                    num_win = mask.shape[0]
                    attn = attn.view(-1, num_win, self.num_heads, N, N)
                    attn = (attn + mask.unsqueeze(1).unsqueeze(0)).view(-1, self.num_heads, N, N)
                attn = self.softmax(attn)
                attn = self.attn_drop(attn)
                x = matmul(attn, v, spec)
            x = x.transpose(1, 2).reshape(B_, N, -1)
            x = self.proj(x)
            x = self.proj_drop(x)
            return x


def block_registrations() -> list[tuple[type, type]]:
    """(timm block type, its FusedBlock class) for ``wrap``'s block pass."""
    regs = []
    if _TimmBlock is not None:
        regs.append((_TimmBlock, Block))
    if _SwinBlock is not None:
        regs.append((_SwinBlock, SwinTransformerBlock))
    if _ConvNeXtBlock is not None:
        regs.append((_ConvNeXtBlock, ConvNeXtBlock))
    return regs


def _no_dropout(m) -> bool:
    return isinstance(m, nn.Identity) or (type(m) is nn.Dropout and m.p == 0)


def _identity(m) -> bool:
    return m is None or type(m) is nn.Identity


def _mlp_half_spec(norm, mlp):
    """The spec ``norm`` -> ``mlp`` (a timm Mlp: fc1, GELU, fc2) can run with as one
    ``blocks.NormMlpFn``, or None: all wrapped with one setting, no dropout, no norm inside
    the Mlp, no hooks."""
    if not (isinstance(norm, LayerNorm) and isinstance(mlp, _TimmMlp)):
        return None
    if type(mlp).forward is not _TimmMlp.forward or not _identity(mlp.norm):
        return None
    if not (isinstance(mlp.fc1, Linear) and isinstance(mlp.fc2, Linear)):
        return None
    if not isinstance(mlp.act, GELU) or not (_no_dropout(mlp.drop1) and _no_dropout(mlp.drop2)):
        return None
    layers = (norm, mlp.fc1, mlp.act, mlp.fc2)
    spec = blocks.spec_of(*layers)
    return spec if spec is not None and plain_modules(mlp, *layers) else None


def _attention_half_spec(norm, at):
    """The spec ``norm`` -> ``at`` (timm's Attention) can run with as one
    ``blocks.NormAttentionFn``, or None: all wrapped with one setting, fused attention with no
    q/k norm, gate or output norm, no dropout, no hooks."""
    if not (isinstance(norm, LayerNorm) and isinstance(at, Attention)) or not at.fused_attn:
        return None
    if not (isinstance(at.qkv, Linear) and isinstance(at.proj, Linear)):
        return None
    extras = (at.q_norm, at.k_norm, getattr(at, "norm", None), getattr(at, "gate", None))
    if not all(_identity(m) for m in extras):
        return None
    if not (_no_dropout(at.attn_drop) and _no_dropout(at.proj_drop)):
        return None
    layers = (norm, at.qkv, at.proj)
    spec = blocks.spec_of(at, *layers)
    return spec if spec is not None and plain_modules(at, *layers) else None


def _norm_cfg(norm, dev) -> tuple:
    return tuple(norm.normalized_shape), norm.eps, autocast_dtype("layer_norm", dev)


def _norm_mlp(norm, mlp, x, spec):
    """``mlp(norm(x))`` as one ``blocks.NormMlpFn``."""
    dev = x.device
    dtype, gelu_dtype = autocast_dtype("linear", dev), autocast_dtype("gelu", dev)
    cfg = (_norm_cfg(norm, dev), dtype, gelu_dtype, mlp.act.approximate, spec)
    fc1, fc2 = mlp.fc1, mlp.fc2
    return blocks.NormMlpFn.apply(
        x, norm.weight, norm.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias, cfg
    )


if _TimmBlock is not None:

    class Block(FusedBlock, _TimmBlock):
        """timm's vision-transformer ``Block`` running each half as one block-level Function
        (``blocks.NormAttentionFn``, ``blocks.NormMlpFn``) when its sub-layers allow: the
        LayerNorm and the layers after it wrapped with one setting, fused attention with no
        mask, q/k norm, gate or attention-output norm, no dropout, no hooks on the sub-layers,
        training with grad. Otherwise a half runs through the per-op modules, as the block's
        own forward runs them. Layer scale and drop path stay as timm computes them."""

        def _mesa_fused_attention_ok(self, x, at, is_causal: bool, dtype) -> bool:
            """Whether the fused attention half takes inputs like ``x``. Eager mode learns it
            from the Function's ``Unsupported``; torch.compile asks the backend checks on
            q, k, v views of an empty qkv tensor (traced, not computed)."""
            if not torch.compiler.is_compiling():
                return not self._mesa_unfused_attention(x)
            B, N, _ = x.shape
            qkv = x.new_empty(B, N, 3, at.num_heads, at.head_dim, dtype=dtype or x.dtype)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            return blocks.fused_backend_ok(q, k, v, is_causal)

        def _mesa_attention_half(self, x, kwargs):
            """``attn(norm1(x))`` as one Function, or None where that half cannot run fused."""
            n1, at = self.norm1, self.attn
            spec = _attention_half_spec(n1, at)
            if spec is None:
                return None
            is_causal = bool(kwargs.get("is_causal", False))
            dev = x.device
            dtype = autocast_dtype("linear", dev)
            if autocast_dtype("sdpa", dev) != dtype:
                return None
            if not self._mesa_fused_attention_ok(x, at, is_causal, dtype):
                return None
            cfg = (_norm_cfg(n1, dev), dtype, at.num_heads, at.head_dim, is_causal, spec)
            qkv, proj = at.qkv, at.proj
            try:
                return blocks.NormAttentionFn.apply(
                    x, n1.weight, n1.bias, qkv.weight, qkv.bias, proj.weight, proj.bias, cfg
                )
            except blocks.Unsupported:
                self._mesa_unfused_attention(x, remember=True)
                return None

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs.get("attn_mask") is not None or not self._mesa_block_active(x):
                return super().forward(x, *args, **kwargs)
            y = self._mesa_attention_half(x, kwargs)
            if y is None:
                y = self.attn(self.norm1(x), **kwargs)
            x = x + self.drop_path1(self.ls1(y))
            spec = _mlp_half_spec(self.norm2, self.mlp)
            if spec is None:
                y = self.mlp(self.norm2(x))
            else:
                y = _norm_mlp(self.norm2, self.mlp, x, spec)
            return x + self.drop_path2(self.ls2(y))


if _SwinBlock is not None:

    class SwinTransformerBlock(FusedBlock, _SwinBlock):
        """timm's Swin block with its MLP half (``norm2`` -> ``mlp``) as one
        ``blocks.NormMlpFn`` when its sub-layers allow (see ``Block``); the windowed
        attention half runs through the per-op modules."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            spec = _mlp_half_spec(self.norm2, self.mlp) if self._mesa_block_active(x) else None
            if spec is None:
                return super().forward(x)
            B, H, W, C = x.shape
            x = x + self.drop_path1(self._attn(self.norm1(x)))
            x = x.reshape(B, -1, C)
            x = x + self.drop_path2(_norm_mlp(self.norm2, self.mlp, x, spec))
            return x.reshape(B, H, W, C)


if _ConvNeXtBlock is not None:

    class ConvNeXtBlock(FusedBlock, _ConvNeXtBlock):
        """timm's ConvNeXt block with ``norm`` -> ``mlp`` (channels last) as one
        ``blocks.NormMlpFn`` when its sub-layers allow (see ``Block``; not with
        ``conv_mlp``); the depthwise convolution runs as in PyTorch."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            spec = None
            if not self.use_conv_mlp and self._mesa_block_active(x):
                spec = _mlp_half_spec(self.norm, self.mlp)
            if spec is None:
                return super().forward(x)
            shortcut = x
            x = self.conv_dw(x)
            x = _norm_mlp(self.norm, self.mlp, x.permute(0, 2, 3, 1), spec).permute(0, 3, 1, 2)
            if self.gamma is not None:
                x = x.mul(self.gamma.reshape(1, -1, 1, 1))
            return self.drop_path(x) + self.shortcut(shortcut)
