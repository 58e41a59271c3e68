"""Checkpoints across devices and ranks: safe loading, validation, DCP, consolidation.

- :func:`load`: ``torch.load(weights_only=True, map_location="cpu")`` with clear errors
  (TransformerEngine files point at ``fp8state migrate``).
- :func:`load_state_dict`: validates every FP8 extra state, key and shape first, reports all
  problems at once, and leaves the model unchanged when anything is wrong.
- :func:`dcp_save` / :func:`dcp_load`: ``torch.distributed.checkpoint`` for plain, DDP and
  FSDP2 models; N ranks save, M ranks load. :func:`check_fp8_metadata_replicated` is the
  check :func:`dcp_save` runs so that DCP's de-duplication never drops a rank's metadata.
- :func:`consolidate`: a DCP folder to one ``torch.save`` file; :func:`load_dcp_state_dict`
  and :func:`read_dcp_metadata` read DCP folders without a model. Every DCP reader here runs
  nothing pickled in the folder unless called with ``trusted=True``.
- :func:`load_plain_state_dict` / :func:`to_plain_state_dict`: weights without FP8 metadata
  (a model trained without FP8, a Hugging Face checkpoint) in and out, under plain PyTorch's
  names; :func:`save_safetensors` / :func:`load_safetensors` do the same with files
  (``docs/interop.md``).

The rules behind them are in ``docs/checkpoints.md``.
"""

from fp8state.checkpoint.consolidation import ConsolidateResult, consolidate
from fp8state.checkpoint.dcp_files import (
    DCPEntry,
    is_dcp_checkpoint,
    load_dcp_state_dict,
    read_dcp_metadata,
)
from fp8state.checkpoint.distributed import dcp_load, dcp_save
from fp8state.checkpoint.io import find_legacy_extra_states, load
from fp8state.checkpoint.names import plain_names
from fp8state.checkpoint.plain import load_plain_state_dict, to_plain_state_dict
from fp8state.checkpoint.plain_safetensors import load_safetensors, save_safetensors
from fp8state.checkpoint.replicated import check_fp8_metadata_replicated
from fp8state.checkpoint.validate import load_state_dict, validate_state_dict
from fp8state.errors import StateDictError

__all__ = [
    "load",
    "load_state_dict",
    "validate_state_dict",
    "find_legacy_extra_states",
    "load_plain_state_dict",
    "to_plain_state_dict",
    "plain_names",
    "save_safetensors",
    "load_safetensors",
    "dcp_save",
    "dcp_load",
    "check_fp8_metadata_replicated",
    "consolidate",
    "ConsolidateResult",
    "is_dcp_checkpoint",
    "read_dcp_metadata",
    "load_dcp_state_dict",
    "DCPEntry",
    "StateDictError",
]
