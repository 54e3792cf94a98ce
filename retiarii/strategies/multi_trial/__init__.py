"""Multi-trial strategies: each proposes one sample at a time and hears its model's value."""
