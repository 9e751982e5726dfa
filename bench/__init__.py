"""Benchmarks, a package: run each as `python -m bench.<name>` from the repository root, which
imports the checkout's span_lm (installed or not). bench/harness.py holds what they share."""
