"""``python -m fp8state.cli``: the same as the ``fp8state`` console script."""

import sys

from fp8state.cli import main

sys.exit(main())
