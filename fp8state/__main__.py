"""``python -m fp8state``: the ``fp8state`` console script."""

from fp8state.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
