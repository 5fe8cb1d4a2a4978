"""Effectively-once writes: the sidecar enforces ``Idempotency-Key`` for the app behind it.

The pure rules (``key``, ``fingerprint``, ``decision``, ``keep``, ``problem``), the route and
store settings (``policy``), the store's contract (``store``) and its SQLite backend (``sqlite``,
``writer``, ``schema``), the background pruning (``prune``) and the one entry point the request
handler calls (``guard``). See docs/architecture.md, "Effectively-once writes".
"""
