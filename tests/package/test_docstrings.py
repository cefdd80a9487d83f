"""Every public class of stoker, and every public method, classmethod, staticmethod and property that a stoker
class defines, says in a docstring what it does and what it promises.

Members are looked up along each class's MRO and checked where they are defined: what object, the dataclass
machinery or transformers define is not stoker's to document, and an override needs its own docstring (the
base class's describes the event or the contract, not what the override does). Dataclass fields and other
plain class attributes are not members to document, and the signature @dataclass writes into a class without a
docstring does not count as one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import stoker
from stoker import callbacks


def public_classes() -> list[type]:
    """The classes exported by `stoker.__all__`, and the callback types every callback sees."""
    exported = [getattr(stoker, name) for name in stoker.__all__]
    extra = [callbacks.TrainerCallback, callbacks.TrainerState, callbacks.TrainerControl]
    return list(dict.fromkeys(c for c in [*exported, *extra] if inspect.isclass(c)))


def _is_stoker(owner: type) -> bool:
    return owner.__module__ == "stoker" or owner.__module__.startswith("stoker.")


def _has_docstring(obj) -> bool:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return False  # the signature @dataclass fills in, not a docstring
    return bool(doc)


def _documented_object(member):
    """What carries the docstring of a class-body member, or None when the member is not one to document (a
    dataclass field's default, a constant)."""
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    if isinstance(member, (property, functools.cached_property)):
        return member
    if callable(member):
        return member
    return None


def missing_docstrings() -> list[str]:
    """'module.Class.member' for every public class or member defined in stoker without a docstring."""
    missing: list[str] = []
    owners = [owner for cls in public_classes() for owner in inspect.getmro(cls) if _is_stoker(owner)]
    for owner in dict.fromkeys(owners):  # each stoker class once, wherever it appears in an MRO
        if not _has_docstring(owner):
            missing.append(f"{owner.__module__}.{owner.__qualname__}")
        for name, member in vars(owner).items():  # what this class itself defines
            if not name.startswith("_"):
                target = _documented_object(member)
                if target is not None and not _has_docstring(target):
                    missing.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return sorted(missing)


def test_public_classes_are_found():
    names = {c.__name__ for c in public_classes()}
    assert {"Trainer", "TrainingArguments", "Seq2SeqTrainer", "TrainerCallback", "TrainerState"} <= names


def test_checker_sees_members_along_the_mro():
    # TransformersSurface's methods reach Trainer through its MRO; the check must look at them, not only Trainer's own.
    owners = {owner for cls in public_classes() for owner in inspect.getmro(cls) if _is_stoker(owner)}
    assert any(owner.__name__ == "TransformersSurface" for owner in owners)


def test_checker_sees_a_dataclass_without_docstring():
    @dataclasses.dataclass
    class Undocumented:
        x: int = 0

    @dataclasses.dataclass
    class Documented:
        """Says what it is."""

        x: int = 0

    assert not _has_docstring(Undocumented) and _has_docstring(Documented)


def test_every_public_class_and_member_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, f"{len(missing)} public classes / members without a docstring:\n  " + "\n  ".join(missing)


if __name__ == "__main__":
    print("\n".join(missing_docstrings()))
