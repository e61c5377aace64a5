"""The queueing arithmetic against closed forms: M/M/1 waits with probability rho, M/M/2 at load 1
with 1/3; a pooled queue waits less than one replica alone at the same load."""

from __future__ import annotations

import math

import pytest

from planner.queueing import erlang_c, pooled_wait_share, wait_tail


@pytest.mark.parametrize("rho", [0.1, 0.5, 0.9])
def test_one_server_waits_with_probability_rho(rho):
    assert erlang_c(1, rho) == pytest.approx(rho)


def test_two_servers_at_load_one_wait_a_third_of_the_time():
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)


def test_the_wait_tail_of_one_replica_is_rho_times_the_exponential_decay():
    assert wait_tail(0.5, 1.0, 0.0) == pytest.approx(0.5)
    assert wait_tail(0.5, 1.0, 2.0) == pytest.approx(0.5 * math.exp(-1.0))


def test_replicas_sharing_a_queue_wait_less_than_one_alone_at_the_same_load():
    shares = [pooled_wait_share(0.8, n) for n in (1, 2, 4, 8)]
    assert shares[0] == pytest.approx(0.8 / 0.2)  # M/M/1: rho / (1 - rho)
    assert shares == sorted(shares, reverse=True)
