"""``python -m pagedq ...`` = the ``pagedq`` command."""
import sys

from pagedq.cli import main

sys.exit(main())
