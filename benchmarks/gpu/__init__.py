"""The GPU-only checks: ``benchmarks/gpu_check.sh`` runs ``check.py``, which launches ``bodies`` legs and ``checks`` judges them."""
