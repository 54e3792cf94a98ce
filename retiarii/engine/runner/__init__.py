"""The trial runner: trials steered by a scheduler's decisions, jobs planned, packed and heard back."""
