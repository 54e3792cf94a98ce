"""What a run keeps: the SQLite store and its tables, checkpoint files, the driver's lock."""
