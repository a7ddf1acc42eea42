"""User-facing benchmark and training scripts (run as ``python benchmarks/NAME.py``)."""
