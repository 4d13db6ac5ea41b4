"""Test helpers, one module per thing they hold; fixtures stay in tests/conftest.py.

    http.py          a client of a gateway's session API: sessions, messages, reading SSE
    sse.py           a strict Server-Sent Events parser
    ws.py            a WebSocket client
    oracle.py        what the synthetic engine answers (from the backend's own script)
    metrics.py       one Prometheus reader for the gateway's and the worker's /metrics
    redis_probes.py  what Redis holds under a test's key prefix, read through wire.Keys
    stack.py         a test's processes: stack/rig.py's rig, and what a test waits for
    browser.py       the web page driven in headless Chromium
    engines.py       the engine under test of the suite run on both backends
    adapter_events.py  contract events and the bytes an adapter writes (in-process tests)
    hostile.py       Hypothesis strategies for hostile JSON
    cluster.py       what the cluster and Sentinel tests do to their servers; a reply's check

No test module imports another (tests/inprocess/test_test_layout.py checks it).
"""
