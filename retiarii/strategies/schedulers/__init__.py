"""Schedulers: training control, one decision per reported result."""
