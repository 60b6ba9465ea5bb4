"""What the safe Lightning strategies share: routing ``deepspeed.initialize`` and running on CPU.

Nothing here corrects DeepSpeed itself: the fixes live in ``safe_zero.fixes`` and reach Lightning
because its ``deepspeed.initialize`` calls are routed through :func:`safe_zero.initialize` for the
duration of the strategy method that makes them. The rest handles the three places where
Lightning's DeepSpeed strategies assume CUDA (the accelerator check, the device-index check and the
``device_rank`` handed to DeepSpeed), so development and CI run on CPU.

The mixins serve both class trees of each API (``lightning.pytorch`` / ``pytorch_lightning`` and
``lightning.fabric`` / ``lightning_fabric``): the sources are the same, only the packages differ.
Each concrete class names the Lightning class it extends in ``_lightning_strategy``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import inspect
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch

from safe_zero.errors import InjectionError, PrecisionFallbackWarning, SafeLightningError  # noqa: F401  (re-exported)
from safe_zero.options import CONFIG_KEY

#: A safe strategy's registry name is Lightning's name with this prefix.
SAFE_PREFIX = "safe_"

#: The Lightning methods that call ``deepspeed.initialize``, per API; the safe strategies route each one.
TRAINER_INITIALIZE_METHODS = ("_setup_model_and_optimizer", "_initialize_deepspeed_inference")
FABRIC_INITIALIZE_METHODS = ("_initialize_engine",)
#: The Lightning methods (both APIs) the safe strategies extend to take a config of only safe_zero's options.
CONFIG_METHODS = ("_load_config", "_create_default_config")


def check_lightning_fits(lightning_strategy: type, methods: tuple[str, ...]) -> None:
    """Refuse a Lightning whose DeepSpeed strategy no longer has the methods the safe strategies extend.

    ``methods`` are those that call ``deepspeed.initialize``: overriding one Lightning stopped calling
    would leave training silently stock. :data:`CONFIG_METHODS` are checked too: without them a config
    of only safe_zero's options would silently become the whole DeepSpeed config.
    """
    missing = [name for name in (*methods, *CONFIG_METHODS) if name not in vars(lightning_strategy)]
    if missing:
        package = lightning_strategy.__module__.split(".")[0]
        distribution = {"lightning_fabric": "lightning-fabric", "pytorch_lightning": "pytorch-lightning"}.get(
            package, package)
        raise SafeLightningError(
            f"{lightning_strategy.__module__}.{lightning_strategy.__qualname__} has no {', '.join(missing)}: this "
            f"{distribution} ({importlib.metadata.version(distribution)}) builds its DeepSpeed engine or config where "
            "safe_zero does not reach it. Install a release in safe_zero's supported range (the `lightning` extra).")


def require_safe_engine(engine: Any) -> Any:
    """Raise unless ``engine`` came out of :func:`safe_zero.initialize`."""
    if getattr(engine, "safe_zero_session", None) is None:

        raise InjectionError(
            f"Lightning built a {type(engine).__name__} without safe_zero: its deepspeed.initialize call was not "
            "routed. Please report this Lightning version.")
    return engine


if TYPE_CHECKING:
    class _LightningStrategy:
        """What the mixins use of the Lightning ``DeepSpeedStrategy`` they are put before, in either API's class tree:
        mypy reads them as its subclasses; at run time they subclass nothing."""

        config: dict[str, Any] | None
        parallel_devices: list[torch.device] | None
        root_device: torch.device
        accelerator: Any  # the API's Accelerator
        local_rank: int

        def setup_environment(self) -> None: ...

        def _load_config(self, config: Any) -> dict[str, Any] | None: ...

        def _create_default_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

        # The Trainer's (TrainerStrategyMixin)
        model: Any

        def setup_distributed(self) -> None: ...

        def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]: ...

        def _initialize_deepspeed_inference(self, *args: Any, **kwargs: Any) -> None: ...

        # Fabric's (FabricStrategyMixin)
        def _setup_distributed(self) -> None: ...

        def _initialize_engine(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]: ...
else:
    _LightningStrategy = object


class _SafeStrategyBase(_LightningStrategy):
    """Behaviour common to the Trainer and Fabric strategies; documented on the concrete classes."""

    INITIALIZE_METHODS: tuple[str, ...]  # the Lightning methods that call deepspeed.initialize
    _lightning_strategy: type[Any]  # Lightning's DeepSpeedStrategy of the same class tree
    _precision_attribute: str  # where the Trainer ("precision_plugin") or Fabric ("precision") keeps its plugin

    def setup_environment(self) -> None:
        if self._runs_on_cpu():
            self._check_cpu(getattr(self, self._precision_attribute))
            self._setup_environment_without_cuda_check()
        else:
            super().setup_environment()

    def _runs_on_cpu(self) -> bool:
        if self.parallel_devices:
            return self.root_device.type == "cpu"
        # Before the Trainer/Fabric hands the strategy its devices, only the accelerator tells.
        return any(base.__name__ == "CPUAccelerator" for base in type(self.accelerator).__mro__)

    # routing ------------------------------------------------------------------------------------------------------

    def _safe_initialize(self, outer: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
        """``deepspeed.initialize`` as Lightning calls it, given CPU's device rank and the ``safe_zero`` block.

        Goes through safe_zero by way of ``outer``, whatever was bound to ``deepspeed.initialize`` before (a
        profiler's or a test's wrapper is called, with safe_zero's classes injected).
        """
        from safe_zero import chaining

        namespace = kwargs.get("args")
        if isinstance(namespace, argparse.Namespace) and getattr(namespace, "device_rank", 0) is None:
            # Lightning passes root_device.index, which CPU devices lack. DeepSpeed compares it with 0, and
            # -1 would make it assume world size 1: pass the local rank, as a launcher would.
            kwargs["args"] = argparse.Namespace(**{**vars(namespace), "device_rank": self.local_rank})
        config = kwargs.get("config")
        block = self.config.get(CONFIG_KEY) if isinstance(self.config, dict) else None
        if block is not None and isinstance(config, dict) and CONFIG_KEY not in config:
            # Lightning's inference path builds a fresh config; keep the user's safe_zero options in it.
            kwargs["config"] = {**config, CONFIG_KEY: block}
        return chaining.initialize_through(outer, *args, **kwargs)

    @contextlib.contextmanager
    def _routed_initialize(self) -> Iterator[None]:
        """``deepspeed.initialize`` resolves to :meth:`_safe_initialize` inside; restored on exit."""
        import deepspeed

        from safe_zero.patching import swapped

        def initialize(*args: Any, **kwargs: Any) -> tuple:
            return self._safe_initialize(outer, *args, **kwargs)

        # Lightning reads deepspeed.initialize at call time. swapped holds safe_zero's patching lock, which keeps
        # another thread's initialize from running while the name is rebound; it gives what was bound before.
        with swapped(deepspeed, "initialize", initialize) as outer:
            yield

    # config -------------------------------------------------------------------------------------------------------

    def _load_config(self, config: Any) -> dict[str, Any] | None:
        """Lightning's loader, plus: a config with nothing but a ``"safe_zero"`` block holds only safe_zero's options.

        Lightning takes a given config as the whole DeepSpeed config and then ignores ``stage``, the
        offload arguments and the rest; a config of only safe_zero's options would leave DeepSpeed at
        ZeRO stage 0. So for such a config Lightning builds the DeepSpeed config from the arguments, as
        without one, and the block is added to it (:meth:`_create_default_config`). This is what lets a
        LightningCLI yaml give ``stage``, offload and safe_zero's options side by side.
        """
        loaded = super()._load_config(config)
        self._safe_zero_options_only = None
        if isinstance(loaded, dict) and set(loaded) == {CONFIG_KEY}:
            from safe_zero.options import SafeZeroOptions

            SafeZeroOptions.from_config(loaded)  # a malformed block fails at construction, not at fit
            self._safe_zero_options_only = copy.deepcopy(loaded[CONFIG_KEY])
            return None
        return loaded

    def _create_default_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        config = super()._create_default_config(*args, **kwargs)
        if getattr(self, "_safe_zero_options_only", None) is not None:
            config[CONFIG_KEY] = self._safe_zero_options_only
        return config

    # CPU ----------------------------------------------------------------------------------------------------------

    def _check_cpu(self, precision_plugin: Any) -> None:
        """Check a CPU run before Lightning writes precision into the DeepSpeed config; apply the 16-mixed fallback."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            raise SafeLightningError(
                f"accelerator='cpu' was selected but DeepSpeed's accelerator is {accelerator.device_name()!r}. "
                "Set DS_ACCELERATOR=cpu in the environment before deepspeed is imported.")
        if accelerator.is_fp16_supported():
            return
        user_fp16 = isinstance(self.config, dict) and bool((self.config.get("fp16") or {}).get("enabled"))
        if user_fp16 or precision_plugin.precision == "16-true":
            what = 'an enabled "fp16" block in the DeepSpeed config' if user_fp16 else "precision='16-true'"
            raise SafeLightningError(
                f"{what} cannot run on this CPU: DeepSpeed has no fp16 support for it. Use precision='bf16-mixed' "
                "(or 'bf16-true') and leave fp16 out of the config.")
        if precision_plugin.precision == "16-mixed":
            warnings.warn(
                "precision='16-mixed' on a CPU without fp16 support: DeepSpeed cannot run fp16 here, so "
                "precision='bf16-mixed' is used instead, as Lightning does for CPU AMP. Pass "
                "precision='bf16-mixed' to silence this.", PrecisionFallbackWarning, stacklevel=3)
            # Re-initialised in place because the Trainer/Fabric hold this very plugin object.
            precision_plugin.__init__("bf16-mixed")

    @contextlib.contextmanager
    def _indexed_cpu_devices(self) -> Iterator[None]:
        """CPU devices numbered by local rank, for the duration of Lightning's device-index check.

        Lightning compares device indices with local ranks (a CUDA_VISIBLE_DEVICES hint); CPU devices carry
        no index, so the check refuses every CPU run.
        """
        devices = self.parallel_devices
        assert devices is not None  # setup_environment refused a strategy without them
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(devices))]
        try:
            yield
        finally:
            self.parallel_devices = devices

    def _setup_environment_without_cuda_check(self) -> None:
        if not self.parallel_devices:
            # Lightning's own strategy would fail an `assert` further down, in the distributed set-up.
            raise SafeLightningError(
                f"{type(self).__name__}.setup_environment() needs the strategy's devices, and none are set. The "
                "Trainer/Fabric set them from devices=...; a strategy used on its own needs "
                "parallel_devices=[torch.device('cpu')] * number_of_processes.")
        # Lightning's DeepSpeedStrategy.setup_environment only refuses non-CUDA accelerators, then defers upward.
        super(self._lightning_strategy, self).setup_environment()

    # registry -----------------------------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register a ``safe_`` twin of every name Lightning registers for its DeepSpeedStrategy. Idempotent.

        Each twin copies the description and init params of Lightning's own entry, so
        ``safe_deepspeed_stage_3`` means exactly what ``deepspeed_stage_3`` means, through safe_zero.
        The names are those Lightning's ``register_strategies`` registers (also into a fresh registry)
        and any other name ``strategy_registry`` already maps to Lightning's class.
        """
        lightning_names = type(strategy_registry)()
        cls._lightning_strategy.register_strategies(lightning_names)
        # dict's own items(): the registry's get() instantiates the strategy.
        entries = {**dict(dict.items(lightning_names)), **dict(dict.items(strategy_registry))}
        for name, entry in entries.items():
            if entry["strategy"] is not cls._lightning_strategy:
                continue
            twin = SAFE_PREFIX + name
            if (dict.get(strategy_registry, twin) or {}).get("strategy") is cls:
                continue
            strategy_registry.register(
                twin, cls, description=f"{entry['description']}, through safe_zero", **entry["init_params"])


class TrainerStrategyMixin(_SafeStrategyBase):
    """The overrides of the Trainer's ``DeepSpeedStrategy`` (lightning.pytorch and pytorch_lightning)."""

    INITIALIZE_METHODS = TRAINER_INITIALIZE_METHODS
    strategy_name = "safe_deepspeed"
    _precision_attribute = "precision_plugin"

    def setup_distributed(self) -> None:
        with self._indexed_cpu_devices() if self._runs_on_cpu() else contextlib.nullcontext():
            super().setup_distributed()

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> tuple:
        with self._routed_initialize():
            engine, optimizer = super()._setup_model_and_optimizer(*args, **kwargs)
        return require_safe_engine(engine), optimizer

    def _initialize_deepspeed_inference(self, *args: Any, **kwargs: Any) -> None:
        with self._routed_initialize():
            super()._initialize_deepspeed_inference(*args, **kwargs)
        require_safe_engine(self.model)


