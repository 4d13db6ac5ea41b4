"""Runs the whole product on one machine: embedded Redis, an engine worker, the gateway.

Used by ``make run`` (``python -m stack``) and by the tests, which start the same real
processes the product runs.
"""
