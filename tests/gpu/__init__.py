"""The GPU checks: ``test_gpu.py`` (marker ``gpu``, run by ``python -m tests.gpu``), its legs and claims, and
``test_without_gpu.py``, which runs on CPU what of them can."""
