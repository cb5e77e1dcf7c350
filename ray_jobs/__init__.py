"""ray_jobs."""
