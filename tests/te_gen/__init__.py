"""TE-shaped checkpoints generated from ../shared/docs/te_formats.md, without TransformerEngine.

The public fixtures are one sample per era; this generator varies what they fix: shapes, GEMM
counts, recipes, history lengths, nested module names, FP8-off modules, stateless recipes and the
old 2/1 slot layout. Each generated module comes with a :class:`~te_gen.payloads.Truth`
derived from a simulation of TE's history roll, not from the conversion rule.
"""

from te_gen.models import GEMMS, Generated, Module, build, save
from te_gen.payloads import ERAS, Spec, Truth, extra_state

__all__ = ["ERAS", "GEMMS", "Generated", "Module", "Spec", "Truth", "build", "extra_state", "save"]
