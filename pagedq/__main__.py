"""``python -m pagedq ...`` = the ``pagedq`` command."""
import sys

from worker.cli import main

sys.exit(main())
