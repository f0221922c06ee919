"""`python -m posttrain.cli <command> ...`: the same as the `posttrain` script."""
import sys

from posttrain.cli import main

sys.exit(main())
