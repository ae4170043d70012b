"""`python -m thinkahead`: the command line."""

from thinkahead.cli import main

main()
