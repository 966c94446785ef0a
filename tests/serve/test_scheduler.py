"""The server's scheduler in this process: requests decoded together, each answer its request's alone, and a
request admitted only when the batch it joins fits the device's memory."""

from __future__ import annotations

import asyncio

import pytest
from helpers import assert_served, rows_per_call

from specdec_cli.serve.scheduler import Busy, Done, Failed, Job, Scheduler
from specdec_cli.session import ModelOptions, Request, Session, load_setup
from specdec_cli.session.reply import Reply, TextStream
from specdec_cli.session.setup import MemoryLimitError
from specdec_cli.session.synthetic import make_model_dir

PROMPTS = [list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox."),
           list(b"abc abc abc abc abc abc"), list(b"Hello there, how are you?")]
N = 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("sched") / "llama", "llama", seed=0)
    return load_setup(ModelOptions(model=str(path), dtype="float32"), "lookup")


def alone(setup, prompt) -> list[int]:
    reply = Reply(Session(setup, 8), Request(prompt, N), TextStream(setup.tokenizer, chat=False))
    list(reply)
    return reply.tokens


def assert_each_alone(setup, got: list[list[int]], prompts, want=None) -> None:
    """Each answer is its request's alone (docs/EXACTNESS.md's promise where batched rows round apart)."""
    want = want if want is not None else [alone(setup, p) for p in prompts]
    for p, out, w in zip(prompts, got, want, strict=True):
        assert_served(setup.target, out, p, N, w)


def serve(scheduler: Scheduler, session: Session, prompts) -> list[tuple[list[int], list]]:
    """Submit every prompt at once; returns each request's tokens and the order events came in."""
    loop = asyncio.new_event_loop()
    events: list = []

    async def run() -> list:
        jobs = []
        for i, prompt in enumerate(prompts):
            def make(prompt=prompt):
                return Reply(session, Request(prompt, N), TextStream(session.setup.tokenizer, chat=False))

            job = Job(make, loop)
            scheduler.submit(job)
            jobs.append(job)

        async def collect(i: int, job: Job) -> list[int]:
            while True:
                item = await asyncio.wait_for(job.out.get(), 120)
                events.append((i, type(item).__name__))
                if isinstance(item, Failed):
                    raise item.error
                if isinstance(item, Done):
                    return item.reply.tokens

        return await asyncio.gather(*(collect(i, j) for i, j in enumerate(jobs)))

    return running(scheduler, loop, run()), events


async def finished(job: Job) -> Reply:
    """A request's reply once it is done (its failure raised)."""
    while True:
        item = await asyncio.wait_for(job.out.get(), 120)
        if isinstance(item, Failed):
            raise item.error
        if isinstance(item, Done):
            return item.reply


def running(scheduler: Scheduler, loop: asyncio.AbstractEventLoop, requests):
    """What the coroutine ``requests`` returns, with ``scheduler`` serving meanwhile."""
    scheduler.start()
    try:
        return loop.run_until_complete(requests)
    finally:
        scheduler.stop()
        loop.close()


def refuses_one_past_the_bound(scheduler: Scheduler, jobs: list[Job], extra: Job, held, release, wait_s: float = 60):
    """With rows + queue of 2: ``jobs[0]`` held by the thread (``held`` set) and ``jobs[1]`` queued leave no room:
    ``extra`` gets Busy. Cancels the jobs, lets the held one go (``release``) and stops the scheduler."""
    try:
        scheduler.start()
        scheduler.submit(jobs[0])
        assert held.wait(wait_s)
        scheduler.submit(jobs[1])  # the queue's one place
        with pytest.raises(Busy):
            scheduler.submit(extra)
    finally:
        for job in jobs:
            job.cancel()
        release.set()
        scheduler.stop()


def test_requests_decoded_together_each_get_their_own_answer(setup):
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4)
    got, events = serve(scheduler, session, PROMPTS)
    assert_each_alone(setup, got, PROMPTS)
    # Interleaved: a request's text came before another one had finished.
    done = [i for i, kind in events if kind == "Done"]
    assert any(kind == "Piece" and i != done[0] for i, kind in events[: events.index((done[0], "Done"))])


