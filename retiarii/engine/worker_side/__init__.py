"""What runs inside a worker: a job's models built, grouped, measured and trained."""
