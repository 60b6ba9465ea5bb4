"""``SafeDeepSpeedStrategy`` for ``lightning.pytorch``'s Trainer."""

from safe_zero.versions import require

require("lightning", "safe_zero.lightning")

from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402

from safe_zero.lightning._common import TrainerStrategyMixin, safe_twin_of  # noqa: E402
from safe_zero.lightning._registration import register  # noqa: E402


@safe_twin_of(
    DeepSpeedStrategy,
    api="Trainer (``lightning.pytorch``)",
    example='``Trainer(strategy="safe_deepspeed_stage_3")``',
    instance="Trainer(strategy=SafeDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.SafeDeepSpeedStrategy",
)
class SafeDeepSpeedStrategy(TrainerStrategyMixin, DeepSpeedStrategy):
    pass


# Importing lightning.pytorch.strategies first may have run the registration hook before this class existed.
register("lightning.pytorch.strategies")
