"""The error hierarchy and its wire form (trailing metadata naming the class, fields as JSON)."""

from __future__ import annotations

import json
import re

import pytest

from gradstar import errors
from gradstar.errors import (
    ERROR_FIELDS_KEY,
    ERROR_NAME_KEY,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GradstarError,
    ProtocolError,
    RankLostError,
    error_from_wire,
    error_metadata,
)

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]

# One instance of every class, with non-default fields where the class has any.
EXAMPLES: dict[str, GradstarError] = {
    "CollectiveMismatchError": CollectiveMismatchError(
        "rank 2 called all_reduce(float32) but rank 0 called all_reduce(float64)",
        rank=2, field="dtype"),
    "CollectiveTimeoutError": CollectiveTimeoutError(
        "ranks 1 and 3 never reached all_reduce seq 7", missing_ranks=[1, 3]),
    "RankLostError": RankLostError(
        "rank 4 of job 'j' was lost (session closed)", rank=4, generation=6),
}


def example(cls: type[GradstarError]) -> GradstarError:
    return EXAMPLES.get(cls.__name__) or cls(f"a {cls.__name__} happened.")


def round_trip(error: GradstarError) -> GradstarError:
    metadata = dict(error_metadata(error))
    return error_from_wire(metadata[ERROR_NAME_KEY], metadata[ERROR_FIELDS_KEY], str(error))


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_exported_error_is_a_gradstar_error(cls):
    assert issubclass(cls, GradstarError)
    assert cls.__doc__, f"{cls.__name__} needs a one-line docstring"


def test_every_gradstar_error_in_the_module_is_exported():
    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, GradstarError)}

    assert defined == set(errors.__all__)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_error_round_trips_type_message_and_fields(cls):
    original = example(cls)

    rebuilt = round_trip(original)

    assert type(rebuilt) is cls
    assert str(rebuilt) == str(original)
    assert rebuilt.fields() == original.fields()


def test_metadata_names_the_class_and_carries_fields_as_json():
    metadata = dict(error_metadata(EXAMPLES["RankLostError"]))

    assert metadata[ERROR_NAME_KEY] == "RankLostError"
    assert json.loads(metadata[ERROR_FIELDS_KEY]) == {"rank": 4, "generation": 6}


def test_rank_lost_error_fields_survive_the_wire():
    rebuilt = round_trip(EXAMPLES["RankLostError"])

    assert (rebuilt.rank, rebuilt.generation) == (4, 6)


def test_collective_mismatch_error_fields_survive_the_wire():
    rebuilt = round_trip(EXAMPLES["CollectiveMismatchError"])

    assert (rebuilt.rank, rebuilt.field) == (2, "dtype")


def test_collective_timeout_error_missing_ranks_survive_the_wire():
    rebuilt = round_trip(EXAMPLES["CollectiveTimeoutError"])

    assert rebuilt.missing_ranks == [1, 3]


def test_errors_without_fields_send_an_empty_json_object():
    assert dict(error_metadata(ProtocolError("bad frame")))[ERROR_FIELDS_KEY] == "{}"


@pytest.mark.parametrize("name", ["NoSuchError", "", None, "ValueError", "json", "Sequence"])
def test_an_unknown_error_name_becomes_a_plain_gradstar_error(name):
    rebuilt = error_from_wire(name, '{"rank": 1}', "something failed on the hub.")

    assert type(rebuilt) is GradstarError
    assert str(rebuilt) == "something failed on the hub."


@pytest.mark.parametrize("fields_json", [None, "", "not json", "[1, 2]", "3", "null",
                                         '{"unexpected": 1}'])
def test_unusable_fields_still_rebuild_the_named_class(fields_json):
    rebuilt = error_from_wire("RankLostError", fields_json, "rank 1 was lost.")

    assert type(rebuilt) is RankLostError
    assert str(rebuilt) == "rank 1 was lost."
    assert (rebuilt.rank, rebuilt.generation) == (-1, 0)


@pytest.mark.parametrize("name", ["ConfigurationError", "InvalidCollectiveError"])
def test_argument_errors_are_also_value_errors(name):
    assert issubclass(getattr(errors, name), ValueError)


def docstring_tree() -> dict[str, str | None]:
    """{class name: parent name} read from the tree drawn in the module docstring."""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []  # (column of the name, name)
    for line in errors.__doc__.splitlines():
        match = re.match(r"^([ │├└─]*)([A-Z]\w*Error)\b", line)
        if match is None:
            continue
        column, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((column, name))
    return parents


@pytest.mark.parametrize("name", errors.__all__)
def test_module_docstring_tree_mentions_every_exported_class(name):
    assert name in docstring_tree()


@pytest.mark.parametrize("name", errors.__all__)
def test_module_docstring_tree_matches_the_class_hierarchy(name):
    parent = docstring_tree()[name]
    cls = getattr(errors, name)

    if parent is None:
        assert cls is GradstarError
    else:
        assert getattr(errors, parent) in cls.__bases__
