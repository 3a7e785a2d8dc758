"""icml26: reference implementations of ICML 2026 methods, one room per paper (``icml26.methods.<room>``).

``import icml26`` is cheap: it imports neither torch nor transformers. It only arranges that models saved by
icml26 (TinyLM, FiX and KromHC models, converted Llama-family models) reload with transformers'
``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(dir)`` without importing their room first
(see :mod:`icml26.models.auto`).
"""

from icml26.models.auto import install as _install_auto_classes

__version__ = "0.1.0"

_install_auto_classes()
