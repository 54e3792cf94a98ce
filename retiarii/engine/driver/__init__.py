"""The driver: an experiment and the collaborators it holds (proposals, checks, costs, the one-shot host)."""
