"""``SafeDeepSpeedStrategy`` for the standalone ``pytorch_lightning`` package (its own class tree and registry)."""

from pytorch_lightning.strategies import DeepSpeedStrategy

from safe_zero.lightning._common import TRAINER_INITIALIZE_METHODS, TrainerStrategyMixin, check_lightning_fits, \
    compose_docstring
from safe_zero.lightning._registration import register

check_lightning_fits(DeepSpeedStrategy, TRAINER_INITIALIZE_METHODS)


class SafeDeepSpeedStrategy(TrainerStrategyMixin, DeepSpeedStrategy):
    _lightning_strategy = DeepSpeedStrategy
    strategy_name = "safe_deepspeed"


SafeDeepSpeedStrategy.__doc__ = compose_docstring(
    DeepSpeedStrategy, api="Trainer (standalone ``pytorch_lightning``)",
    example='``pytorch_lightning.Trainer(strategy="safe_deepspeed_stage_3")``',
    instance="Trainer(strategy=SafeDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.pytorch_lightning.SafeDeepSpeedStrategy")

# Importing pytorch_lightning.strategies first may have run the registration hook before this class existed.
register("pytorch_lightning.strategies")
