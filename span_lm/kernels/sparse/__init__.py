"""The Sparse Transformer's fixed-pattern attention: its door (door.py) and implementations
(span_lm/kernels/__init__.py, docs/kernels.md)."""
