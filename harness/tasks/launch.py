"""`kvfid run`: a case, by name or path, run into the ledger, in one process or under torchrun.

Everything the command decides lives here, so the command only prints: which case a name means
(`smoke` is cases/smoke.toml), the item count and shard checked before anything runs, torchrun's
ranks each taking their shard (rank 0 closes the run and reports), and Ctrl-C turned into an
`Interrupted` error that says how to resume. A case with a stack or arm at TP size N runs on N
ranks: spawned here, or torchrun's N; each unit is measured by all of them, rank 0 writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvfid.errors import BadInput, Interrupted
from kvfid.names import CASES, case_names
from kvfid.runs import distributed, matrix, shards
from kvfid.runs.case import load_case
from kvfid.stacks.ranks import on_ranks, ranks
from kvfid.tasks.ledger_views import db_path, publish_result, run_and_publish


def resolve_case(name: str) -> Path:
    """`default` (the GPU case with CUDA, else the CPU one), a name in cases/ (no `/`, no
    `.toml`), or a path; an unknown name is refused naming the cases there (exit 2)."""
    if name == "default":
        return matrix.default_case_path()
    if "/" in name or name.endswith(".toml"):
        return Path(name)
    path = CASES / f"{name}.toml"
    if not path.is_file():
        raise BadInput(f"unknown case {name!r}; give a .toml path or one of: default, "
                       f"{', '.join(case_names())}")
    return path


@dataclass
class Launched:
    """What `kvfid run` prints: the run line and headline (stdout), report files (stderr).
    `lines` is empty on a torchrun rank other than 0."""

    lines: list[str] = field(default_factory=list)
    files: dict = field(default_factory=dict)


def launch(case_name: str, item_count: int | None = None, db=None, resume: str | None = None,
           run_id: str | None = None, shard: str = "0/1", write_report: bool = False,
           quiet: bool = False, jobs: int = 1) -> Launched:
    """Run the case into the ledger (see the module docstring)."""
    case = load_case(resolve_case(case_name))
    if item_count is not None:
        case.with_item_count(item_count)        # refuse a bad count before anything runs
    shard_spec = shards.parse_shard(shard)
    path = db_path(db)
    ranked = distributed.torchrun_rank()
    if case.world > 1 and (shard != "0/1" or jobs > 1):
        raise BadInput(f"{case.source} runs at TP size {case.world}: its ranks measure every "
                       f"unit together; drop --shard/--jobs")
    if ranked and (resume or shard != "0/1" or jobs > 1):
        raise BadInput("under torchrun each rank takes its shard itself; drop "
                       "--shard/--resume/--jobs")
    try:
        if case.world > 1 and not ranked:
            return on_ranks(case.world, _tp_rank, case_name, item_count, path, resume, run_id,
                            write_report, quiet, device=case.stacks[0].device)
        if ranked and case.world > 1:
            launched = distributed.in_group(ranked, case.stacks[0].device, _tp_rank, case_name,
                                            item_count, path, resume, run_id, write_report,
                                            quiet, world=ranked.world)
            return launched or Launched()
        if ranked:
            result = distributed.run_ranked(case, path, ranked, items=item_count, run_id=run_id,
                                            progress=not quiet)
            if ranked.rank != 0:
                return Launched()
            published = publish_result(path, result, report=write_report)
        else:
            published = run_and_publish(case, path, report=write_report, items=item_count,
                                        run_id=run_id, resume=resume, shard=shard_spec,
                                        progress=not quiet, jobs=jobs)
    except matrix.RunInterrupted as stop:
        raise Interrupted(f"what was measured is stored; `kvfid run {case_name} --resume "
                          f"{stop.run_id}` continues run {stop.run_id}") from None
    return _launched(published)


def _launched(published) -> Launched:
    result = published.result
    lines = [f"run {result.run_id} {result.status}: {result.measured} units measured, "
             f"{result.skipped} already stored", published.headline()]
    return Launched(lines, published.files)


def _tp_rank(case_name: str, item_count, path, resume, run_id, write_report: bool, quiet: bool,
             world: int | None = None) -> Launched | None:
    """One rank of a TP case's run: rank 0 runs and publishes it, the others measure with it."""
    case = load_case(resolve_case(case_name))
    if world is not None and world != case.world:
        raise BadInput(f"{case.source} runs at TP size {case.world}; torchrun started {world} "
                       f"ranks")
    if ranks().rank != 0:
        matrix.follow(case)
        return None
    return _launched(run_and_publish(case, path, report=write_report, items=item_count,
                                     run_id=run_id, resume=resume, progress=not quiet))
