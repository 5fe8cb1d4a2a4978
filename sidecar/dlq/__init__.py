"""The dead-letter queue: failed writes kept on disk, inspected and replayed."""
