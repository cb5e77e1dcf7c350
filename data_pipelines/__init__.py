"""Ray Data readers, record schemas and validation, and the generators/annotators (teacher scoring)."""
