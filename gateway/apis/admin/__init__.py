"""The admin API (``/v1/admin/keys``, ``/v1/admin/usage``) and its command line
(``python -m gateway keys``): the keys and their usage, among the other APIs."""
