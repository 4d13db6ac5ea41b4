"""tokenspout's engine worker: takes generation requests from Redis and runs them.

It shares only the ``wire`` package with the gateway, and never imports ``gateway``.
"""
