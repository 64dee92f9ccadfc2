"""`python -m bench.goodput`: the goodput benchmark (bench/goodput/__init__.py)."""

from bench.goodput import main

main()
