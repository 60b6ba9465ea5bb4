"""``SafeFabricDeepSpeedStrategy`` for the standalone ``lightning_fabric`` package (its own class tree and registry)."""

from safe_zero.versions import require

require("lightning", "safe_zero.lightning", installed_as="lightning-fabric")

from lightning_fabric.strategies import DeepSpeedStrategy  # noqa: E402

from safe_zero.lightning._common import FabricStrategyMixin, safe_twin_of  # noqa: E402
from safe_zero.lightning._registration import register  # noqa: E402


@safe_twin_of(
    DeepSpeedStrategy,
    api="Fabric (standalone ``lightning_fabric``)",
    example='``lightning_fabric.Fabric(strategy="safe_deepspeed_stage_3")``',
    instance="Fabric(strategy=SafeFabricDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.lightning_fabric.SafeFabricDeepSpeedStrategy",
)
class SafeFabricDeepSpeedStrategy(FabricStrategyMixin, DeepSpeedStrategy):
    pass


# Importing lightning_fabric.strategies first may have run the registration hook before this class existed.
register("lightning_fabric.strategies")
