"""torchao behind one door: everything the ``fp8`` lever asks of torchao's float8 training.

The ``fp8`` lever builds on torchao (the optional extra ``speedflags[fp8]``): its
``Float8Linear`` does the FP8 work (dynamic scaling, the scaled matmul, its emulation on a
CPU), and no FP8 GEMM, scaling recipe or casting kernel is written here. torchao's own
entry point, ``convert_to_float8_training``, is not used: it converts a model one way (torchao
has no inverse), and it applies a process-wide inductor patch that is never undone. Instead,
this module makes one ``Float8Linear`` per ``nn.Linear`` with ``Float8Linear.from_float``
(which keeps the same weight Parameter) and the swap module
(:mod:`speedflags.levers._fp8_swap`) puts it in and takes it out.

torchao is moving float8 training from a module swap to a weight-wrapper tensor subclass;
this module is the only one that names torchao, so that such a change stays here.

What it adds to torchao's ``Float8Linear`` (the *twin* class, :func:`twin`):

- it shares the ``nn.Linear``'s own state (the ``_parameters``, ``_buffers`` and hook
  dicts are the same objects), so ``state_dict()``, the optimizer's references, hooks and a
  parameter assigned inside the block are the layer's own;
- under ``torch.no_grad()`` or ``inference_mode`` it casts the weight to float8 (with its
  scale) once per parameter version (its version counter and storage, and every optimizer
  step: a fused one bumps no version) and reuses the cast, as ``param_dtype`` does for bf16,
  through torchao's own path for a weight cast beforehand (``matmul_with_hp_or_float8_args``
  takes an already cast operand as it is, as FSDP's float8 all-gather hands it one);
- it pickles (``torch.save(model)``, ``copy.deepcopy``) as the ``nn.Linear`` it stands for.

Importing torchao (only when the lever is used; ``import speedflags`` never does) prints
"Failed to load ..." for its CUDA extensions on a CPU-only PyTorch build and a deprecation
line from PyTorch's pytree module: both are log records, harmless there (they are torchao's
own CUDA kernels, which a CPU build cannot run, and a registration PyTorch 2.13 no longer
needs), and are kept out of the user's log on a CPU build (:func:`import_notes` keeps them).
On a CUDA build they are let through: a kernel that failed to load can matter there.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import importlib.util
import logging
import re
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import torch
from torch import nn

from .._locks import new_lock
from .._tracing import is_compiling
from .._version import install_hint
from ..errors import LeverUnavailableError
from ._model_casts import optimizer_stepped, steps_taken

__all__ = [
    "INSTALL",
    "MIN_TORCHAO",
    "NEEDS_TORCH",
    "clear_cast",
    "hold_steps",
    "import_notes",
    "is_twin",
    "load",
    "missing",
    "release_steps",
    "twin",
]

MIN_TORCHAO = (0, 18)  # what speedflags is tested with (setup.cfg's extra)
NEEDS_TORCH = (2, 11)  # torchao 0.18 imports only with PyTorch 2.11 or newer
INSTALL = install_hint("fp8")
_SHOWN_MIN = ".".join(map(str, MIN_TORCHAO))
_SHOWN_TORCH = ".".join(map(str, NEEDS_TORCH))

# What torchao logs at import that a CPU build makes harmless, by logger (see the docstring).
_IMPORT_NOISE = {
    "torchao": re.compile(r"^Failed to load .*\.so"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
}


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading release numbers of a version."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def torchao_version() -> str | None:
    """The installed torchao's version, or None when it is not installed (nothing imported)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:  # importable without metadata: a source checkout
        return "unknown"


class _Loaded:
    """torchao's pieces the lever uses, and the twin class made from them (once)."""

    def __init__(self, version: str, **pieces: Any) -> None:
        self.version = version
        self.__dict__.update(pieces)
        self.twin_class = _make_twin_class(self)

    Float8Linear: Any
    Float8LinearConfig: Any
    recipe_names: tuple[str, ...]
    cast_weight: Any
    matmul: Any


_lock = new_lock()
_loaded: _Loaded | None = None
_failed: str | None = None  # why importing torchao failed (tried once per process)
_notes: list[str] = []


def missing() -> str | None:
    """Why the ``fp8`` lever cannot run here (torchao missing, too old, or a PyTorch older
    than torchao needs), or None. Imports nothing: it reads the installed packages' versions.

    Example:
        >>> from speedflags.levers._torchao import missing
        >>> missing() is None or "torchao" in missing()
        True
    """
    if _failed is not None:
        return _failed
    if _release(torch.__version__) < NEEDS_TORCH:
        return (
            f"FP8 runs through torchao's float8 training, which needs PyTorch {_SHOWN_TORCH} or "
            f"newer (torchao {_SHOWN_MIN}); this is PyTorch {torch.__version__}"
        )
    version = torchao_version()
    if version is None:
        return (
            f"FP8 runs through torchao's float8 training, and torchao is not installed ({INSTALL})"
        )
    if version != "unknown" and _release(version) < MIN_TORCHAO:
        return (
            f"torchao {version} is installed; the fp8 lever needs torchao {_SHOWN_MIN} or "
            f"newer ({INSTALL})"
        )
    return None