def group_sizes(monkeypatch, group) -> list[int]:
    """How many rows each propose of a drafter group drafts for."""
    return rows_per_call(monkeypatch, group, "propose")


def test_requests_that_arrive_together_are_prefilled_in_one_forward(setup, monkeypatch):
    """A burst's prompts go into one forward of them all (their first tokens come after one forward, not one
    per request); each answer is still its request's alone."""
    from specdec_cli.loop.flights import Flights

    together = rows_per_call(monkeypatch, Flights, "prefill_together")
    session = Session(setup, 8)
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert_each_alone(setup, got, PROMPTS)
    assert together and max(together) >= 2, together
    # Who joins: requests with nothing fed yet, from the oldest, while their prompts padded to the longest
    # fit the budget and are not mostly padding (PROMPTS: 72, 23 and 25 bytes; 23 and 25 go together).
    rows = Flights(session)
    try:
        flights = [rows.open(Request(p, N)) for p in PROMPTS]
        assert rows.together(flights) == [flights[0], flights[2]]  # 2 x 71 padded for 71 + 24 tokens
        assert rows.together(flights[1:]) == flights[1:]
        assert rows.together(flights[1:], budget=len(PROMPTS[2])) == []
        rows.prefill(flights[1])  # a chunk of its own fed: it goes on alone, and the others wait
        assert rows.together(flights[1:]) == []
    finally:
        rows.close()


def test_requests_with_a_draft_model_draft_together_and_each_get_their_own_answer(tmp_path, monkeypatch):
    """With a draft model, the rows of a batch draft in one forward of the draft model per draft step."""
    from specdec_cli.drafters.model_batch import DraftBatch

    target = make_model_dir(tmp_path / "target", "llama", seed=0)
    draft = make_model_dir(tmp_path / "draft", "llama", seed=1)
    setup = load_setup(ModelOptions(model=str(target), draft_model=str(draft), dtype="float32"), "model")
    rows = group_sizes(monkeypatch, DraftBatch)
    session = Session(setup, 4)
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert_each_alone(setup, got, PROMPTS)
    assert max(rows) == len(PROMPTS)


def test_requests_with_an_mtp_head_draft_together_through_the_prompt_cache(tmp_path, monkeypatch):
    """An MTP head behind the prompt cache's hidden-state log: rows of one batch draft in one head forward per
    step, each answer is its request's alone, and a request sent again answers the same from the cache."""
    from mtp_fixtures import fitted_head, hf_checkpoint

    from specdec_cli.drafters.mtp_batch import MTPBatch
    from specdec_cli.session.prompt_cache import PromptCache

    path = hf_checkpoint(tmp_path / "qwen3_5", "qwen3_5", fitted_head("qwen3_5"))
    setup = load_setup(ModelOptions(model=str(path), dtype="float32"), "mtp")
    rows = group_sizes(monkeypatch, MTPBatch)
    session = Session(setup, 4, prompt_cache=PromptCache())
    want = [alone(setup, p) for p in PROMPTS]
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert max(rows) >= 2  # the first request may end before the last one has prefilled
    assert_each_alone(setup, got, PROMPTS, want)
    again, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert_each_alone(setup, again, PROMPTS, want)


def test_requests_with_a_dflash_drafter_draft_together(tmp_path, monkeypatch):
    """DFlash reads the target's hidden states of every prompt token: rows prefilled between blocks get theirs,
    and the rows of a batch draft in one drafter forward."""
    from test_dflash import qwen_dflash_setup

    from specdec_cli.drafters.dflash_batch import DFlashBatch

    setup = qwen_dflash_setup(tmp_path)
    rows = group_sizes(monkeypatch, DFlashBatch)
    session = Session(setup, 6)
    want = [alone(setup, p) for p in PROMPTS]
    got, _ = serve(Scheduler(session, max_rows=4), session, PROMPTS)
    assert max(rows) >= 2  # the first request may end before the last one has prefilled
    assert_each_alone(setup, got, PROMPTS, want)


