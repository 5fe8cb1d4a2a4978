"""The retry engine: pure decisions (backoff, classify, decide, deadline) and one async driver."""