class FabricStrategyMixin(_SafeStrategyBase):
    """The overrides of Fabric's ``DeepSpeedStrategy`` (lightning.fabric and lightning_fabric)."""

    INITIALIZE_METHODS = FABRIC_INITIALIZE_METHODS
    _precision_attribute = "precision"

    def _setup_distributed(self) -> None:
        with self._indexed_cpu_devices() if self._runs_on_cpu() else contextlib.nullcontext():
            super()._setup_distributed()

    def _initialize_engine(self, *args: Any, **kwargs: Any) -> tuple:
        with self._routed_initialize():
            # (engine, optimizer) before Lightning 2.5, (engine, optimizer, scheduler) since.
            engine, *rest = super()._initialize_engine(*args, **kwargs)
        return (require_safe_engine(engine), *rest)


_INTRO = """\
Lightning's {api} ``DeepSpeedStrategy``, with safe_zero's fixes.

Select it by name after ``import safe_zero``: every DeepSpeed name Lightning registers has a
``safe_`` twin with the same meaning ({example}), or pass an instance
(``{instance}``), or give the class path ``{path}`` where Lightning takes one (LightningCLI).

What differs from Lightning's strategy:

* Every ``deepspeed.initialize`` the strategy makes goes through :func:`safe_zero.initialize`, so
  zero-sized parameters, trainable parameters that get no gradient and grouped_mm expert weights
  train under ZeRO. The engine carries ``engine.safe_zero_session`` (``.report`` says which fixes
  acted). A Lightning that builds its engine some other way is refused, never run stock.
* safe_zero options: a ``"safe_zero"`` block in ``config`` (keys ``fixes``, ``alignment``,
  ``alignment_guard``; see :class:`safe_zero.SafeZeroOptions`). A ``config`` (dict or JSON path)
  holding nothing but that block adds it to the config Lightning builds from the other arguments
  (``stage``, offload, ...): ``stage=3, config={{"safe_zero": {{...}}}}`` runs ZeRO-3. A ``config``
  with DeepSpeed keys is the whole DeepSpeed config, as in Lightning (the stage and offload arguments
  are then ignored). ``strategy.config["safe_zero"] = {{...}}`` after construction works too.
* ``accelerator="cpu"`` runs, on one or more processes (gloo), for development and CI. DeepSpeed
  must use its CPU accelerator (``DS_ACCELERATOR=cpu`` before deepspeed is imported), else
  :class:`~safe_zero.lightning.SafeLightningError`. Lightning's three CUDA assumptions are
  bypassed: its refusal of non-CUDA accelerators, its check that device indices equal local ranks
  (CPU devices have none), and the ``device_rank`` it hands DeepSpeed (the local rank is passed).
* Precision on a CPU without fp16 support (DeepSpeed's ``is_fp16_supported()``):
  ``precision="16-mixed"`` runs as ``"bf16-mixed"`` with a
  :class:`~safe_zero.lightning.PrecisionFallbackWarning`, as Lightning does for CPU AMP;
  ``precision="16-true"`` or an enabled ``"fp16"`` block in ``config`` raises
  :class:`~safe_zero.lightning.SafeLightningError`, since no fallback keeps their meaning.
  ``bf16-mixed`` and ``bf16-true`` are the same under DeepSpeed.
"""


