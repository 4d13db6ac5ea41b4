"""The core: a generation from its submit to its last event, the same for every API.

The sessions store and the queue's gate (what may be asked, whether there is room), the
models, the relay that reads every session's events once per process and fans them out,
and the generation stream an API follows. It knows no API and no server."""
