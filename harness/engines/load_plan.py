"""What a load run sends, decided before any engine starts: a seeded plan of requests.

`plan_load` draws, from one seed: each request's prompt (token ids from the model's vocabulary,
a mix of short and long lengths, some sharing one of a few long prefixes so the prefix cache has
something to serve), its sampling (greedy, or a temperature with its own seed) and its client
(K clients, requests dealt round robin). A client sends its next request a seeded gap after its
previous one finished: in engine steps in process (so a plan replays the same schedule), in
seconds against a server (`gap * step_s`). The plan is plain data: the same seed, the same plan.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvfid.errors import BadInput


@dataclass(frozen=True)
class LoadShape:
    """The knobs of a plan (defaults: a mix that a small KV budget preempts)."""

    requests: int = 64
    clients: int = 8
    tokens: int = 32                  # max new tokens per request
    short: tuple[int, int] = (16, 96)          # prompt length range of a short prompt
    long: tuple[int, int] = (200, 480)         # and of a long one
    long_share: float = 0.5           # the fraction of prompts that are long
    prefixes: int = 3                 # shared long prefixes
    prefix_share: float = 0.25        # the fraction of requests that start with one of them
    prefix_length: int = 192
    greedy_share: float = 0.5         # the rest sample at `temperature` with their own seed
    temperature: float = 0.8
    mean_gap: float = 2.0             # mean steps between a client's requests (exponential)
    vocab: tuple[int, int] = (3, 250)          # token ids drawn from [lo, hi)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan."""

    index: int
    client: int
    prompt: tuple[int, ...]
    tokens: int
    temperature: float                # 0: greedy
    seed: int | None                  # the sampler's seed (None when greedy)
    gap: int                          # steps its client waits after its previous request
    prefix: int | None = None         # which shared prefix it starts with

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class LoadPlan:
    """The requests in sending order per client, and what drew them."""

    seed: int
    shape: LoadShape
    requests: tuple[PlannedRequest, ...]

    def by_client(self) -> list[list[PlannedRequest]]:
        """Each client's requests in the order it sends them."""
        out: list[list[PlannedRequest]] = [[] for _ in range(self.shape.clients)]
        for r in self.requests:
            out[r.client].append(r)
        return out

    @property
    def longest(self) -> int:
        """The most positions any request needs (prompt and every new token)."""
        return max((len(r.prompt) + r.tokens for r in self.requests), default=0)


class Clients:
    """A plan's clients on an engine's step loop, in process: a client sends its first request
    `gap` steps in and each next one `gap` steps after its previous one finished. The loop takes
    the requests `due` at a step, says which client's request `finished`, and where nothing is in
    flight jumps to `next_step` (None: every request was sent)."""

    def __init__(self, plan: LoadPlan) -> None:
        self.queues = plan.by_client()
        self.ready = [q[0].gap if q else None for q in self.queues]   # the step a client sends at
        self.busy: list[int | None] = [None] * len(self.queues)       # its request in flight

    def due(self, step: int) -> Iterator[PlannedRequest]:
        """The requests sent at `step`, each marked in flight (a refused one is `finished` by
        the loop, and its client's next one may follow at once)."""
        for client, queue in enumerate(self.queues):
            while self.busy[client] is None and queue and step >= self.ready[client]:
                planned = queue.pop(0)
                self.busy[client] = planned.index
                yield planned

    def finished(self, client: int, step: int) -> None:
        self.busy[client] = None
        queue = self.queues[client]
        self.ready[client] = step + queue[0].gap if queue else None

    def idle(self) -> bool:
        """No request in flight."""
        return all(b is None for b in self.busy)

    def next_step(self, step: int) -> int | None:
        """The step the next idle client sends at (no earlier than `step`); None: none left."""
        waiting = [r for r, q, b in zip(self.ready, self.queues, self.busy) if q and b is None]
        return max(step, min(waiting)) if waiting else None


def plan_load(shape: LoadShape, seed: int = 0) -> LoadPlan:
    """The seeded plan (module docstring); BadInput on a shape that cannot be drawn."""
    _check(shape)
    rng = random.Random(seed)
    lo, hi = shape.vocab
    draw = lambda n: tuple(rng.randrange(lo, hi) for _ in range(n))   # noqa: E731
    prefixes = [draw(shape.prefix_length) for _ in range(shape.prefixes)]
    requests = []
    for index in range(shape.requests):
        long = rng.random() < shape.long_share
        length = rng.randint(*(shape.long if long else shape.short))
        prefix = rng.randrange(shape.prefixes) if shape.prefixes and rng.random() < shape.prefix_share else None
        head = prefixes[prefix] if prefix is not None else ()
        prompt = head + draw(max(length - len(head), 1))
        greedy = rng.random() < shape.greedy_share
        gap = int(rng.expovariate(1.0 / shape.mean_gap)) if shape.mean_gap > 0 else 0
        requests.append(PlannedRequest(index, index % shape.clients, prompt, shape.tokens,
                                       0.0 if greedy else shape.temperature,
                                       None if greedy else rng.randrange(1 << 30), gap, prefix))
    return LoadPlan(seed, shape, tuple(requests))


def _check(shape: LoadShape) -> None:
    if shape.requests < 1 or shape.clients < 1:
        raise BadInput(f"a load run needs at least one request and one client; got "
                       f"{shape.requests} requests, {shape.clients} clients")
    if shape.tokens < 1:
        raise BadInput(f"--tokens {shape.tokens}: at least 1")
    for name, (lo, hi) in (("short", shape.short), ("long", shape.long), ("vocab", shape.vocab)):
        if not 0 < lo <= hi:
            raise BadInput(f"{name} range ({lo}, {hi}): 0 < low <= high")
    for name in ("long_share", "prefix_share", "greedy_share"):
        if not 0.0 <= getattr(shape, name) <= 1.0:
            raise BadInput(f"{name} {getattr(shape, name)}: a fraction in [0, 1]")
    if shape.prefixes and shape.prefix_length >= shape.long[0]:
        raise BadInput(f"prefix length {shape.prefix_length} must be shorter than a long prompt "
                       f"({shape.long[0]}..)")
