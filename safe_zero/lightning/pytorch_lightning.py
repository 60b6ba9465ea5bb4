"""``SafeDeepSpeedStrategy`` for the standalone ``pytorch_lightning`` package (its own class tree and registry)."""

from safe_zero.versions import require

require("lightning", "safe_zero.lightning", installed_as="pytorch-lightning")

from pytorch_lightning.strategies import DeepSpeedStrategy  # noqa: E402

from safe_zero.lightning._common import TrainerStrategyMixin, safe_twin_of  # noqa: E402
from safe_zero.lightning._registration import register  # noqa: E402


@safe_twin_of(
    DeepSpeedStrategy,
    api="Trainer (standalone ``pytorch_lightning``)",
    example='``pytorch_lightning.Trainer(strategy="safe_deepspeed_stage_3")``',
    instance="Trainer(strategy=SafeDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.pytorch_lightning.SafeDeepSpeedStrategy",
)
class SafeDeepSpeedStrategy(TrainerStrategyMixin, DeepSpeedStrategy):
    pass


# Importing pytorch_lightning.strategies first may have run the registration hook before this class existed.
register("pytorch_lightning.strategies")
