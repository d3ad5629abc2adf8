"""What `kvfid engine-load` runs: its options as a plan's shape, faults and a sweep, the load run
measured and stored (kvfid.tasks.engine_store.load_and_store), and its exit code: 0 every request
equals its alone run, 1 some request differs, 3 some request is missing (no verdict)."""

from __future__ import annotations

from kvfid.errors import EXIT_ENVIRONMENT, EXIT_OK, EXIT_VERDICT, BadInput
from kvfid.engines.load_plan import LoadShape
from kvfid.engines.load_server import Faults
from kvfid.engines.load_sweep import SweepShape
from kvfid.engines.registry import engine_for
from kvfid.tasks.engine_store import load_and_store


def run_engine_load(fmt: str, db, report: bool, out, options: dict, progress=None) -> tuple[str, dict, int]:
    """The command's text, what it wrote, and its exit code."""
    options = dict(options)
    share = options.pop("greedy_share")
    if share is None:       # the plan's default mix, all greedy for an engine that samples no other way
        share = LoadShape.greedy_share if engine_for(options.get("engine") or "vllm").samples else 1.0
    shape = LoadShape(requests=options.pop("requests"), clients=options.pop("clients"),
                      tokens=options.pop("tokens"), greedy_share=share)
    timeout, kill_after = options.pop("client_timeout"), options.pop("kill_server_after")
    faults = None
    if options.get("server"):
        faults = Faults(client_timeout_s=timeout, kill_after=kill_after)
    elif kill_after is not None:
        raise BadInput("--kill-server-after needs --server")
    sweep = None
    if options.pop("sweep"):
        sweep = SweepShape(chunk=options.get("chunk") or SweepShape().chunk)
    text, written, stored = load_and_store(fmt, db, report, out, progress, shape=shape,
                                           faults=faults, sweep=sweep, **options)
    record = stored.record
    code = EXIT_OK if record.exact else EXIT_VERDICT if record.complete else EXIT_ENVIRONMENT
    return text, written, code
