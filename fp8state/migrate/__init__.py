"""TransformerEngine checkpoints of every era (TE v0.1-v2.20) to fp8state, safely.

Nothing here imports TransformerEngine or runs pickled code: pickled data goes through an
allow-list unpickler (:mod:`fp8state._te.unpickler`). ``docs/migration.md`` describes the
formats, the conversion rules and the safety model.

* :func:`decode_te_extra_state`: one ``_extra_state`` value -> a schema payload or None.
* :func:`load_te_checkpoint`: a whole TE checkpoint file, converted (``migrate_te_checkpoint``
  also returns the report; ``convert_te_state_dict`` converts a state dict already in memory).
"""

from fp8state._te.extra_state import (
    DecodedExtraState,
    decode_te_extra_state,
    decode_te_value,
)
from fp8state.migrate.migration_report import EntryReport, MigrationReport
from fp8state.migrate.te_checkpoint import (
    convert_te_state_dict,
    infer_num_gemms,
    load_te_checkpoint,
    migrate_te_checkpoint,
)

__all__ = [
    "decode_te_extra_state",
    "decode_te_value",
    "DecodedExtraState",
    "load_te_checkpoint",
    "migrate_te_checkpoint",
    "convert_te_state_dict",
    "infer_num_gemms",
    "MigrationReport",
    "EntryReport",
]
