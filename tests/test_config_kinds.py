"""One typing rule for every config key, and one line per mistaken key.

Text is never a number or a boolean, a number never a boolean, a boolean never a number (YAML's
true / false are the booleans, `zero_memory: off` stays the word it means); a union-typed key
that takes nothing of what it was given says so in one line; the hint of a refused master dtype
names dtypes that are accepted."""

from __future__ import annotations

import re
import types
import typing

import pytest

from portapipe.config import Config, ConfigError, load_config

from .test_attacks_input import EXAMPLE, cli, no_ranks, train  # noqa: F401  (no_ranks: a fixture)


def _problems(raw: dict | None = None, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw if raw is not None else EXAMPLE, overrides)
    return info.value.problems


def _alternatives(annotation: typing.Any) -> tuple[typing.Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _kinds(annotation: typing.Any) -> set[str]:
    """number / bool / text / words (Literal strings) / list / other (a mapping): what a key's type takes."""
    out: set[str] = set()
    for a in _alternatives(annotation):
        if a is bool:
            out.add("bool")
        elif a in (int, float):
            out.add("number")
        elif a is str:
            out.add("text")
        elif typing.get_origin(a) is typing.Literal:
            out |= {"words" if isinstance(c, str) else "number" for c in typing.get_args(a)}
        elif typing.get_origin(a) is tuple:
            out |= {"list"} | set().union(*(_kinds(x) for x in typing.get_args(a)))
        else:
            out.add("other")
    return out


def _keys() -> list[tuple[str, typing.Any]]:
    """(section.key, its type) of every key of every section."""
    out = []
    for section, field in Config.model_fields.items():
        for key, sub in getattr(field.annotation, "model_fields", {}).items():
            out.append((f"{section}.{key}", sub.annotation))
    return out


# ------------------------------------------------------------------------ B12: the typing rule
@pytest.mark.parametrize(
    "setting, line",
    [
        ('schedule.overlap="yes"', "schedule.overlap: 'yes': text is not a boolean; give true or false without quotes"),
        ('log.tensorboard="true"', "log.tensorboard: 'true': text is not a boolean; give true or false without quotes"),
        ("balancer.stay_off=1", "balancer.stay_off: 1: a number is not a boolean; give true or false"),
        ("train.overlap_grad_sync=0", "train.overlap_grad_sync: 0: a number is not a boolean; give true or false"),
        ('train.grad_bucket_mb="5"', "train.grad_bucket_mb: '5': text is not a number; give a number without quotes"),
        ("parallel.pp='2'", "parallel.pp: '2': text is not a number; give an integer without quotes"),
        ('train.zero_stage="1"', "train.zero_stage: '1': text is not a number; give 0, 1 or 2 without quotes"),
        ("train.betas=['0.9', 0.95]", "train.betas: ['0.9', 0.95]: text is not a number; give a list of 2 numbers without quotes"),
    ],
)
def test_text_for_a_number_or_a_boolean_and_a_number_for_a_boolean_exit_2(tmp_path, capsys, no_ranks, setting, line) -> None:
    code, lines = cli(capsys, *train(tmp_path, setting))
    assert code == 2 and lines == [f"portapipe: config error: {line}"], lines


def test_every_number_and_boolean_key_refuses_text_and_every_boolean_key_numbers() -> None:
    """The rule holds for every key, not for a list of them: a key added later is covered."""
    checked = 0
    for key, annotation in _keys():
        kinds = _kinds(annotation)
        if "other" in kinds:
            continue
        section, name = key.split(".")
        numbers = "number" in kinds
        if numbers or "bool" in kinds:
            for v in [["1", "1"]] if "list" in kinds else ["1", "true"]:
                lines = _problems({section: {name: v}})
                assert re.match(rf"{re.escape(f'{key}: {v!r}: ')}(text is not a |expected )", lines[0]), (key, lines)
                checked += 1
        if "bool" in kinds and not numbers:  # a boolean key, with its own words beside (launch.pin_cores: auto)
            words = " or ".join(["true or false", *(str(c) for a in _alternatives(annotation) if typing.get_origin(a) is typing.Literal
                                                    for c in typing.get_args(a))])
            assert _problems({section: {name: 1}})[0] == f"{key}: 1: a number is not a boolean; give {words}"
    assert checked > 40


def test_what_the_rule_keeps_working(tmp_path) -> None:
    """A bare --set value is YAML (2 is a number, true a boolean), YAML 1.1's yes / off keep their
    meaning, a float without a dot is a number (YAML 1.2's reading), a key's own word is text it takes."""
    c = load_config(EXAMPLE, ["parallel.pp=2", "log.tensorboard=false", "schedule.overlap=yes", "memory.zero_memory=off",
                              "train.lr=1e-2", "train.min_lr=1E-4", "balancer.min_gain=auto", "train.grad_bucket_mb=5"])
    assert c.parallel.pp == 2 and c.log.tensorboard is False and c.schedule.overlap is True and c.memory.zero_memory == "off"
    assert c.train.lr == 0.01 and c.train.min_lr == 1e-4 and c.balancer.min_gain == "auto" and c.train.grad_bucket_mb == 5.0
    path = tmp_path / "c.yaml"
    path.write_text(EXAMPLE.read_text().replace("  lr: 5.0e-3", "  lr: 2e-3"))
    assert load_config(path).train.lr == 2e-3


# ------------------------------------------------------------------ B10: one line for a union key
def test_a_word_a_union_key_does_not_take_is_one_line_saying_what_it_takes(tmp_path, capsys, no_ranks) -> None:
    code, lines = cli(capsys, *train(tmp_path, "balancer.min_gain=autox"))
    assert code == 2 and lines == ["portapipe: config error: balancer.min_gain: 'autox': expected a number or auto"], lines


def test_every_union_key_refused_by_each_of_its_types_gives_one_line_without_internal_names() -> None:
    unions = [(key, a) for key, a in _keys() if len(_alternatives(a)) > 1]
    assert "balancer.min_gain" in [k for k, _ in unions]
    for key, annotation in unions:
        section, name = key.split(".")
        for value in ([[1]], {"a": 1}, "x y"):
            lines = _problems({section: {name: value}})
            assert len(lines) == 1 and lines[0].startswith(f"{key}: "), (key, lines)
            assert not re.search(r"\.(float|int|literal\[|none)|Input should", lines[0]), lines


def test_a_union_key_refused_still_lets_the_other_mistakes_be_said() -> None:
    """The other keys are checked again with the refused one at its default (pydantic's path of a
    union's alternative named no key, so the refused value stayed and every other line was lost)."""
    lines = _problems(overrides=["balancer.min_gain=autox", "schedule.chunks=3"])
    assert lines[0] == "balancer.min_gain: 'autox': expected a number or auto"
    assert [line.split(":")[0] for line in lines] == ["balancer.min_gain", "schedule.chunks"], lines


# ------------------------------------------------------------- B11: the hint names what is taken
@pytest.mark.parametrize(
    "model, master", [("float64", "float32"), ("float64", "bfloat16"), ("float32", "float16"), ("bfloat16", "float16"), ("float16", "bfloat16")]
)
def test_a_refused_master_dtype_hints_only_at_dtypes_that_are_accepted(model: str, master: str) -> None:
    lines = _problems({"model": {"dtype": model}, "train": {"master_dtype": master}})
    assert len(lines) == 1 and lines[0].startswith(f"train.master_dtype: {master} is less precise than model.dtype {model}; use "), lines
    hinted = re.split(r", | or ", lines[0].split("; use ", 1)[1])
    assert master not in hinted and "auto" in hinted, hinted
    # the model's own dtype holds it, except float16, whose master weights cannot hold AdamW's state
    assert (model in hinted) == (model != "float16"), hinted
    for dtype in hinted:
        load_config({"model": {"dtype": model}, "train": {"master_dtype": dtype}})  # each one is accepted
