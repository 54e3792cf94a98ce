"""What crosses from the runner to a worker: the job, its tasks and events, and the grouped job's contract."""
