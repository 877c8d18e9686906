"""python -m jaxgrpo.bench ..."""

import sys

from jaxgrpo.bench import main

main(sys.argv[1:])
