"""Chaos under load: python -m bench.chaos (see its __main__)."""
