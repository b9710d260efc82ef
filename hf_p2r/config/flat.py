"""`TrainArguments`: every section but the model's and the data's as one flat object, for code written before the
configuration had sections. Plain Python."""

from typing import Any

from .fields import assign, build
from .rules import check_sections
from .sections import SECTION_OF, SECTIONS, LearningRateSchedule

# The sections `TrainArguments` holds: all but the model's and the data's.
TRAIN_SECTIONS = tuple(name for name in SECTIONS if name not in ("model", "data"))


class TrainArguments:
    """Every field of the sections but the model's and the data's, as one flat object: the trainer's configuration as
    it was before it had sections, for code and tests written against it (`TrainArguments(optimizer="muon")`,
    `config.train.total_steps`). A field is read from and written to its section (`TrainConfig.train` is a view of the
    configuration's own sections); so are the sections' derived values, and the learning-rate schedule's. New code
    takes the section it needs.

    Built from flat values, it checks each field and the rules among its sections (`hf_p2r.config.rules`)."""

    def __init__(self, **values):
        kinds = {SECTIONS[name]: name for name in TRAIN_SECTIONS}
        if unknown := sorted(key for key in values if SECTION_OF.get(key) not in kinds):
            raise TypeError(f"TrainArguments got unexpected keyword arguments {', '.join(unknown)}")
        given = {name: {} for name in TRAIN_SECTIONS}
        for key, value in values.items():
            given[kinds[SECTION_OF[key]]][key] = value
        parts = {name: build(SECTIONS[name], given[name]) for name in TRAIN_SECTIONS}
        object.__setattr__(self, "_sections", parts)
        check_sections(parts)

    @classmethod
    def of(cls, parts: dict[str, Any]) -> "TrainArguments":
        """The flat view of `parts` ({section name: section}), unchecked."""
        view = object.__new__(cls)
        object.__setattr__(view, "_sections", parts)
        return view

    def __getattr__(self, name: str):
        parts = self.__dict__.get("_sections", {})
        for part in parts.values():
            if name in type(part).__dataclass_fields__ or hasattr(type(part), name):
                return getattr(part, name)
        if name in LearningRateSchedule.__dataclass_fields__ and {"optim", "schedule", "stages"} <= parts.keys():
            return getattr(LearningRateSchedule.of(parts["optim"], parts["schedule"], parts["stages"]), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        for part in self._sections.values():
            if name in type(part).__dataclass_fields__:
                assign(part, name, value)
                return
        raise AttributeError(f"{type(self).__name__!r} has no field {name!r}")

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainArguments) and self._sections == other._sections

    def __repr__(self) -> str:
        return f"TrainArguments({', '.join(repr(part) for part in self._sections.values())})"
