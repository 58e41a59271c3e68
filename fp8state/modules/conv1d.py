"""``fp8state.Conv1D``: Hugging Face's ``Conv1D`` (GPT-2's matmuls) with FP8 GEMMs.

``transformers.pytorch_utils.Conv1D`` is a linear layer whose weight is stored transposed,
``(in, out)``, computing ``y = x @ weight + bias``. This module keeps that layout and those
names, so a GPT-2 checkpoint loads into it and the Parameter objects ``convert_model`` moves
into it stay the ones optimizers and tied weights hold.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8state.functional import linear as _fp8_linear
from fp8state.mixin import FP8StateMixin
from fp8state.modules._params import new_param

__all__ = ["Conv1D"]


class Conv1D(FP8StateMixin):
    """``y = x @ weight + bias`` with ``weight (nx, nf)``; FP8 inside ``fp8_autocast``.

    The arguments and attributes are Hugging Face's (``nf`` output features first, then ``nx``
    input features); state-dict keys are ``weight (nx, nf)``, ``bias (nf,)`` and
    ``_extra_state`` (3 forward / 2 backward slots, as :class:`fp8state.Linear`). Outside
    ``fp8_autocast`` (and for GEMMs too small for FP8) it computes exactly what
    ``transformers``' ``Conv1D`` does (the same ``torch.addmm``), bit for bit.

    Under ``fp8_autocast`` the GEMM is :class:`fp8state.Linear`'s, fed ``weight.t()``: that
    view is not contiguous, so each weight cast first copies the weight once in high precision
    (none on micro-batches that reuse the cached FP8 weight, ``is_first_microbatch=False``),
    and the weight gradient, computed as ``(nf, nx)``, is copied once into ``weight``'s layout
    when it is first accumulated.

    Args:
        nf: Output features.
        nx: Input features.
        bias: Learn an additive bias (Hugging Face's ``Conv1D`` always has one).
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        device: Device of parameters and FP8 metadata (``"meta"`` allowed).

    Example:
        >>> import torch, fp8state
        >>> from fp8state.modules.conv1d import Conv1D
        >>> layer, x = Conv1D(48, 32), torch.randn(2, 5, 32)
        >>> tuple(layer.weight.shape)  # (in, out), as GPT-2 stores it
        (32, 48)
        >>> torch.equal(layer(x), x @ layer.weight + layer.bias)  # no autocast
        True
        >>> with fp8state.fp8_autocast():
        ...     y = layer(x)
        >>> y.shape, [k for k in layer.state_dict() if k != "_extra_state"]
        (torch.Size([2, 5, 48]), ['weight', 'bias'])
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = new_param(nx, nf, dtype=params_dtype, device=device)
        self.bias = new_param(nf, dtype=params_dtype, device=device) if bias else None
        self.reset_parameters()
        self.init_fp8_meta(num_gemms=1, device=device)

    @property
    def in_features(self) -> int:
        """``nx``, under ``nn.Linear``'s name."""
        return self.nx

    @property
    def out_features(self) -> int:
        """``nf``, under ``nn.Linear``'s name."""
        return self.nf

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize as Hugging Face's ``Conv1D`` does: weight ``N(0, 0.02)``, bias 0."""
        if self.weight.device.type == "meta":
            return
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Apply the layer to ``inp (..., nx)``.

        ``is_first_microbatch`` as in :meth:`fp8state.Linear.forward`.
        """
        # One (tokens, nx) GEMM, as transformers' Conv1D runs it: for a 2-D input with a bias,
        # F.linear(x, weight.t(), bias) is torch.addmm(bias, x, weight), Conv1D's own call, so
        # every high-precision path (outside fp8_autocast, GEMMs too small for FP8) is exact.
        inp_2d = inp.reshape(-1, inp.shape[-1])
        out = _fp8_linear.linear(self, inp_2d, self.weight.t(), self.bias, 0, is_first_microbatch)
        return out.view(*inp.shape[:-1], self.nf)

    def fp8_gemm_weights(self) -> tuple[torch.Tensor, ...]:
        """As :meth:`fp8state.Linear.fp8_gemm_weights`: ``weight.t()``, as the GEMM takes it."""
        return (self.weight.t(),)  # the GEMM is Linear's, fed the (nf, nx) view

    def extra_repr(self) -> str:
        """Sizes, in Hugging Face's order."""
        return f"nf={self.nf}, nx={self.nx}, bias={self.bias is not None}"
