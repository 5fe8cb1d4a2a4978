"""The retry engine: one exchange through a route's whole policy (breaker admission, bulkhead,
attempts, backoff, budget, kill switch), shared by live traffic (``sidecar.proxy``) and DLQ
replays (``sidecar.dlq``). It sits below both and imports neither; see docs/architecture.md."""
