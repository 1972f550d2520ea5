"""`python -m fmoe` is the `fmoe` command."""
import sys

from fmoe.app.cli import main

sys.exit(main())