#: The constructor arguments Lightning leaves undocumented (the Trainer/Fabric fill them in).
_UNDOCUMENTED_BY_LIGHTNING = {
    "accelerator": "The accelerator, normally set by the Trainer/Fabric from ``accelerator=``: CUDA, or CPU "
                   "(see above).",
    "parallel_devices": "The devices of the processes, normally set by the Trainer/Fabric from ``devices=``.",
    "cluster_environment": "Where ranks and the main address come from, normally chosen by the Trainer/Fabric.",
    "precision_plugin": "The DeepSpeed precision plugin, normally made by the Trainer from ``precision=`` "
                        "(see the CPU precision notes above).",
    "precision": "The DeepSpeed precision plugin, normally made by Fabric from ``precision=`` "
                 "(see the CPU precision notes above).",
    "process_group_backend": "The torch.distributed backend; by default ``nccl`` on CUDA and ``gloo`` on CPU.",
    "timeout": "Timeout of the process group's collectives.",
}


_Safe = TypeVar("_Safe", bound=_SafeStrategyBase)


def safe_twin_of(lightning_strategy: type, **doc_fields: str) -> Callable[[type[_Safe]], type[_Safe]]:
    """Class decorator of a safe strategy: checks that this Lightning fits, names its Lightning class, documents it.

    ``doc_fields`` fill the docstring's intro (``api``, ``example``, ``instance``, ``path``).
    """

    def define(cls: type[_Safe]) -> type[_Safe]:
        check_lightning_fits(lightning_strategy, cls.INITIALIZE_METHODS)
        cls._lightning_strategy = lightning_strategy
        cls.__doc__ = compose_docstring(lightning_strategy, **doc_fields)
        return cls

    return define


def compose_docstring(lightning_strategy: type[Any], **fields: str) -> str:
    """The class docstring: safe_zero's part, then the documentation of every argument of Lightning's constructor."""
    lightning_doc = inspect.cleandoc(lightning_strategy.__init__.__doc__ or "")
    marker = next((m for m in ("Arguments:", "Args:") if m in lightning_doc), None)
    arguments = lightning_doc[lightning_doc.index(marker) + len(marker):].strip("\n") if marker else ""
    for name in inspect.signature(lightning_strategy).parameters:
        if f"    {name}:" not in arguments and name in _UNDOCUMENTED_BY_LIGHTNING:
            arguments += f"\n\n    {name}: {_UNDOCUMENTED_BY_LIGHTNING[name]}"
    where = f"{lightning_strategy.__module__}.{lightning_strategy.__qualname__}"
    return (_INTRO.format(**fields) + f"\nThe constructor is {where}'s, unchanged.\n\nArgs:\n{arguments}\n")
