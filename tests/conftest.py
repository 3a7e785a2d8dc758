"""Suite-wide settings: no network for transformers, no progress bars in test logs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ICML26_PROGRESS", "0")
