"""What several test modules share: models, rank bodies, training set-ups and their references. Test modules import
from here (or from their own folder's helpers), never from another test module (``tests/test_imports.py``)."""
