"""tokenspout's engine worker: takes generation requests from Redis and runs them.

The gateway imports ``engine.contract`` and nothing else from this package.
"""
