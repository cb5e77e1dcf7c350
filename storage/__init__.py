"""The storage layer: every path a job reads or writes, local or on object storage (storage.paths)."""
