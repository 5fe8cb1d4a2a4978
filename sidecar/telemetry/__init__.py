"""Telemetry: the core emits small event records; adapters (metrics, traces, logs) consume them."""
