"""``python -m hetconv ...`` is the ``hetconv`` command."""
import sys

from hetconv.commands.cli import main

sys.exit(main())
