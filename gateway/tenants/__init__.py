"""Tenants (docs/tenants.md): who each request serves and is billed to, and its key's limits.

- ``records``: a key's record, what may change of it, the tenant a request resolves to;
- ``keystore``: the keys made at run time, in Redis (the admin API and the CLI share it);
- ``directory``: every key a gateway process knows, in memory, reloaded within a second of
  a change;
- ``limits``: a key's limits, admitted on its Redis slot, and the ``x-ratelimit-*`` headers;
- ``caller``: whom a request serves, and what its admission found.

The core asks these in one place, gateway/core/store/admission.py; they need only ``wire``.
The admin API and ``python -m gateway keys`` are among the APIs (gateway/apis/admin/).
"""
