"""Helpers shared by the tests (no tests here), one module per concern.

- ``paths``: the repository's folders (``REPO_ROOT``, ``FIXTURES``, ...), defined once.
- ``numerics``: SQNR and the bytes of a tensor.
- ``models``: small mixin modules and models, their training steps, a save/load round trip.
- ``tiny_lm``: a small plain-PyTorch transformer and its conversion.
- ``hf``: a tiny Hugging Face Llama built from a config, converted to FP8.
- ``state``: bit-exact comparisons of tensors, payloads, state dicts and modules' FP8 state;
  snapshots for "nothing changed".
- ``corruptions``: every kind of bad payload, for the schema and mixin error tests.
- ``docs``: the python blocks of a Markdown page, run as written.
- ``cli``: the ``fp8state`` command, in process and as a console script.
- ``dcp``: DCP folders with crafted metadata.
- ``import_graph``: the package's import graph and layer rules (``architecture/test_layers.py``).
- ``capture``: the warm-up on a side stream that a CUDA graph capture needs.

Import as ``from _helpers.state import ...``: ``tests/`` is on ``sys.path`` because it holds
``conftest.py`` and has no ``__init__.py`` (pytest's default "prepend" import mode).
"""
