"""``python -m pagedq ...`` = the ``pagedq`` command."""
import sys

from pagedq.worker.cli import main

sys.exit(main())
