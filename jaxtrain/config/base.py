"""What every config section and every model family's config builds on: the strict section base,
the mesh axis and sink names, and the ``model:`` base classes. Family config classes
(``models/<family>/config.py``) import from here, so they never import the whole schema
(``jaxtrain.config.schema``), which asks the family registry for them."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator

from jaxtrain.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the schema imports this module
    from jaxtrain.config.schema import Config

MESH_AXES = ("data", "fsdp", "tensor", "sequence", "expert", "stage")
SINKS = ("console", "jsonl", "tensorboard", "mlflow", "wandb")  # metrics.sinks (jaxtrain.metrics.sinks)
DEFAULT_FAMILY = "llama"



def implementation_key(op: str, field: str):
    """A 'before' validator of ``field``, a kernel key of op ``op`` (``model.attention``, ...): its value
    is ``auto`` or an implementation the kernel registry lists (``jaxtrain.kernels.registry``; a provider
    another package registers adds its own)."""
    def check(cls, value):
        if isinstance(value, str):
            from jaxtrain.kernels import registry
            if not registry.known(op, value):
                known = ", ".join(registry.names(op))
                raise ConfigError(f"{registry.KEYS[op]}: unknown implementation '{value}' (known: {known})")
        return value
    return field_validator(field, mode="before")(classmethod(check))


class Section(BaseModel):
    # strict: no bool -> int or 2.5 -> int coercion (ints are still accepted for floats). No float key
    # takes NaN or an infinity: a timeout of .nan passed validation and then made every SIGTERM exit at
    # once, or a join die converting it to an int (a limit of "none" is null where a key allows it).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)



class ModelConfig(Section):
    """Base of every ``model:`` section; a family's config class subclasses it.

    A subclass fixes ``family`` to its name with a ``Literal``, adds its hyper-parameters,
    and may override :meth:`check` and :meth:`check_against_mesh` (raising ConfigError
    naming ``model.<key>``). ``layout_keys`` are its fields that fix parameter shapes,
    dtypes or layout: they are named when a checkpoint no longer fits the config.
    """

    family: str = DEFAULT_FAMILY
    layout_keys: ClassVar[tuple[str, ...]] = ()

    def check(self, cfg: "Config") -> None:
        """Value checks that need no devices (run whenever a Config is validated)."""

    def check_against_mesh(self, cfg: "Config", axis_sizes: dict[str, int], platform: Optional[str]) -> None:
        """Checks against the resolved mesh axis sizes and the devices' platform, before compiling."""


class CustomModelConfig(ModelConfig):
    """``model.family: custom``: the model is built in Python and given to ``jaxtrain.fit``.

    ``options`` holds that model's own hyper-parameters (recorded in the run directory,
    overridable as ``model.options.<name>=value``); their meaning is the caller's.
    """

    family: Literal["custom"] = "custom"
    options: dict[str, Union[bool, int, float, str]] = {}
