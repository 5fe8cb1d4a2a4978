"""What became of one guarded request: the ``result`` label of
``retry_sidecar_idempotency_total{route,result}``."""

from __future__ import annotations

from enum import StrEnum


class IdempotencyOutcome(StrEnum):
    FIRST = "first"  # K claimed, the app answered, the answer kept
    REPLAYED = "replayed"  # the kept answer, the app not called
    IN_PROGRESS = "in-progress"  # 409: another request holds K
    MISMATCH = "mismatch"  # 422: K belongs to another request
    INVALID = "invalid"  # 400: a malformed key
    MISSING = "missing"  # no key: 400 when required, else forwarded unguarded
    RELEASED = "released"  # an answer the route would retry: K let go
    LEASE_EXPIRED = "lease-expired"  # a dead holder's lease passed: this request took K over
    STORE_ERROR = "store-error"  # the store could not answer (on_store_error applied)
    # A new key past idempotency.max_records/max_bytes (likewise), or an answer kept without
    # its body because the whole one would put the store past its bound (the key finished).
    STORE_FULL = "store-full"
