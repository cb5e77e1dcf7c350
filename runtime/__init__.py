"""What every job needs around its work: the local Ray and MLflow defaults and the JSON result line."""