def load() -> _Loaded:
    """torchao's float8 pieces, imported on first use (quietly on a CPU build, see the
    module docstring).

    Raises:
        LeverUnavailableError: torchao is missing, too old, or fails to import (the reason,
            and how to install it).
    """
    global _loaded, _failed
    loaded = _loaded
    if loaded is not None:
        return loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        reason = missing()
        if reason is not None:
            raise LeverUnavailableError(f"fp8: {reason}")
        version = torchao_version() or "unknown"
        try:
            with _quiet_import():
                from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName
                from torchao.float8.float8_linear import (
                    Float8Linear,
                    matmul_with_hp_or_float8_args,
                )
                from torchao.float8.float8_scaling_utils import (
                    get_maybe_axiswise_dim,
                    hp_tensor_to_float8_dynamic,
                )
                from torchao.float8.float8_training_tensor import GemmInputRole
        except Exception as exc:  # a broken or incompatible install: said once, kept
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _failed = f"torchao {version} failed to import: {type(exc).__name__}: {first[:200]}"
            raise LeverUnavailableError(f"fp8: {_failed}") from exc

        def cast_weight(module: Any, weight_t: torch.Tensor) -> torch.Tensor:
            # the weight operand exactly as Float8Linear's forward casts it (its transpose)
            cast = module.config.cast_config_weight
            made: torch.Tensor = hp_tensor_to_float8_dynamic(
                weight_t,
                cast.target_dtype,
                module.linear_mm_config,
                gemm_input_role=GemmInputRole.WEIGHT,
                scaling_granularity=cast.scaling_granularity,
                axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
                round_scales_to_power_of_2=module.config.round_scales_to_power_of_2,
            )
            return made

        _loaded = _Loaded(
            version,
            Float8Linear=Float8Linear,
            Float8LinearConfig=Float8LinearConfig,
            recipe_names=tuple(str(r.value) for r in Float8LinearRecipeName),
            cast_weight=cast_weight,
            matmul=matmul_with_hp_or_float8_args,
        )
        return _loaded


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.pattern.search(message):
            _notes.append(message)
            return False
        return True


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import, without its CPU-build noise (kept in :func:`import_notes`)."""
    # bool(): torch 2.1's stubs call torch.version.cuda a str, later ones Optional[str]
    if bool(torch.version.cuda) or bool(torch.version.hip):
        yield  # a GPU build: a kernel that failed to load may matter; let torchao say so
        return
    filters = [(logging.getLogger(name), _DropNoise(p)) for name, p in _IMPORT_NOISE.items()]
    for logger, noise in filters:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger, noise in filters:
            logger.removeFilter(noise)


def import_notes() -> tuple[str, ...]:
    """What torchao logged at import that was kept out of the log (a CPU build's "Failed to
    load ..." for torchao's CUDA extensions, PyTorch's pytree deprecation line)."""
    return tuple(_notes)


def config_for(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``emulate``: its emulation (float8
    casts, float32 matmul) where no FP8 tensor cores run the scaled matmul.

    Raises:
        LeverUnavailableError: the installed torchao has no such recipe.
    """
    loaded = load()
    if recipe not in loaded.recipe_names:
        raise LeverUnavailableError(
            f"fp8={recipe!r}: torchao {loaded.version} has no such recipe; it offers "
            f"{', '.join(map(repr, loaded.recipe_names))}"
        )
    config = loaded.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate) if emulate else config


# The attributes torchao's Float8Linear adds to an nn.Linear's, and the twin's cast cache:
# everything else in a twin's __dict__ is the layer's own.
_CAST = "_speedflags_fp8_cast"


def twin(linear: nn.Linear, recipe: str, emulate: bool, own_class: type) -> nn.Linear:
    """A ``Float8Linear`` that computes ``linear`` in FP8 with torchao's ``recipe``, sharing
    ``linear``'s parameters, buffers and hooks (the same objects); it pickles as an
    ``own_class`` (the layer's own class, not a shadow class that stands in for it).

    Raises:
        LeverUnavailableError: torchao cannot be used here, or has no such recipe.
    """
    loaded = load()
    config = config_for(recipe, emulate)
    made = loaded.Float8Linear.from_float(linear, config=config)
    own = frozenset(made.__dict__) - frozenset(linear.__dict__)
    object.__setattr__(made, "__class__", loaded.twin_class)
    made.__dict__["_speedflags_own"] = own | {_CAST, "_speedflags_own", "_speedflags_of"}
    made.__dict__["_speedflags_of"] = own_class
    share(made, linear)
    return made  # type: ignore[no-any-return]


def share(made: nn.Module, linear: nn.Module) -> None:
    """Make ``made``'s state ``linear``'s: every attribute of the layer's own (its
    ``_parameters``, ``_buffers``, hook dicts, ``training``) is the layer's object."""
    own = made.__dict__["_speedflags_own"]
    for key, value in linear.__dict__.items():
        if key not in own:
            made.__dict__[key] = value


def give_back(made: nn.Module, linear: nn.Module) -> None:
    """What changed on ``made`` while it stood in (``model.eval()``, an attribute set),
    written back to ``linear``; and its cast dropped."""
    own = made.__dict__["_speedflags_own"]
    for key, value in made.__dict__.items():
        if key not in own and linear.__dict__.get(key, _ABSENT) is not value:
            linear.__dict__[key] = value
    clear_cast(made)


_ABSENT = object()


def clear_cast(made: nn.Module) -> None:
    """Drop the twin's cached float8 weight (no cast outlives the block that made it)."""
    made.__dict__.pop(_CAST, None)


def is_twin(module: nn.Module) -> bool:
    """Whether ``module`` is a twin (torchao's ``Float8Linear`` standing in for a layer)."""
    return bool(getattr(type(module), "_speedflags_fp8_twin", False))


# Optimizer steps: a fused optimizer (AdamW(fused=True)) writes the weights without bumping
# their version counter, so the cast cache keys on the optimizer steps taken too, counted by
# param_dtype's hook (speedflags.levers._model_casts), registered here while any fp8 block
# holds twins in a model (:func:`hold_steps`) and removed when the last one exits.
_step_hook: list[Any] = []  # [the hook's handle, how many models hold it]


def hold_steps() -> None:
    """Count optimizer steps from now on (one more model holds twins)."""
    with _lock:
        if not _step_hook:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _step_hook[:] = [register_optimizer_step_post_hook(optimizer_stepped), 0]
        _step_hook[1] += 1


def release_steps() -> None:
    """One model less holds twins; the hook goes when none does."""
    with _lock:
        if not _step_hook:
            return
        _step_hook[1] -= 1
        if _step_hook[1] <= 0:
            _step_hook[0].remove()
            _step_hook.clear()


def _mode(weight: torch.Tensor) -> int:
    # as param_dtype's cast cache: 0 made with autograd, 1 without (serves no_grad and
    # inference mode), 2 in inference mode (serves inference mode only)
    if torch.is_inference_mode_enabled():
        return 2
    return 0 if weight.requires_grad and torch.is_grad_enabled() else 1


def _make_twin_class(loaded: _Loaded) -> type:
    float8_linear = loaded.Float8Linear
    cast_weight, matmul = loaded.cast_weight, loaded.matmul

    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        mode = _mode(weight)
        if mode == 0 or is_compiling():  # training, or traced: torchao's own forward
            out: torch.Tensor = float8_linear.forward(self, input)
            return out
        key = (weight._version, weight.data_ptr(), steps_taken())
        hit = self.__dict__.get(_CAST)
        if hit is not None and hit[0] == key and hit[1] <= mode:
            weight_t = hit[2]
        else:
            weight_t = cast_weight(self, weight.t())
            self.__dict__[_CAST] = (key, mode, weight_t)
        # Float8Linear's forward, with the weight operand cast beforehand
        if torch.is_autocast_enabled():
            input = input.to(torch.get_autocast_gpu_dtype())
        output: torch.Tensor = matmul.apply(input, weight_t, self.linear_mm_config, self.config)
        bias = self._parameters.get("bias")
        if bias is not None:
            output = output + bias.to(output.dtype)
        return output

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # pickled (torch.save(model), copy.deepcopy) as the nn.Linear it stands for
        # (through the standard library's reconstructor: loading it needs neither a twin
        # class, torchao nor speedflags)
        cls = self.__dict__["_speedflags_of"]
        state = {k: v for k, v in self.__dict__.items() if k not in self._speedflags_own}
        return (copyreg._reconstructor, (cls, object, None), state)  # type: ignore[attr-defined]

    forward.__doc__ = float8_linear.forward.__doc__
    return type(
        "Float8Linear",
        (float8_linear,),
        {
            "__module__": float8_linear.__module__,
            "__doc__": float8_linear.__doc__,
            "_speedflags_fp8_twin": True,
            "forward": forward,
            "__reduce_ex__": __reduce_ex__,
        },
    )
