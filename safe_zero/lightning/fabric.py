"""``SafeFabricDeepSpeedStrategy`` for ``lightning.fabric``."""

from safe_zero.versions import require

require("lightning", "safe_zero.lightning")

from lightning.fabric.strategies import DeepSpeedStrategy  # noqa: E402

from safe_zero.lightning._common import FabricStrategyMixin, safe_twin_of  # noqa: E402
from safe_zero.lightning._registration import register  # noqa: E402


@safe_twin_of(
    DeepSpeedStrategy,
    api="Fabric (``lightning.fabric``)",
    example='``Fabric(strategy="safe_deepspeed_stage_3")``',
    instance="Fabric(strategy=SafeFabricDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.SafeFabricDeepSpeedStrategy",
)
class SafeFabricDeepSpeedStrategy(FabricStrategyMixin, DeepSpeedStrategy):
    pass


# Importing lightning.fabric.strategies first may have run the registration hook before this class existed.
register("lightning.fabric.strategies")
