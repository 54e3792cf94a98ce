"""Exploration strategies (instantiation control) and schedulers (training control).

One algorithm per file; each is importable from here.
"""
