"""Learned-span attention: its door (door.py), the implementations it picks, their tile tables and
cost models (span_lm/kernels/__init__.py, docs/kernels.md)."""
