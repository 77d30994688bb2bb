"""One model over several processes with ``mx.distributed``: rank 0 serves, the others follow.

The model is split tensor-parallel by mlx-lm's ``Model.shard`` (each rank
holds its share of every layer's attention heads and MLP columns; two
all-sums per layer join the shares), over MLX's ``ring`` backend (TCP; on
one machine, loopback ports). Each rank keeps its own share of the KV heads
in its own pool and arena.

Rank 0 is the whole server: HTTP, admission, scheduling, sampling,
detokenizing, the pool figures. The other ranks run only a
:class:`~server.engine.runner.ModelRunner` and repeat rank 0's runner calls,
in the same order, so that every rank makes the same model calls and their
collectives line up::

    rank 0: LeaderRunner                         rank r > 0: follow()
      add / remove            -> recorded
      prefill(budget)         -> exchange(ops) ->  apply ops; prefill(budget)
      decode()                -> exchange(ops) ->  apply ops; decode()
      close()                 -> exchange(stop) -> close; exit 0
                              <- each rank's pool figures ride back on every exchange

The tokens every rank feeds are rank 0's: the runner passes each sampled
token through :func:`token_sharer`, an all-sum to which only rank 0
contributes, inside the step's graph; followers never need their own draws
to agree and rank 0's host never waits for them.

Left out on purpose, since each would have one rank run a model call the
others do not: prefix caching (a hit changes the prompt a rank computes),
prompt scoring (``echo`` runs the model outside the step), fault hooks, and
cutting a step's prefill by time or by a cancellation between its chunks
(``batch.max_prefill_s_per_step``; cancelled requests leave at the step's start).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import selectors
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from server.engine.run_output import RowHook, RunOutput
from server.engine.runner import ModelRunner
from server.protocol import SamplingParams

log = logging.getLogger("veloxquant.server")

RANK_ENV, HOSTFILE_ENV = "MLX_RANK", "MLX_HOSTFILE"  # what mx.distributed's ring backend reads
FIGURES = ("blocks_in_use", "blocks_free", "n_blocks")  # each rank's pool, on every exchange


class DistributedError(RuntimeError):
    """The model cannot be split over the ranks, or the ranks cannot meet."""


# -- start-up ------------------------------------------------------------------


def spawn_local_ranks(ranks: int, argv: list[str]) -> list[subprocess.Popen]:
    """Make this process rank 0 of ``ranks`` on loopback and start ranks 1.. as copies of it.

    A no-op (returns ``[]``) when this process already has a rank: started by
    ``mlx.launch``, or a copy started here. The ring's hostfile lists one
    free loopback port per rank.
    """
    if RANK_ENV in os.environ or ranks <= 1:
        return []
    ports = []
    for _ in range(ranks):
        with socket.socket() as probe:  # the ring listens on these; the OS picks free ones
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    fd, hostfile = tempfile.mkstemp(prefix="veloxquant-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], f)
    os.environ[HOSTFILE_ENV], os.environ[RANK_ENV] = hostfile, "0"
    return [subprocess.Popen(argv, env=dict(os.environ, **{RANK_ENV: str(rank)}),
                             preexec_fn=_die_with_parent)
            for rank in range(1, ranks)]


def _die_with_parent() -> None:
    """In a spawned rank: SIGKILL when rank 0 dies (Linux), so no rank outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def join_group(ranks: int) -> Any:
    """The ring group of ``ranks`` processes this one belongs to (blocks until all meet).

    Raises:
        DistributedError: The group's size is not ``ranks``.
    """
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != ranks:
        raise DistributedError(f"distributed.ranks is {ranks} but the ring has "
                               f"{group.size()} processes (MLX_HOSTFILE)")
    return group


