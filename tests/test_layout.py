"""Load-balanced sequence layouts (cp_compile.sequence).

Three parts:
- pure: ``rank_positions`` / ``check_seq_len`` for every world size 1..8 and layout;
- no process group (the pytest process never initialises one): the single-rank case;
- real gloo groups of 2 and 4 processes (the ``ranks`` fixture from tests/conftest.py):
  ``shard`` / ``unshard`` / ``positions`` and the gradient through ``unshard``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_compile.sequence import (
    check_seq_len,
    positions,
    rank_positions,
    shard,
    split_multiple,
    unshard,
)

LOAD_BALANCES = ("zigzag", "striped", "contiguous")


def multiple_of(n: int, lb: str) -> int:
    """What S must divide by: 2N for zigzag (two chunks per rank), N otherwise; 1 on one rank."""
    if n == 1:
        return 1
    return 2 * n if lb == "zigzag" else n


@st.composite
def layouts(draw):
    """(N, lb, S) with S a valid sequence length for the layout."""
    lb = draw(st.sampled_from(LOAD_BALANCES))
    n = draw(st.integers(1, 8))
    k = draw(st.integers(1, 6))
    return n, lb, multiple_of(n, lb) * k


@st.composite
def bad_layouts(draw):
    """(N, lb, S) with S a positive length the layout cannot split."""
    lb = draw(st.sampled_from(LOAD_BALANCES))
    n = draw(st.integers(2, 8))  # N=1 splits every S
    m = multiple_of(n, lb)
    k = draw(st.integers(0, 5))
    r = draw(st.integers(1, m - 1))
    return n, lb, m * k + r


def assert_names_multiple(message: str, m: int) -> None:
    assert re.search(rf"(?<!\d){m}(?!\d)", message), f"required multiple {m} not named in: {message!r}"


# ====================================================================== pure


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(layouts())
def test_rank_positions_partition_the_sequence(cfg):
    n, lb, s = cfg
    c = s // n
    owned = []
    for r in range(n):
        pos = rank_positions(s, n, r, lb)
        assert pos.dtype == torch.int64
        assert pos.shape == (c,), (n, lb, s, r, pos)
        # strictly increasing: each block lists its tokens in global order
        assert bool((pos[1:] > pos[:-1]).all()), (n, lb, s, r, pos)
        owned.append(pos)
    # every position owned by exactly one rank
    assert torch.equal(torch.cat(owned).sort().values, torch.arange(s)), (n, lb, s)


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_rank_positions_match_the_layout_definition(cfg):
    n, lb, s = cfg
    c = s // n
    for r in range(n):
        pos = rank_positions(s, n, r, lb).tolist()
        if n == 1:
            expected = list(range(s))  # one rank holds the whole sequence, any layout
        elif lb == "zigzag":
            h = s // (2 * n)  # 2N chunks of h tokens; rank r holds chunks r and 2N-1-r
            expected = list(range(r * h, (r + 1) * h)) + list(range((2 * n - 1 - r) * h, (2 * n - r) * h))
        elif lb == "striped":
            expected = list(range(r, s, n))  # r, r+N, r+2N, ...
        else:
            expected = list(range(r * c, (r + 1) * c))
        assert pos == expected, (n, lb, s, r)


@pytest.mark.parametrize("lb", LOAD_BALANCES)
def test_split_multiple(lb):
    for n in range(1, 9):
        assert split_multiple(n, lb) == multiple_of(n, lb)


@settings(max_examples=120, deadline=None)
@given(bad_layouts())
def test_unsplittable_seq_len_names_the_multiple(cfg):
    n, lb, s = cfg
    m = multiple_of(n, lb)
    with pytest.raises(ValueError) as err:
        check_seq_len(s, n, lb)
    assert_names_multiple(str(err.value), m)
    with pytest.raises(ValueError) as err:
        rank_positions(s, n, 0, lb)
    assert_names_multiple(str(err.value), m)


@pytest.mark.parametrize("lb", LOAD_BALANCES)
@pytest.mark.parametrize("s", [0, -4])
def test_non_positive_seq_len_raises(lb, s):
    with pytest.raises(ValueError) as err:
        check_seq_len(s, 2, lb)
    assert_names_multiple(str(err.value), multiple_of(2, lb))


@pytest.mark.parametrize("lb", LOAD_BALANCES)
@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_rank_out_of_range_raises(lb, rank):
    with pytest.raises(ValueError, match="rank"):
        rank_positions(16, 4, rank, lb)


@pytest.mark.parametrize("bad", ["zig-zag", "ZIGZAG", "ring", "", None])
def test_unknown_load_balance_lists_valid_names(bad):
    calls = [
        lambda: check_seq_len(8, 2, bad),
        lambda: rank_positions(8, 2, 0, bad),
        lambda: split_multiple(2, bad),
        lambda: positions(8, load_balance=bad),
        lambda: shard(torch.zeros(8), 0, load_balance=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        for name in LOAD_BALANCES:
            assert name in msg, f"{name!r} not listed in {msg!r}"


# ====================================================================== no process group


@pytest.fixture
def no_group():
    assert not (dist.is_available() and dist.is_initialized()), "the pytest process must not initialise a group"


@pytest.mark.parametrize("lb", LOAD_BALANCES)
def test_single_process_is_identity(no_group, lb):
    for s in (2, 6, 10):
        assert torch.equal(positions(s, load_balance=lb), torch.arange(s))
    assert torch.equal(positions(8), torch.arange(8))  # default layout (zigzag)
    g = torch.Generator().manual_seed(0)
    for shape, dim in [((2, 6, 3), 1), ((2, 3, 6, 4), 2), ((2, 6, 5), -2), ((6,), 0), ((6,), -1)]:
        x = torch.randn(*shape, generator=g)
        xs = shard(x, dim, load_balance=lb)
        assert torch.equal(xs, x)
        assert torch.equal(unshard(xs, dim, load_balance=lb), x)
        assert torch.equal(unshard(x, dim, load_balance=lb), x)
    # defaults
    x = torch.randn(2, 4, 3, generator=g)
    assert torch.equal(shard(x, 1), x)
    assert torch.equal(unshard(x, 1), x)


def test_single_process_gradients_pass_through(no_group):
    x = torch.randn(2, 6, 3, requires_grad=True)
    w = torch.randn(2, 6, 3)
    (unshard(shard(x, 1), 1) * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_single_process_bad_dim_raises(no_group):
    x = torch.zeros(2, 6)
    with pytest.raises(IndexError):
        shard(x, 2)
    with pytest.raises(IndexError):
        unshard(x, -3)


@pytest.mark.parametrize("group", [object(), "cp", 0])
def test_explicit_group_without_init_raises(no_group, group):
    x = torch.zeros(2, 8, 3)
    for call in (
        lambda: shard(x, 1, group=group),
        lambda: unshard(x, 1, group=group),
        lambda: positions(8, group=group),
    ):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()


# ====================================================================== real process groups
#
# Rank functions are module level (they are pickled to the workers) and return plain
# picklable results; all assertions happen in the parent so a failure reports clearly.


def _seq_len(world_size: int, lb: str) -> int:
    # an odd number of tokens per rank (or per zigzag chunk) where the layout allows it
    return multiple_of(world_size, lb) * 3


def _cases(s: int):
    """(name, shape, dim) with the sequence axis of length s at ``dim``."""
    return [
        ("BSD dim=1", (2, s, 3), 1),
        ("BHSD dim=2", (2, 3, s, 4), 2),
        ("BSD dim=-2", (2, s, 5), -2),
        ("SD dim=0", (s, 4), 0),
        ("S dim=-1", (s,), -1),
    ]


def _shard_unshard_rank_fn():
    """Every shard / unshard / positions / gradient check for one world, in one run."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world_size": n, "layouts": {}, "errors": {}}
    for lb in LOAD_BALANCES:
        s = _seq_len(n, lb)
        res = {"s": s}
        pos = positions(s, load_balance=lb)
        res["positions"] = pos.tolist()
        res["positions_explicit_world"] = positions(s, group=dist.group.WORLD, load_balance=lb).tolist()
        res["rank_positions"] = rank_positions(s, n, rank, lb).tolist()
        checks = {}
        g = torch.Generator().manual_seed(1234)  # same full tensors on every rank
        for name, shape, dim in _cases(s):
            x = torch.randn(*shape, generator=g)
            xs = shard(x, dim, load_balance=lb)
            expected_shard = x.index_select(dim % x.dim(), pos)
            xu = unshard(xs, dim, load_balance=lb)
            checks[name] = {
                "shard_shape": tuple(xs.shape),
                "shard_ok": torch.equal(xs, expected_shard),
                "unshard_ok": torch.equal(xu, x),
                "unshard_explicit_group_ok": torch.equal(
                    unshard(shard(x, dim, group=dist.group.WORLD, load_balance=lb), dim,
                            group=dist.group.WORLD, load_balance=lb),
                    x,
                ),
            }
        # non-float and non-contiguous inputs round-trip too
        xi = torch.randint(-1000, 1000, (3, s), generator=g)
        checks["int64 dim=1"] = {
            "shard_ok": torch.equal(shard(xi, 1, load_balance=lb), xi.index_select(1, pos)),
            "unshard_ok": torch.equal(unshard(shard(xi, 1, load_balance=lb), 1, load_balance=lb), xi),
        }
        xt = torch.randn(4, s, generator=g).t()  # (s, 4), non-contiguous
        checks["transposed dim=0"] = {
            "shard_ok": torch.equal(shard(xt, 0, load_balance=lb), xt.index_select(0, pos)),
            "unshard_ok": torch.equal(unshard(shard(xt, 0, load_balance=lb), 0, load_balance=lb), xt),
        }
        res["checks"] = checks

        # Gradient through unshard. Every rank holds the same full x and computes the same
        # full loss L = sum(unshard(x_l) * w). The all-gather's backward is a reduce-scatter
        # (sum) of the per-rank upstream gradients: each rank's upstream gradient is w, so
        # rank r receives sum over N ranks of shard_r(w) = N * shard_r(w). (A user who
        # evaluates the same loss on every rank gets N x the single-device gradient; that is
        # the standard all-gather autograd semantics.) w is integer-valued so the sum of N
        # copies is exact in float32 regardless of the reduction order.
        for name, shape, dim in _cases(s)[:3]:
            x = torch.randn(*shape, generator=g)
            w = torch.randint(-8, 9, shape, generator=g).to(torch.float32)
            x_l = shard(x, dim, load_balance=lb).detach().requires_grad_()
            loss = (unshard(x_l, dim, load_balance=lb) * w).sum()
            loss.backward()
            res.setdefault("grad", {})[name] = {
                "grad_ok": torch.equal(x_l.grad, n * shard(w, dim, load_balance=lb)),
                "grad": x_l.grad.detach().clone(),
                "expected": (n * shard(w, dim, load_balance=lb)).detach().clone(),
            }
        # Gradient through shard: x.grad is the upstream gradient scattered to this rank's positions.
        x = torch.randn(2, s, 3, generator=g, requires_grad=True)
        up = torch.randn(2, s // n, 3, generator=g)
        (shard(x, 1, load_balance=lb) * up).sum().backward()
        expected = torch.zeros(2, s, 3).index_copy(1, pos, up)
        res["shard_grad_ok"] = torch.equal(x.grad, expected)

        out["layouts"][lb] = res

        # unsplittable lengths: caught here, the message is checked in the parent
        bad_s = multiple_of(n, lb) + 1
        try:
            shard(torch.zeros(2, bad_s, 3), 1, load_balance=lb)
            out["errors"][lb] = None
        except ValueError as e:
            out["errors"][lb] = ("ValueError", bad_s, str(e))
        except Exception as e:  # noqa: BLE001 - report the wrong type to the parent
            out["errors"][lb] = (type(e).__name__, bad_s, str(e))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_unshard_on_real_groups(ranks, world_size):
    results = ranks.run(world_size, _shard_unshard_rank_fn)
    assert len(results) == world_size
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world_size"] == world_size
    for lb in LOAD_BALANCES:
        s = results[0]["layouts"][lb]["s"]
        # positions: this rank's global positions, and together a permutation of range(S)
        all_pos = []
        for r, res in enumerate(results):
            lr = res["layouts"][lb]
            assert lr["positions"] == lr["rank_positions"] == rank_positions(s, world_size, r, lb).tolist()
            assert lr["positions_explicit_world"] == lr["positions"]
            all_pos += lr["positions"]
        assert sorted(all_pos) == list(range(s)), (lb, all_pos)
        for r, res in enumerate(results):
            lr = res["layouts"][lb]
            for name, chk in lr["checks"].items():
                for key, ok in chk.items():
                    if key.endswith("_ok"):
                        assert ok, f"{key} failed: world={world_size} rank={r} lb={lb} case={name}"
                if "shard_shape" in chk:
                    assert s // world_size in chk["shard_shape"]
            for name, g in lr["grad"].items():
                assert g["grad_ok"], (
                    f"unshard grad != N * shard(w): world={world_size} rank={r} lb={lb} case={name}\n"
                    f"grad={g['grad']}\nexpected={g['expected']}"
                )
            assert lr["shard_grad_ok"], f"shard backward wrong: world={world_size} rank={r} lb={lb}"
            err = res["errors"][lb]
            assert err is not None, f"no error for unsplittable S: world={world_size} rank={r} lb={lb}"
            kind, bad_s, msg = err
            assert kind == "ValueError", err
            assert_names_multiple(msg, multiple_of(world_size, lb))
