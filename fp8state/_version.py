"""Package version (not the checkpoint schema version: see ``fp8state.schema``)."""

__version__ = "0.1.0"
