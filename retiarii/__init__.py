"""retiarii: exploratory training of neural-network model spaces."""
__version__ = "0.1.0"
