"""``python -m microplan``: the same command line as the ``microplan`` script."""

from .cli import main

raise SystemExit(main())
