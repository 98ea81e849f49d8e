"""Every benchmark workload builds the conversations it is asked for."""

from __future__ import annotations

import pytest

from verispec.workloads import WORKLOADS, build_workload


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_workload_builds_n_user_turns(name):
    convs = build_workload(name, 5)
    assert len(convs) == 5
    assert all(c and c[0]["role"] == "user" and c[0]["content"] for c in convs)


def test_an_unknown_workload_names_the_allowed_ones():
    with pytest.raises(ValueError, match="json-records"):
        build_workload("nope", 1)
