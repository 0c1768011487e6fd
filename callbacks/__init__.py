"""Lightning callbacks of alfrl: side effects only (weight sync, checkpoints, evaluation, progress)."""

from callbacks.checkpointing import Checkpointing
from callbacks.periodic_eval import PeriodicEval
from callbacks.progress import RolloutProgressBar
from callbacks.weight_sync import SamplerWeightSync

__all__ = ["Checkpointing", "PeriodicEval", "RolloutProgressBar", "SamplerWeightSync"]
