"""`python -m fmoe` is the `fmoe` command."""
import sys

from fmoe.cli import main

sys.exit(main())
