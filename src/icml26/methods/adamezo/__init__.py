"""AdaMeZO (arXiv 2605.00650): an Adam-style zeroth-order optimizer that replays its moments from seeds."""

from .config import AdaMeZOConfig
from .optimizer import NO_DECAY_SUBSTRINGS, AdaMeZO, MeZO, replay_moments, zo_param_groups

__all__ = ["AdaMeZO", "AdaMeZOConfig", "MeZO", "NO_DECAY_SUBSTRINGS", "replay_moments", "zo_param_groups"]
