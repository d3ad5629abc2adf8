"""The load sweep: how many co-resident sequences, and how long a prompt, before an engine's
requests part from their alone runs.

For each prompt length (lengths on both sides of 256 tokens and of the chunk size), a pool of
`distinct` greedy prompts is drawn from a seed; each is run alone once, then for each co-resident
count N, N requests (the pool's prompts in turn, so beyond `distinct` some are duplicates, as
`batched:N` duplicates an item) are sent at once, on one engine (the prefix cache off, so no request reads
another's state; chunked prefill by the chunk size; a cache that holds them all, so none is
preempted: the sweep isolates co-residency), and each is compared with its alone run: tokens, and the fp32
bits of each logprob up to the first differing token. The recording scheduler (no states read)
says how many sequences one step really held: prompts longer than the chunk prefill over several
steps, so the first requests may decode while the last still prefill. Greedy only: a seeded request's prompt
would be split (kvfid.engines.load's docstring).
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvfid.engines import vllm_llm
from kvfid.engines.load import _output, recording_into
from kvfid.engines.load_compare import bits, common
from kvfid.engines.seam import EngineConfig, variables
from kvfid.records.engine_load import SweepPoint


@dataclass(frozen=True)
class SweepShape:
    """The sweep's grid (data, apart from the engine)."""

    coresident: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    lengths: tuple[int, ...] | None = None     # None: 200, 320 and the chunk size + 64
    chunk: int = 512
    distinct: int = 8                          # distinct prompts per length
    tokens: int = 8
    seed: int = 0
    vocab: tuple[int, int] = (3, 250)

    def prompt_lengths(self) -> tuple[int, ...]:
        return self.lengths or (200, 320, self.chunk + 64)


def _prompts(shape: SweepShape, length: int) -> list[list[int]]:
    rng = random.Random(shape.seed * 1000003 + length)
    return [[rng.randrange(*shape.vocab) for _ in range(length)] for _ in range(shape.distinct)]


def _differs(a: tuple, b: tuple) -> tuple[bool, int | None]:
    """Whether a run differs from the alone run (tokens or logprob bits), and its first step."""
    (ta, la), (tb, lb) = a, b
    same = common(ta, tb)
    firsts = [i for i in range(same) if bits(la[i]) != bits(lb[i])]
    first = min([*firsts, *([same] if tuple(ta) != tuple(tb) else [])], default=None)
    return first is not None, first


def run_sweep(folder: str, dtype: str, shape: SweepShape, faithful: bool = False,
              threads: int | None = None, say=lambda _: None) -> tuple[SweepPoint, ...]:
    """Every (prompt length, co-resident count) point of the grid."""
    from vllm import SamplingParams  # lazy: vLLM is optional (.venv-vllm only)
    from vllm.inputs import TokensPrompt  # lazy: vLLM is optional (.venv-vllm only)

    params = SamplingParams(temperature=0.0, max_tokens=shape.tokens, logprobs=0, detokenize=False,
                            ignore_eos=True)

    from kvfid.engines.load_scheduler import (  # lazy: vLLM is optional (.venv-vllm only)
        REQUESTS,
        STATES_ENV,
    )

    longest = max(shape.prompt_lengths()) + shape.tokens + 1
    config = EngineConfig(prefix_caching=False, chunk=shape.chunk, faithful=faithful,
                          max_seqs=max(shape.coresident), recording=True)
    points = []
    config = config.with_(model=f"hf:{folder}", dtype=dtype, max_len=longest)
    with variables(**{STATES_ENV: "0"}):
        with tempfile.TemporaryDirectory(prefix="kvfid-sweep-") as work, recording_into(Path(work)), \
                vllm_llm.engine(config) as llm, \
                vllm_llm.torch_threads(threads):
            for length in shape.prompt_lengths():
                pool = _prompts(shape, length)
                say(f"sweep: prompt {length}, {len(pool)} prompts alone")
                alone = [_output(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0])
                         for p in pool]
                for n in shape.coresident:
                    say(f"sweep: prompt {length}, {n} co-resident")
                    made = llm.generate([TokensPrompt(prompt_token_ids=pool[i % len(pool)]) for i in range(n)],
                                        [params] * n, use_tqdm=False)
                    found = [_differs(_output(out), alone[i % len(pool)]) for i, out in enumerate(made)]
                    firsts = [f for d, f in found if d]
                    points.append(SweepPoint(n, length, n, len(firsts), min(firsts, default=None),
                                             _observed(Path(work) / REQUESTS, {o.request_id for o in made})))
    return tuple(points)


def _observed(lines, requests: set[str]) -> int:
    """The most co-resident sequences the recording scheduler saw for these requests."""

    most = 0
    for line in lines.read_text().splitlines() if lines.is_file() else ():
        data = json.loads(line)
        if data["request_id"].rsplit("-", 1)[0] in requests or data["request_id"] in requests:
            most = max(most, int(data["coresident"]))
    return most


def sweep_text(points) -> str:
    """The sweep as lines of text."""
    lines = ["sweep: requests differing from alone, per prompt length and co-resident count"]
    for length in sorted({p.prompt for p in points}):
        row = [p for p in points if p.prompt == length]
        lines.append(f"  prompt {length:>5}: " + "  ".join(
            f"{p.coresident}:{p.differ}/{p.requests}" + (f" (held {p.observed})" if p.observed else "") for p in row))
    return "\n".join(lines)
