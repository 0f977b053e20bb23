"""``python -m noetl_mesh.cli``: the ``noetl`` command (how the stack starts its service processes)."""
import sys

from .app import main

sys.exit(main())
