"""wire/floor.py: the pace both ends of a bulk body hold it to, on a clock the test moves."""

from __future__ import annotations

import pytest

from wire.floor import FLOOR_BYTES, Floor, pace


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_window_closes_unless_a_floors_worth_moves_in_it() -> None:
    clock = Clock()
    floor = Floor(10 * FLOOR_BYTES, 60.0, clock)
    assert floor.left() == 60.0
    clock.now += 50
    floor.got(FLOOR_BYTES - 1)  # a byte short: the window it opened with still runs
    assert floor.left() == pytest.approx(10.0)
    clock.now += 5
    floor.got(1)  # the floor reached: the next window opens now
    assert floor.left() == pytest.approx(60.0)
    clock.now += 61
    assert floor.left() < 0


def test_the_next_window_counts_from_what_had_moved_when_it_opened() -> None:
    clock = Clock()
    floor = Floor(10 * FLOOR_BYTES, 60.0, clock)
    floor.got(FLOOR_BYTES + FLOOR_BYTES // 2)  # one and a half floors at once: one window opened
    clock.now += 30
    floor.got(FLOOR_BYTES - 1)  # under a floor since that window opened
    assert floor.left() == pytest.approx(30.0)
    floor.got(1)
    assert floor.left() == pytest.approx(60.0)


def test_a_body_shorter_than_the_floor_is_held_to_its_own_length() -> None:
    clock = Clock()
    floor = Floor(100, 60.0, clock)
    clock.now += 59
    floor.got(99)
    assert floor.left() == pytest.approx(1.0)
    floor.got(1)
    assert floor.left() == pytest.approx(60.0)


def test_a_pause_is_not_the_peers_time() -> None:
    clock = Clock()
    floor = Floor(10 * FLOOR_BYTES, 60.0, clock)
    clock.now += 40
    floor.pause(40)  # 40 s waiting on something else (a forwarded file's upstream)
    assert floor.left() == pytest.approx(60.0)


def test_the_floor_in_words() -> None:
    assert pace(60.0) == f"under {FLOOR_BYTES >> 20} MiB in 60 s"
    assert pace(0.5) == f"under {FLOOR_BYTES >> 20} MiB in 0.5 s"
