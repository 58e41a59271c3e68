"""Adapters for the training stacks people run: Hugging Face ``transformers`` and Lightning.

Each submodule imports its third-party package when it is imported itself; ``import fp8state``
never does, so none of them is a dependency of the core package.
"""
