"""Parameter-group rules: parsing, matching by glob and role, last match wins, one-line errors."""

from __future__ import annotations

import pytest

from bnfuse.errors import BnfuseError
from bnfuse.passes.training.groups import GroupRule, Hyper, describe, parse_rule, resolve

PARAMS = ["conv.weight", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
RANKS = {"conv.weight": 4, "bn.weight": 1, "bn.bias": 1, "fc.weight": 2, "fc.bias": 1}


def _resolve(rules: list[GroupRule], decay: float = 0.1) -> dict[str, Hyper]:
    return resolve(PARAMS, rules, decay, bn_parameters={"bn.weight", "bn.bias"}, ranks=RANKS)


def test_rules_by_glob_and_role_last_match_wins() -> None:
    hypers = _resolve([GroupRule("@1d", weight_decay=0.0), GroupRule("fc.*", weight_decay=0.5, lr_scale=2.0)])
    assert hypers == {
        "conv.weight": Hyper(0.1),
        "bn.weight": Hyper(0.0),
        "bn.bias": Hyper(0.0),
        "fc.weight": Hyper(0.5, 2.0),
        "fc.bias": Hyper(0.5, 2.0),
    }
    assert describe(hypers) == "0.5 on 2 tensors, 0.1 on 1 tensors, 0 on 2 tensors; lr x2 on 2 tensors"
    only_bn = _resolve([GroupRule("@bn", lr_scale=0.5)])
    assert {n for n, h in only_bn.items() if h.lr_scale == 0.5} == {"bn.weight", "bn.bias"}
    assert describe(_resolve([])) == "0.1 on 5 tensors"


def test_parse_rule() -> None:
    assert parse_rule("a=b=0.5", "weight_decay") == GroupRule("a=b", weight_decay=0.5)  # the last '=' splits
    assert parse_rule("*.bias=2", "lr_scale") == GroupRule("*.bias", lr_scale=2.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: parse_rule("fc", "lr_scale"), "PATTERN=VALUE"),
        (lambda: parse_rule("=1", "lr_scale"), "PATTERN=VALUE"),
        (lambda: parse_rule("fc=x", "lr_scale"), "PATTERN=VALUE"),
        (lambda: GroupRule("@convs"), "unknown parameter role"),
        (lambda: GroupRule("*", weight_decay=-1.0), "weight decay"),
        (lambda: GroupRule("*", lr_scale=float("nan")), "learning-rate multiplier"),
        (lambda: _resolve([GroupRule("nothing*", lr_scale=2.0)]), "matches no trainable parameter"),
    ],
)
def test_bad_rules_are_one_line_errors(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(BnfuseError, match=message):
        make()
