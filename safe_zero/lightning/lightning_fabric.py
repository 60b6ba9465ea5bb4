"""``SafeFabricDeepSpeedStrategy`` for the standalone ``lightning_fabric`` package (its own class tree and registry)."""

from lightning_fabric.strategies import DeepSpeedStrategy

from safe_zero.lightning._common import FABRIC_INITIALIZE_METHODS, FabricStrategyMixin, check_lightning_fits, \
    compose_docstring
from safe_zero.lightning._registration import register

check_lightning_fits(DeepSpeedStrategy, FABRIC_INITIALIZE_METHODS)


class SafeFabricDeepSpeedStrategy(FabricStrategyMixin, DeepSpeedStrategy):
    _lightning_strategy = DeepSpeedStrategy


SafeFabricDeepSpeedStrategy.__doc__ = compose_docstring(
    DeepSpeedStrategy, api="Fabric (standalone ``lightning_fabric``)",
    example='``lightning_fabric.Fabric(strategy="safe_deepspeed_stage_3")``',
    instance="Fabric(strategy=SafeFabricDeepSpeedStrategy(stage=3))",
    path="safe_zero.lightning.lightning_fabric.SafeFabricDeepSpeedStrategy")

# Importing lightning_fabric.strategies first may have run the registration hook before this class existed.
register("lightning_fabric.strategies")
