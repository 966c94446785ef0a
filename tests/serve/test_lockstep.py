"""The sharded server's loop in this process: rank 0's scheduler with every open and leave sent in a pass, and a
follower that does the passes it is sent, on a group of one rank (MLX's own, outside ``mlx.launch``)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from specdec_cli.loop.flights import Flights
from specdec_cli.model.distributed import Ranks, Watchdog, world
from specdec_cli.serve.lockstep import Fresh, Leave, Lockstep, Open, Pass
from specdec_cli.serve.scheduler import Scheduler
from specdec_cli.session import ModelOptions, PromptCache, Request, Session, load_setup
from specdec_cli.session.synthetic import make_model_dir

from test_scheduler import N, PROMPTS, alone, refuses_one_past_the_bound, serve


class Recorded(Ranks):
    """One rank (MLX's group of one) whose agreements that carry rank 0's values (passes, clocks, shared ints) are
    recorded, or played back from a recording: as a rank other than 0 receives them from rank 0."""

    def __init__(self, script=None):
        super().__init__(world(), watchdog=Watchdog(0, 60.0, 2))
        self.sent: list[tuple[str, bytes]] = []
        self.script = None if script is None else iter(script)

    def _agree(self, kind: str, real, *args):
        if self.script is not None:
            got_kind, data = next(self.script)
            assert got_kind == kind, f"this rank asked for a {kind} where rank 0 made a {got_kind}"
            return pickle.loads(data)
        out = real(*args)
        self.sent.append((kind, pickle.dumps(out)))
        return out

    def broadcast(self, obj=None):
        return self._agree("broadcast", super().broadcast, obj)

    def clock(self, seconds: float) -> float:
        return self._agree("clock", super().clock, seconds)

    def share(self, values):
        return self._agree("share", super().share, values)

    @property
    def passes(self) -> list[Pass]:
        return [pickle.loads(data) for kind, data in self.sent if kind == "broadcast"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("lockstep") / "llama", "llama", seed=0)
    return load_setup(ModelOptions(model=str(path), dtype="float32"), "lookup")


def ranked(setup, ranks: Ranks) -> Session:
    return Session(replace(setup, ranks=ranks), 8, prompt_cache=PromptCache(4))


def test_every_open_and_leave_goes_out_in_a_pass_and_the_answers_are_unchanged(setup):
    ranks = Recorded()
    session = ranked(setup, ranks)
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert got == [alone(setup, p) for p in PROMPTS]
    passes = ranks.passes
    ops = [op for p in passes for op in p.ops]
    opened = [op.id for op in ops if isinstance(op, Open)]
    left = [op for op in ops if isinstance(op, Leave)]
    assert len(opened) == len(PROMPTS) and sorted(op.id for op in left) == sorted(opened)
    # Each answer's tokens go with its leave (every rank's prompt cache and lookup corpus keep the same).
    assert sorted(list(op.tokens) for op in left) == sorted(got) and all(op.keep for op in left)
    # Nothing is done before it was sent: the leaves come in a later pass than their opens.
    first = {op.id: i for i, p in enumerate(passes) for op in p.ops if isinstance(op, Open)}
    assert all(first[op.id] < i for i, p in enumerate(passes) for op in p.ops if isinstance(op, Leave))
    assert passes[-1].stop and not any(p.stop for p in passes[:-1])
    assert len(session.prompt_cache) == len(PROMPTS)


def test_a_follower_doing_rank_0s_passes_decodes_the_same_tokens(setup, monkeypatch):
    leader = Recorded()
    session = ranked(setup, leader)
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS + PROMPTS[:1])
    follower = Recorded(leader.sent)
    mine = ranked(setup, follower)
    kept: list[list[int]] = []
    real = Flights.leave
    monkeypatch.setattr(Flights, "leave", lambda self, flight, keep=True, tokens=None: (
        kept.append(list(flight.tokens)), real(self, flight, keep, tokens))[1])
    Scheduler(mine, max_rows=4).follow()  # returns at the stop pass
    # Its own engine committed what rank 0's did, row for row (the last one resumed from its prompt cache).
    assert sorted(kept) == sorted(got)
    assert len(mine.prompt_cache) == len(PROMPTS)
    assert next(follower.script, None) is None  # every agreement rank 0 made, this rank made too


def test_ops_are_done_at_once_in_one_process_and_queued_under_ranks(setup):
    one = Lockstep(None)
    rows = Flights(Session(setup, 8))
    assert one.add(Open(1, Request(PROMPTS[0], N)), rows) == [] and len(rows.flights) == 1
    one.add(Leave(1, keep=False), rows)
    assert not rows.flights and one.send() == []
    under = Lockstep(Recorded())
    assert under.add(Open(2, Request(PROMPTS[0], N)), rows) == [] and not rows.flights
    ops = under.send()
    assert ops == [Open(2, Request(PROMPTS[0], N))] and under.send() == []
    under.apply(ops + [Fresh()], rows)
    assert len(rows.flights) == 1
    # An op that fails is reported and does nothing more; the others go on.
    failed = under.apply([Open(3, Request([], N)), Leave(2, keep=False)], rows)
    assert [type(op) for op, _ in failed] == [Open] and not rows.flights


def test_under_ranks_a_request_being_opened_in_a_pass_counts_against_the_bound(setup, monkeypatch):
    # Taken from the asks for its pass and not yet a flight (its cache looked up, from disk maybe): it counted
    # nowhere, so one more than rows + --queue-size got in.
    import asyncio
    import threading

    from specdec_cli.serve.scheduler import Job
    from specdec_cli.session.reply import Reply, TextStream

    session = ranked(setup, Recorded())
    opening, release = threading.Event(), threading.Event()
    real = Flights.open

    def slow_open(self, request, tag=None):
        opening.set()
        release.wait(60)
        return real(self, request, tag)

    monkeypatch.setattr(Flights, "open", slow_open)

    def maker(prompt):
        return lambda: Reply(session, Request(prompt, N), TextStream(setup.tokenizer, chat=False))

    scheduler = Scheduler(session, max_rows=1, max_queue=1)
    loop = asyncio.new_event_loop()
    jobs = [Job(maker(PROMPTS[0]), loop), Job(maker(PROMPTS[1]), loop)]
    try:
        refuses_one_past_the_bound(scheduler, jobs, Job(maker(PROMPTS[2]), loop), opening, release)
    finally:
        loop.close()


def test_a_request_whose_open_loses_the_ranks_is_failed_not_left_waiting(setup, monkeypatch):
    # The ranks lost while it was opened (the thread ends): it was in neither the asks nor the flights, so its
    # client was never answered.
    import asyncio
    import threading

    from specdec_cli.model.distributed import DistributedError
    from specdec_cli.serve.scheduler import Failed, Job
    from specdec_cli.session.reply import Reply, TextStream

    session = ranked(setup, Recorded())
    # And without a traceback: rank 0's stderr carried the thread's ("Exception in thread specdec-generation")
    # above the one error line the server ends with.
    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)

    def lost(self, request, tag=None):
        raise DistributedError("rank 1 is gone")

    monkeypatch.setattr(Flights, "open", lost)
    scheduler = Scheduler(session, max_rows=2)
    loop = asyncio.new_event_loop()
    job = Job(lambda: Reply(session, Request(PROMPTS[0], N), TextStream(setup.tokenizer, chat=False)), loop)
    try:
        scheduler.start()
        scheduler.submit(job)
        scheduler._thread.join(60)
        assert not scheduler._thread.is_alive() and isinstance(scheduler.fault, DistributedError)
        got = loop.run_until_complete(asyncio.wait_for(job.out.get(), 10))
        assert isinstance(got, Failed) and unhandled == []
    finally:
        scheduler.stop()
        loop.close()
