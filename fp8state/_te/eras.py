"""The ten TransformerEngine ``_extra_state`` formats (eras E01-E10) as data.

Each era fixes three facts the conversion depends on: how many FP8 tensors a GEMM has (2 forward /
1 backward up to TE v0.5, 3 / 2 after), when TE rolled its amax history (at the start of the next
step up to v1.5, at the end of the step from v1.6), and whether ``scale_inv`` and the recipe are
stored. ``docs/migration.md`` and ``../shared/docs/te_formats.md`` give the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Era", "ERAS", "era"]


@dataclass(frozen=True)
class Era:
    """One TE extra-state format.

    Attributes:
        code: ``"E01"`` ... ``"E10"``; ``"E08-E10"`` where the value alone cannot tell them apart
            (they differ only in what an FP8-off module writes).
        te_tags: The TE release tags that wrote it.
        container: What TE put into the state dict.
        fwd_per_gemm: Forward FP8 tensors per GEMM (2 up to v0.5, then 3).
        bwd_per_gemm: Backward FP8 tensors per GEMM (1 up to v0.5, then 2).
        update_at_end: True from v1.6 on: the amax history is rolled at the end of a step, so a
            checkpoint holds the newest amax in the last row and a zeroed row 0. False before:
            the roll runs at the start of the next step and the newest amax sits in row 0.
    """

    code: str
    te_tags: str
    container: str
    fwd_per_gemm: int
    bwd_per_gemm: int
    update_at_end: bool

    @property
    def old_slot_layout(self) -> bool:
        """True for the 2-forward / 1-backward layout of TE v0.1-v0.5."""
        return self.fwd_per_gemm == 2


_OLD = (2, 1)
_NEW = (3, 2)

#: Every era by code. E08, E09 and E10 store FP8 state identically; ``"E08-E10"`` is the one
#: decoders report for a value holding FP8 state.
ERAS: dict[str, Era] = {
    e.code: e
    for e in (
        Era("E01", "v0.1-v0.2", "Python list of 10 items", *_OLD, update_at_end=False),
        Era("E02", "v0.3-v0.4", "Python dict (with recompute buffer)", *_OLD, update_at_end=False),
        Era("E03", "v0.5", "Python dict", *_OLD, update_at_end=False),
        Era("E04", "v0.6-v0.7", "uint8 tensor of pickle bytes", *_NEW, update_at_end=False),
        Era(
            "E05",
            "v0.8-v0.11",
            "uint8 tensor of pickle bytes, scale_inv",
            *_NEW,
            update_at_end=False,
        ),
        Era(
            "E06",
            "v0.12-v1.5",
            "io.BytesIO of a torch.save archive, global state",
            *_NEW,
            update_at_end=False,
        ),
        Era("E07", "v1.6-v1.13", "io.BytesIO of a torch.save archive", *_NEW, update_at_end=True),
        Era(
            "E08-E10",
            "v2.0-v2.20",
            "uint8 tensor of pickle bytes with a recipe object",
            *_NEW,
            update_at_end=True,
        ),
    )
}


def era(code: str) -> Era:
    """The era with ``code`` (a key of :data:`ERAS`)."""
    return ERAS[code]
