"""Fleet mode: the Redis the sidecars of one service share (``fleet:``). The client is made
here (``connection``); the idempotency store and the kill switch use it."""
