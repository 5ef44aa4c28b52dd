"""`python -m asyncengine ...` runs the `asyncengine` command."""

import sys

from asyncengine.entrypoints.cli import main

sys.exit(main())