def open_sockets() -> set[int]:
    """This process's file descriptors that are sockets (``/dev/fd``: Linux and macOS)."""
    found = set()
    for name in os.listdir("/dev/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                found.add(int(name))
        except (ValueError, OSError):  # the listing's own descriptor, closed by now
            continue
    return found


class LeaderWait:
    """Block a follower in the kernel until rank 0 starts the next exchange.

    MLX's ring backend waits for a peer's bytes by calling ``recv`` on a
    non-blocking socket in a loop, so a follower sitting in the exchange's
    all-sum while rank 0 has nothing to do burns a whole core for as long as
    the server is idle. Waiting first until one of the ring's sockets (those
    ``mx.distributed.init`` opened) is readable costs no CPU; the all-sum that
    follows finds rank 0's bytes there. A peer that died makes its socket
    readable too (end of file), and the all-sum then fails as before.
    """

    def __init__(self, ring_fds: Iterable[int]) -> None:
        self._selector = selectors.DefaultSelector()
        for fd in ring_fds:
            self._selector.register(fd, selectors.EVENT_READ)

    def __call__(self) -> None:
        if self._selector.get_map():
            self._selector.select()

    def close(self) -> None:
        self._selector.close()


def check_split(model_dir: Any, ranks: int) -> None:
    """Refuse, before any rank starts, a model whose heads do not divide among ``ranks``.

    Raises:
        DistributedError: They do not (read from the folder's ``config.json``).
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config.get("num_attention_heads", 0))
    _check_heads(heads, int(config.get("num_key_value_heads") or heads), ranks)


def _check_heads(heads: int, kv_heads: int, ranks: int) -> None:
    if not heads or heads % ranks or kv_heads % ranks:
        raise DistributedError(f"{heads} attention heads and {kv_heads} KV heads do not "
                               f"divide among {ranks} ranks")


def shard_loaded(loaded: Any, group: Any) -> None:
    """Split a :class:`~server.model_loader.LoadedModel` over ``group`` (see shard_model);
    it must be loaded with ``codes=False`` (mlx-lm's split takes its own layers only)."""
    shard_model(loaded.model, group)


def shard_model(model: Any, group: Any) -> None:
    """Split ``model`` over ``group`` with mlx-lm's ``shard`` (tensor parallel).

    Raises:
        DistributedError: The family has no ``shard`` in mlx-lm, or its heads do
            not divide among the ranks.
    """
    size = group.size()
    if not hasattr(model, "shard"):
        raise DistributedError(f"mlx-lm has no tensor-parallel split for "
                               f"{type(model).__module__} models")
    heads = model.args.num_attention_heads
    _check_heads(heads, getattr(model.args, "num_key_value_heads", None) or heads, size)
    model.shard(group)
    mx.eval(model.parameters())


def token_sharer(group: Any):
    """``share(tokens)``: rank 0's tokens on every rank (an all-sum only rank 0 adds to)."""
    leader = group.rank() == 0

    def share(tokens: mx.array) -> mx.array:
        # A follower adds zeros computed FROM its own tokens: with constant zeros
        # its all-sum would depend on nothing, MLX could run it before the
        # model's all-sums that rank 0 runs first, and the ranks would deadlock.
        mine = tokens.astype(mx.int32)
        if not leader:
            mine = mine * 0
        return mx.distributed.all_sum(mine, group=group).astype(tokens.dtype)

    return share


# -- the per-step exchange -------------------------------------------------------


class RankLink:
    """Rank 0's op lists out to the followers; every rank's pool figures back, each call."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.figures: list[dict[str, int]] = [dict.fromkeys(FIGURES, 0)
                                              for _ in range(self.size)]

    def exchange(self, ops: list | None, figures: Iterable[int]) -> list:
        """Send ``ops`` (rank 0) or receive them (others); everyone shares ``figures``.

        Two all-sums: a header (payload length from rank 0, one row of figures
        per rank), then the payload as int32 words, when there is one. The ops
        are pickled: the ring links processes of one deployment, on loopback or
        on the cluster network mx.distributed already has to trust.
        """
        header = np.zeros((self.size, 1 + len(FIGURES)), np.int32)
        header[self.rank, 1:] = list(figures)
        payload = b""
        if self.rank == 0:
            payload = pickle.dumps(ops or [])
            header[0, 0] = len(payload)
        total = np.array(self._sum(header))
        self.figures = [dict(zip(FIGURES, map(int, row[1:]), strict=True)) for row in total]
        length = int(total[0, 0])
        if length == 0:
            return []
        words = np.zeros(-(-length // 4), np.int32)
        if self.rank == 0:
            words.view(np.uint8)[:length] = np.frombuffer(payload, np.uint8)
        got = np.array(self._sum(words), np.int32)
        return pickle.loads(got.view(np.uint8)[:length].tobytes())

    def _sum(self, array: np.ndarray) -> mx.array:
        out = mx.distributed.all_sum(mx.array(array), group=self.group)
        mx.eval(out)
        return out


def pool_figures(pool: Any) -> tuple[int, int, int]:
    """A pool's :data:`FIGURES`."""
    free = sum(pool.n_free(s) for s in pool.config.streams)
    return pool.stats.blocks_in_use(), free, pool.stats.n_blocks


# -- rank 0 --------------------------------------------------------------------


class LeaderRunner:
    """Rank 0's runner: records add/remove, hands them to the followers before each model call.

    Every other attribute is the wrapped :class:`ModelRunner`'s.
    """

    def __init__(self, runner: ModelRunner, link: RankLink) -> None:
        self._runner, self._link, self._ops = runner, link, []
        self._lost = False  # an exchange failed: the ring is gone for good
        runner.share_tokens = token_sharer(link.group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def add(self, owner: int, prompt_ids: list[int], params: SamplingParams,
            prefix: Any = None, task: Any = None) -> None:
        if prefix is not None:
            raise DistributedError("prefix caching is off with distributed serving")
        if task is not None:  # the routes refuse scoring and embeddings over ranks
            raise DistributedError("whole-prompt tasks are not served over ranks")
        self._runner.add(owner, prompt_ids, params, None)
        # A follower's draws are replaced by rank 0's: it needs no grammar and no seed.
        self._ops.append(("add", owner, list(prompt_ids),
                          dataclasses.replace(params, constraint=None)))

    def remove(self, owners: Iterable[int]) -> dict[int, int]:
        owners = list(owners)
        self._ops.append(("remove", owners))
        return self._runner.remove(owners)

    def prefill(self, budget: int, hook: RowHook | None = None,
                seconds: float | None = None) -> RunOutput:
        # No time slice (``seconds``) and no cancellation between chunks (the
        # engine's ``before_chunk`` lands on this wrapper, not on the runner): both
        # would have rank 0 cut a prefill where its followers do not.
        self.flush(("prefill", budget))
        return self._checked(self._runner.prefill(budget, None))

    def decode(self, hook: RowHook | None = None) -> RunOutput:
        self.flush(("decode",))
        return self._checked(self._runner.decode(None))

    def _checked(self, out: RunOutput) -> RunOutput:
        """``out``, unless one of its model calls raised: then the ring is lost.

        A model call holds the ranks' all-sums. One that raised on rank 0 (a peer
        gone: "[ring] connection to a peer was lost", or any failure part-way)
        leaves the ranks at different points of their sequence of collectives, and
        the next exchange would wait forever for a partner. So it ends the engine
        (its requests get 503, ``/health`` 503) instead of failing rows one by one.
        """
        if out.call_error is not None:
            self._lost = True
            raise DistributedError(f"lost the other ranks: a model call failed on rank 0 "
                                   f"({out.call_error})") from out.call_error
        return out

    def close(self) -> None:
        if self._lost:  # MLX work waiting on a dead peer never finishes: do not wait for it
            return
        self._runner.close()
        try:
            self.flush(("stop",))
        except Exception:  # the engine still has to finish shutting down
            log.exception("could not tell the other ranks to stop")

    def flush(self, *ops: tuple) -> None:
        """Send what was recorded, then ``ops``; refresh every rank's pool figures."""
        pending, self._ops = self._ops + list(ops), []
        try:
            self._link.exchange(pending, pool_figures(self._runner.pool))
        except Exception as exc:
            self._lost = True
            raise DistributedError(f"lost the other ranks: {exc}") from exc

    def rank_figures(self) -> list[dict[str, int]]:
        """Every rank's pool figures, fresh (call on the engine thread).

        Two exchanges: a follower reports its figures as it receives ops, so
        the second one carries what it holds after the first one's removals.
        """
        self.flush()
        self.flush()  # rank 0's own row is its pool as of this exchange
        return self._link.figures


# -- ranks 1.. -------------------------------------------------------------------


def follow(runner: ModelRunner, link: RankLink, wait: Any = None) -> None:
    """Repeat rank 0's runner calls until it says stop (ranks > 0).

    ``wait`` (a :class:`LeaderWait`) blocks until rank 0 sends, before each exchange.
    """
    runner.share_tokens = token_sharer(link.group)
    while True:
        if wait is not None:
            wait()
        for op in link.exchange(None, pool_figures(runner.pool)):
            kind = op[0]
            if kind == "add":
                runner.add(op[1], op[2], op[3], None)
            elif kind == "remove":
                runner.remove(op[1])
            elif kind == "prefill":
                runner.prefill(op[1])
            elif kind == "decode":
                runner.decode()
            elif kind == "stop":
                runner.close()
                return
            else:
                raise DistributedError(f"unknown op from rank 0: {kind!r}")
