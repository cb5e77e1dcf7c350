"""data_pipelines."""
