"""Setting a run up: ``kmoss config`` (``configure``) and what it detects (``detect``)."""