def test_a_request_waits_until_the_batch_it_would_join_fits_in_memory(setup, monkeypatch):
    session = Session(setup, 8)
    one = len(PROMPTS[0]) + N  # the longest request's tokens: one fits, two together do not
    real = setup.check_memory

    def check(tokens: int):
        if tokens > one:
            raise MemoryLimitError("too much")
        return real(tokens)

    monkeypatch.setattr(setup, "check_memory", check)
    scheduler = Scheduler(session, max_rows=4)
    got, events = serve(scheduler, session, PROMPTS[:2])
    assert_each_alone(setup, got, PROMPTS[:2])
    # The second request produced nothing before the first was done.
    first_done = events.index((0, "Done"))
    assert all(i == 0 for i, _ in events[:first_done])


def test_on_a_gpu_like_backend_rows_decode_together_and_each_is_its_request_alone_or_a_tie(setup, gpu_like,
                                                                                          monkeypatch):
    # Where a batched row rounds otherwise than the row alone, the batch check still lets rows share a batch
    # (it measures the backend's own rounding), and each answer, held against its request decoded alone, is
    # the same text or parts from it at a rounding tie.
    from specdec_cli.loop.compare import IDENTICAL, TIE
    from specdec_cli.session.batch import batch_refusal

    session = Session(setup, 8)
    assert batch_refusal(session) is None and session.rounding.batched > 0
    scheduler = Scheduler(session, max_rows=4)
    from specdec_cli.loop.engine import Engine

    widths, real_step = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: widths.append(len(self.rows)) or real_step(self))
    loop = asyncio.new_event_loop()
    prompts = PROMPTS + [list(b"one two three four five six; one two three")]

    async def run() -> list:
        jobs = []
        for prompt in prompts:
            def make(prompt=prompt):
                reply = Reply(session, Request(prompt, N), TextStream(session.setup.tokenizer, chat=False))
                reply.compare = True
                return reply

            jobs.append(Job(make, loop))
            scheduler.submit(jobs[-1])
        return await asyncio.gather(*(finished(j) for j in jobs))

    replies = running(scheduler, loop, run())
    assert max(widths) == len(prompts)  # decoded together
    verdicts = [r.comparison.verdict for r in replies]
    assert set(verdicts) <= {IDENTICAL, TIE}, [r.comparison.divergence for r in replies]
    for r in replies:
        d = r.comparison.divergence
        assert d is None or (d.bound is not None and d.margin <= d.bound)


def test_with_blocks_pipelined_a_lone_rows_queued_forward_gives_way_to_requests_that_join(setup, monkeypatch):
    # Where the device computes apart from the host (a GPU), a request decoding alone queues its next forward
    # ahead while its drafter has nothing; requests joining it then undo that forward (the row feeds its token in
    # the batch instead), and every answer is still its request's alone.
    import threading

    from specdec_cli.loop import engine as engine_module
    from specdec_cli.loop.engine import Engine

    monkeypatch.setattr(engine_module, "PIPELINE", True)
    queued, joined = threading.Event(), threading.Event()
    widths, real_step = [], Engine.step

    def step(self):
        widths.append(len(self.rows))
        out = real_step(self)
        if len(self.rows) == 1 and self._ahead is not None and not queued.is_set():
            queued.set()  # the lone row's next forward is queued: the others are submitted before the next step
            assert joined.wait(60)
        return out

    monkeypatch.setattr(Engine, "step", step)
    dropped, real_drop = [], Engine._drop_ahead
    monkeypatch.setattr(Engine, "_drop_ahead", lambda self, cache: dropped.append(self._ahead is not None)
                        or real_drop(self, cache))
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4)
    loop = asyncio.new_event_loop()

    async def run() -> list:
        def job(prompt) -> Job:
            return Job(lambda: Reply(session, Request(prompt, N), TextStream(session.setup.tokenizer, chat=False)),
                       loop)

        try:
            first = job(PROMPTS[2])
            scheduler.submit(first)
            assert await loop.run_in_executor(None, queued.wait, 60)
            rest = [job(p) for p in PROMPTS[:2]]
            for j in rest:
                scheduler.submit(j)
        finally:
            joined.set()
        return [r.tokens for r in await asyncio.gather(*(finished(j) for j in [first, *rest]))]

    got = running(scheduler, loop, run())
    assert max(widths) >= 2 and any(dropped)  # they joined it, its queued forward undone
    assert_each_alone(setup, got, [PROMPTS[2], *PROMPTS[:2]])
