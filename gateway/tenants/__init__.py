"""Tenants (docs/tenants.md): who each request serves and is billed to, and its key's limits.

- ``records``: a key's record, what may change of it, the tenant a request resolves to;
- ``keystore``: the keys made at run time, in Redis (the admin API and the CLI share it);
- ``directory``: every key a gateway process knows, in memory, reloaded within a second of
  a change;
- ``limits``: a key's limits, admitted on its Redis slot, and the ``x-ratelimit-*`` headers;
- ``caller``: the request being served's tenant and counts;
- ``admin``: ``/v1/admin/keys`` and ``/v1/admin/usage``; ``cli``: ``python -m gateway keys``.

The core asks these through gateway/core/tenancy.py; they need only ``wire`` (the admin API
and the CLI sit beside the other APIs).
"""
