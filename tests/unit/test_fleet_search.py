"""The fleet search and profiles the planner bench compares against (the bench itself is run by hand:
docs/planner.md)."""

from __future__ import annotations

from kvmesh.replay.fleet_search import Fleet, planned, profile_of, smallest_reaching


def test_the_search_finds_the_smallest_size_reaching_the_goal_or_none():
    asked: list[int] = []

    def reaches(n: int) -> bool:
        asked.append(n)
        return n >= 7

    assert smallest_reaching(reaches, 1, 24) == 7
    assert len(set(asked)) <= 6  # a bisection, not a sweep
    assert smallest_reaching(lambda n: False, 1, 24) is None
    assert smallest_reaching(lambda n: True, 1, 24) == 1


def test_profiles_start_in_the_trough_or_at_the_crest():
    assert profile_of("trough", 1000, 0.9) == "sine:period=1000,amplitude=0.9,phase=750"
    assert profile_of("crest", 1000, 0.9) == "sine:period=1000,amplitude=0.9,phase=250"


def test_a_planner_is_capped_at_its_fleet_and_starts_there_unless_told():
    options = planned(Fleet(2, 5), start=0, sizing="queue", interval=15.0, startup=15.0)
    assert (options["max_prefill_workers"], options["max_workers"]) == (2, 5)
    assert (options["prefill_workers"], options["workers"]) == (2, 5)
    small = planned(Fleet(0, 5), start=1, sizing="dynamo", interval=15.0, startup=15.0)
    assert small["workers"] == 1 and "max_prefill_workers" not in small and small["sizing"] == "dynamo"
